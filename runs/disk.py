"""Writes that fail because of the storage: a full disk, a quota, a read-only or failing filesystem.

A run writes checkpoints, the exported model, metrics.jsonl and config.json. When the disk fills, the
error that reaches us is often not the OSError the kernel gave: torch's serializer reports
`unexpected pos 704 vs 598`, safetensors wraps the OS error in its own exception, and
torch.distributed.checkpoint wraps either in a CheckpointException. `write_failure` finds the cause
anyway: the errno anywhere in the exception's chain, else the OS's own wording in its text, else a small
probe write beside the path and the free space there. `WriteError` is then one line naming the path and
the cause, for the trainer to print.
"""

import errno
import os
import uuid

# what the trainer says for each errno a storage failure comes with
REASONS = {errno.ENOSPC: "no space left on device (ENOSPC)", errno.EDQUOT: "disk quota exceeded (EDQUOT)",
           errno.EROFS: "read-only file system (EROFS)", errno.EIO: "input/output error (EIO)"}
# what to do about it before running the same command again
REMEDIES = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space within the quota",
            errno.EROFS: "make the filesystem writable", errno.EIO: "check the disk"}
PROBE_BYTES = 64 * 1024   # what the probe writes: more than a filesystem's last few blocks
LOW_FREE_BYTES = 1 << 20  # less free space than this after a failed write: the disk is full


class WriteError(OSError):
    """Writing `path` failed because of the storage (REASONS); str() is one line naming the path and the cause."""

    def __init__(self, message, path, code):
        super().__init__(code, message, path)
        self.message, self.path = message, path

    def __str__(self):
        return self.message


def _chain(error):
    """`error`, the exceptions it was raised from or during, and those a CheckpointException collected from
    each rank (its `failures`: rank -> exception or (exception, traceback)), each once."""
    seen, todo = [], [error]
    while todo:
        e = todo.pop(0)
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return seen


def _existing_folder(path):
    """The folder `path` is in, or its nearest ancestor that exists (a failed write may have left none)."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    while folder and not os.path.isdir(folder):
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return folder or "."


def _probe(folder):
    """The errno of REASONS that writing PROBE_BYTES in `folder` fails with, else None (the probe is removed)."""
    probe = os.path.join(folder, f".write-probe-{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\0" * PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        return e.errno if e.errno in REASONS else None
    finally:
        try:
            os.remove(probe)
        except OSError:
            pass
    return None


def free_bytes(path):
    """Bytes an unprivileged process may still write on the filesystem holding `path` (None if unknown)."""
    try:
        st = os.statvfs(_existing_folder(path))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def write_failure(error, path):
    """(cause, errno) when writing `path` (a file or a folder) failed because of the storage, else None.

    Call it before removing what the write left: the probe and the free space must see the disk as the
    failed write did.
    """
    chain = _chain(error)
    for e in chain:
        if isinstance(e, OSError) and e.errno in REASONS:
            return REASONS[e.errno], e.errno
    for e in chain:  # wrapped by a library that kept only the text (safetensors: "... os error 28 ...")
        text = str(e)
        for code, reason in REASONS.items():
            if os.strerror(code) in text or f"os error {code})" in text:
                return reason, code
    if not isinstance(error, Exception):
        return None  # KeyboardInterrupt, SystemExit: not the disk
    code = _probe(_existing_folder(path))
    if code is not None:
        return REASONS[code], code
    free = free_bytes(path)
    if free is not None and free < LOW_FREE_BYTES:
        return f"no space left on device (ENOSPC: {free // 1024} KiB free)", errno.ENOSPC
    return None


def check(error, path, what, then=""):
    """A WriteError saying that writing `what` to `path` failed and why (then: what happened next), when the
    storage is to blame; else None. Call it before removing partial files (see write_failure)."""
    found = write_failure(error, path)
    if found is None:
        return None
    reason, code = found
    return WriteError(f"cannot write {f'{what} ' if what else ''}{path}: {reason}" + (f"; {then}" if then else ""),
                      path, code)
