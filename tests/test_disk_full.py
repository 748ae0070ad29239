"""A disk that fills up (or a quota, a read-only or failing filesystem) while a run writes a checkpoint, the
export, metrics.jsonl or config.json: one line naming the path and the cause, nothing partial left behind,
the earlier checkpoints intact, and the same command resumes once there is space.

The in-process tests make the writes fail the way a full disk does, at the level where the bytes go (the
checkpoint writer's file streams, the exported weights, the metrics file); one test fills a real 2.5 MB
filesystem where this machine lets a test mount one."""

import contextlib
import errno
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from runs import disk
from runs import log as run_log
import sharding
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = ["--num_generations=2", "--prompts_per_step=2", "--print_completions_every=0"]
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def steps(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f]  # every line parses: none was left half-written


def leftovers(out):
    """Temporary files and folders anywhere under out (a checkpoint's, an export's, a rewrite's)."""
    return [os.path.join(d, n) for d, dirs, files in os.walk(out) for n in dirs + files
            if n.startswith((".tmp", ".write-probe")) or ".partial-" in n or ".tmp." in n]


def one_line(e):
    text = str(e.value.code)
    assert "\n" not in text and "Traceback" not in text, text
    return text


class FillingStream(io.RawIOBase):
    """A file on a disk with `budget[0]` bytes left: writes past it fail with ENOSPC, after writing what fits."""

    def __init__(self, f, budget):
        self.f, self.budget = f, budget

    def writable(self):
        return True

    def write(self, b):
        n = min(len(b), self.budget[0])
        self.f.write(bytes(b[:n]))
        self.budget[0] -= n
        if n < len(b):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return n

    def tell(self):
        return self.f.tell()

    def seek(self, *a):
        return self.f.seek(*a)

    def flush(self):
        self.f.flush()


@pytest.fixture
def checkpoint_disk(monkeypatch):
    """The checkpoint writer's files on a disk that fills: `space[0]` bytes left once `space` is armed."""
    import torch.distributed.checkpoint.filesystem as fs
    real = fs.FileSystem.create_stream
    space = [None]

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as f:
            yield f if space[0] is None or "w" not in mode else FillingStream(f, space)
    monkeypatch.setattr(fs.FileSystem, "create_stream", create_stream)
    return space


def test_full_disk_during_a_checkpoint(tmp_path, checkpoint_disk, monkeypatch, capsys):
    out = str(tmp_path / "run")
    real_save = sharding.save_checkpoint

    def save(out_dir, step, *a, **k):  # the disk fills up before the checkpoint of step 4 (of the first run)
        if step == 4 and not filled:
            checkpoint_disk[0] = 5000
            filled.append(step)
        return real_save(out_dir, step, *a, **k)
    filled = []
    monkeypatch.setattr(sharding, "save_checkpoint", save)
    argv = [f"--out_dir={out}", *QUICK, "--max_steps=6", "--save_every=2"]
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    text = one_line(e)
    assert os.path.join(out, "checkpoints", ".tmp_step_00000004") in text and "no space left on device" in text
    assert "the earlier ones are intact" in text and f"resumes from {out}/checkpoints/step_00000002" in text
    assert leftovers(out) == []
    assert os.listdir(os.path.join(out, "checkpoints")) == ["step_00000002"]
    assert sharding._check_manifest(os.path.join(out, "checkpoints", "step_00000002")) is None
    assert steps(out) == [1, 2, 3, 4]

    # space again: the same command resumes from the last complete checkpoint and finishes
    checkpoint_disk[0] = None
    capsys.readouterr()
    train.main(argv)
    said = capsys.readouterr().out
    assert f"resuming from {out}/checkpoints/step_00000002 (step 2" in said
    assert steps(out) == [1, 2, 3, 4, 5, 6] and os.path.isdir(os.path.join(out, "model"))
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["step_00000004", "step_00000006"]


def test_full_disk_during_the_export(tmp_path, monkeypatch):
    from runs import export as run_export
    out = str(tmp_path / "run")
    real, calls = run_export._pwrite, []

    def pwrite(fd, tensor, pos):  # some of the weights, then the disk is full
        calls.append(pos)
        if len(calls) > 3:
            raise ENOSPC
        real(fd, tensor, pos)
    monkeypatch.setattr(run_export, "_pwrite", pwrite)
    argv = [f"--out_dir={out}", *QUICK, "--max_steps=2", "--save_every=2"]
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    text = one_line(e)
    assert f"cannot write the exported model {out}/model: no space left on device" in text
    assert leftovers(out) == [] and not os.path.exists(os.path.join(out, "model"))
    assert os.listdir(os.path.join(out, "checkpoints")) == ["step_00000002"]

    monkeypatch.setattr(run_export, "_pwrite", real)
    train.main(argv)  # nothing left to train: resumes at step 2 and exports
    assert os.path.exists(os.path.join(out, "model", "model.safetensors")) and steps(out) == [1, 2]


@pytest.fixture
def metrics_disk(monkeypatch):
    """metrics.jsonl on a disk that fills: `space[0]` bytes left once armed (run_log's own open() is wrapped)."""
    space = [None]

    class Filling:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            if space[0] is not None and len(b) > space[0]:
                self.f.write(bytes(b[:space[0]]))  # what fits goes to disk, as with a real full disk
                space[0] = 0
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if space[0] is not None:
                space[0] -= len(b)
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

    def filling_open(path, mode="r", *a, **k):
        f = open(path, mode, *a, **k)
        return Filling(f) if str(path).endswith("metrics.jsonl") and "a" in mode else f
    monkeypatch.setattr(run_log, "open", filling_open, raising=False)
    return space


def test_full_disk_during_a_metrics_write(tmp_path, metrics_disk, monkeypatch):
    out = str(tmp_path / "run")
    real_train_step = train.train_step

    def train_step(run, step):  # the disk fills up during step 4: its line does not fit
        metrics = real_train_step(run, step)
        if step == 4:
            metrics_disk[0] = 100
        return metrics
    monkeypatch.setattr(train, "train_step", train_step)
    with pytest.raises(SystemExit) as e:
        train.main([f"--out_dir={out}", *QUICK, "--max_steps=8", "--save_every=2"])
    text = one_line(e)
    assert f"{out}/metrics.jsonl: no space left on device" in text and "keeps the steps before it" in text
    assert steps(out) == [1, 2, 3]  # the cut line is gone; the others are whole
    assert leftovers(out) == []
    assert f"resumes from {out}/checkpoints/step_00000002" in text


@pytest.mark.parametrize("code, words", [(errno.ENOSPC, "no space left on device"),
                                         (errno.EDQUOT, "disk quota exceeded"),
                                         (errno.EROFS, "read-only file system"),
                                         (errno.EIO, "input/output error")])
def test_config_json_rewrite_that_fails_leaves_the_old_one(tmp_path, monkeypatch, code, words):
    path = tmp_path / "config.json"
    path.write_text('{"old": 1}\n')

    class Failing(io.StringIO):
        def flush(self):
            raise OSError(code, os.strerror(code))
    real_open = open

    def failing_open(p, mode="r", *a, **k):
        if "w" in mode:
            real_open(p, mode).close()  # the temporary file exists, as it would
            return Failing()
        return real_open(p, mode, *a, **k)
    monkeypatch.setattr(run_log, "open", failing_open, raising=False)
    with pytest.raises(disk.WriteError) as e:
        run_log.write_atomic(str(path), '{"new": 2}\n')
    assert str(e.value) == f"cannot write {path}: {words} ({errno.errorcode[code]}); config.json is as it was"
    assert e.value.errno == code and path.read_text() == '{"old": 1}\n' and os.listdir(tmp_path) == ["config.json"]


def test_the_cause_is_found_inside_wrapping_errors(tmp_path):
    """torch's serializer, safetensors and torch.distributed.checkpoint each wrap the OS error their own way."""
    raised_from = RuntimeError("writer failed")
    raised_from.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")

    class CheckpointLike(BaseException):
        def __init__(self, failures):
            self.failures = failures
    for error, expected in [
        (raised_from, errno.EDQUOT),
        (RuntimeError("No space left on device (os error 28)"), errno.ENOSPC),
        (CheckpointLike({0: (OSError(errno.EROFS, "Read-only file system"), "traceback")}), errno.EROFS),
    ]:
        assert disk.write_failure(error, str(tmp_path))[1] == expected
    # the errno lost (torch's "unexpected pos 704 vs 598"): a disk with space is not blamed...
    assert disk.write_failure(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
                              str(tmp_path / "a" / "b")) is None
    assert os.listdir(tmp_path) == []  # the probe is gone
    assert disk.write_failure(KeyboardInterrupt(), str(tmp_path)) is None


def test_a_lost_errno_is_found_by_probing_the_disk(tmp_path, monkeypatch):
    """...a full one is: a probe write beside the path fails with the disk's own errno."""
    real_write = os.write

    def write(fd, data):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".write-probe"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)
    if not os.path.exists("/proc/self/fd"):
        pytest.skip("needs /proc to tell the probe's writes apart")
    monkeypatch.setattr(os, "write", write)
    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert disk.write_failure(error, str(tmp_path / "checkpoints" / ".tmp_step_00000005")) == \
        ("no space left on device (ENOSPC)", errno.ENOSPC)
    assert os.listdir(tmp_path) == []


def _mount_command(scratch):
    """A command prefix under which a test may mount a filesystem (root, or a user namespace), else None."""
    if not sys.platform.startswith("linux") or not shutil.which("unshare"):
        return None
    for prefix in (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"]):
        probe = subprocess.run(prefix + ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(scratch)],
                               capture_output=True)
        if probe.returncode == 0:
            return prefix
    return None


def test_a_real_small_filesystem(tmp_path):
    """2.5 MB: room for the tiny model and one checkpoint (1.7 MB), not two. The mount lives in a mount
    namespace of its own, gone with the command."""
    prefix = _mount_command(tmp_path)
    if prefix is None:
        pytest.skip("this machine does not let a test mount a small filesystem (unshare, tmpfs)")
    small, big = tmp_path / "small", tmp_path / "big"
    small.mkdir()
    args = f"{' '.join(QUICK)} --max_steps=6 --save_every=2"
    script = (f"mount -t tmpfs -o size=2500k tmpfs {small} && cd {ROOT} && "
              f"{sys.executable} train.py --out_dir={small}/run {args}; echo \"exit $?\"; "
              f"ls -A {small}/run/checkpoints; cp -a {small}/run {big}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(prefix + ["sh", "-c", script], capture_output=True, text=True, env=env, timeout=300)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{small}/run/checkpoints/.tmp_step_00000004: no space left on device" in lines[0], \
        p.stdout + p.stderr
    assert p.stdout.strip().splitlines()[-2:] == ["exit 1", "step_00000002"], p.stdout
    # the folder, copied where there is space: the same command resumes from the complete checkpoint
    p = subprocess.run([sys.executable, "train.py", f"--out_dir={big}", *args.split()], cwd=ROOT, capture_output=True,
                       text=True, env=env, timeout=300)
    assert p.returncode == 0 and f"resuming from {big}/checkpoints/step_00000002" in p.stdout, p.stdout + p.stderr
    assert steps(str(big)) == [1, 2, 3, 4, 5, 6]
