"""The launcher: the sandbox's side of sandbox/executor.py. A fresh `python -I -S` per program runs launch(STATUS, CONTROL),
reads its spec on stdin, builds the sandbox (strict: namespaces, a root of read-only paths, a tmpfs /tmp; unsafe: a
folder), sets the limits, installs the system-call filter (seccomp) and execs the program's Python.

It imports only os at the top, and ctypes, marshal, resource, select and seccomp in launch(), before
it gives up root: once uid 65534, the standard library may be out of reach (a pyenv under /root).
"""

import os

# Runs with the spec on stdin. Strict, as root: unshare a pid namespace, fork the
# program's init; the child unshares user, mount, network, ipc and uts namespaces; the parent, still root outside,
# maps uid 65534 inside to 65534 outside (a root mapping would let the program open root's files); the child takes
# uid 65534, builds its root, sets its limits and execs Python, while the parent waits and reports. Not root: the
# launcher unshares every namespace at once, maps 65534 inside to its own uid, then forks the init.

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_NAMESPACES = ((CLONE_NEWUSER, "user"), (CLONE_NEWPID, "pid"), (CLONE_NEWNET, "network"), (CLONE_NEWNS, "mount"),
               (CLONE_NEWIPC, "ipc"), (CLONE_NEWUTS, "uts"))
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217}
DEVICES = ("null", "zero", "full", "random", "urandom")


class _SetupError(Exception):
    """A step of building the sandbox failed; the message names the step and the error."""


def launch(status_fd, control_fd, group=()):
    """`group`: the cgroup.procs files of the program's control group, joined first (before the spec comes)."""
    for fd in (status_fd, control_fd):
        os.set_inheritable(fd, False)  # pass_fds made them inheritable; the program must not get them
    try:
        for path in group:
            _write(path, str(os.getpid()), "join the control group")
        # every import now: once root has become uid 65534, the standard library may be out of reach (a pyenv in /root)
        import ctypes
        import marshal
        import resource  # noqa: F401 - for _set_limits
        import select
        from sandbox import seccomp
        spec = marshal.loads(_read_exactly(0, int.from_bytes(_read_exactly(0, 8), "little")))
        libc = ctypes.CDLL(None, use_errno=True)
        if spec["mode"] == "strict":
            alive = _strict(spec, libc, status_fd, control_fd)  # only the program's side returns
        else:
            _unsafe(spec)
        _set_limits(spec["limits"], spec["mode"] == "strict" and not spec["group_counts_processes"])
        _prctl(libc, PR_SET_NO_NEW_PRIVS, 1, "no_new_privs")  # no setuid binary can give privileges back
        if spec["mode"] == "strict":
            # the launcher's death (run() kills it at the timeout) kills this init, and with it the whole namespace
            _prctl(libc, PR_SET_PDEATHSIG, 9, "pdeathsig")
            if select.select([alive], [], [], 0)[0]:  # the launcher died before the line above: end now
                os._exit(1)
            os.close(alive)
        if spec["seccomp"] is None and spec["mode"] == "strict":
            raise _SetupError(f"seccomp: no system call table for {os.uname().machine} (x86_64 and aarch64 known)")
        try:  # last: building the sandbox needed the calls this denies
            if spec["seccomp"] is not None:
                seccomp.install(spec["seccomp"], libc)
        except OSError as e:
            raise _SetupError(e.strerror) from None
        os.execve(spec["python"], spec["argv"], {})
    except BaseException as e:  # noqa: B902 - whatever happens, report it on the status pipe, never as the program
        message = str(e) if isinstance(e, _SetupError) else f"launcher: {type(e).__name__}: {e}"
        try:
            os.write(status_fd, f"E {message}".replace("\n", " ").encode() + b"\n")
        finally:
            os._exit(127)


def _read_exactly(fd, n):
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            raise EOFError("the spec ended early")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _fail(step, errno=None):
    import ctypes
    errno = ctypes.get_errno() if errno is None else errno
    raise _SetupError(f"{step} ({os.strerror(errno)})")


def _prctl(libc, option, value, name):
    if libc.prctl(option, value, 0, 0, 0) != 0:
        _fail(f"prctl {name}")


def _unshare(libc, flags, what):
    if libc.unshare(flags) != 0:
        import ctypes
        errno = ctypes.get_errno()
        raise _SetupError(_which_namespace(libc, flags) or f"{what} (unshare: {os.strerror(errno)})")


def _which_namespace(libc, flags):
    """Which of the namespaces in `flags` this machine refuses, tried one at a time in throwaway children."""
    import ctypes
    for flag, name in _NAMESPACES:
        if not flags & flag:
            continue
        pid = os.fork()
        if pid == 0:
            extra = 0 if flag == CLONE_NEWUSER or os.geteuid() == 0 else CLONE_NEWUSER
            os._exit(0 if libc.unshare(flag | extra) == 0 else min(ctypes.get_errno(), 255) or 1)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code:
            return f"{name} namespaces (unshare: {os.strerror(code)})"
    return None


def _write(path, text, step):
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
    except OSError as e:
        _fail(step, e.errno)


def _map_ids(pid, inner, uid, gid):
    _write(f"/proc/{pid}/setgroups", "deny", "uid mapping: setgroups")
    _write(f"/proc/{pid}/uid_map", f"{inner} {uid} 1", "uid mapping: uid_map")
    _write(f"/proc/{pid}/gid_map", f"{inner} {gid} 1", "uid mapping: gid_map")


def _strict(spec, libc, status_fd, control_fd):
    """Namespaces and the program's init. The launcher waits for the init and exits; the init returns a pipe that
    reads end-of-file once the launcher is gone."""
    inner = spec["uid"]
    others = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    root = os.geteuid() == 0
    if root:
        os.setgroups([])  # root's supplementary groups would survive into the namespace
        _unshare(libc, CLONE_NEWPID, "pid namespace")
    else:
        uid, gid = os.geteuid(), os.getegid()
        _check_not_root_outside(uid)
        _unshare(libc, CLONE_NEWUSER | CLONE_NEWPID | others, "namespaces")
        _map_ids("self", inner, uid, gid)
    alive_r, alive_w = os.pipe()  # end-of-file for the init once the launcher is gone
    ready_r, ready_w = os.pipe()  # root: the init has its user namespace; map it
    go_r, go_w = os.pipe()        # root: mapped; go on
    pid = os.fork()
    if pid:  # the launcher
        for fd in (alive_r, ready_w, go_r, 0, 1, 2):  # 0-2: the program's end is then the end of its output
            os.close(fd)
        if root and os.read(ready_r, 1) == b"u":
            try:
                _map_ids(pid, inner, inner, inner)
                os.write(go_w, b"g")
            except _SetupError as e:
                os.write(status_fd, f"E {e}\n".encode())
        os.close(go_w)
        _wait_and_report(pid, spec["timeout"], status_fd, control_fd)
    for fd in (alive_w, ready_r, go_w, control_fd):
        os.close(fd)
    _first_to_kill()
    os.setsid()  # a session of its own: kill(0, ...) from the program reaches only the sandbox
    if root:
        _unshare(libc, CLONE_NEWUSER | others, "namespaces")
        os.write(ready_w, b"u")
        if os.read(go_r, 1) != b"g":
            os._exit(1)
    os.close(ready_w)
    os.close(go_r)
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE, None, "make / private")
    # opened while still root (outside): the path to Python may cross folders that uid 65534 cannot (a pyenv in /root)
    sources = _open_sources(list(spec["read_only"]) + [(f"/dev/{name}",) * 2 for name in DEVICES])
    if root:
        os.setresgid(inner, inner, inner)  # mapped now: what the program writes belongs to 65534 outside
        os.setresuid(inner, inner, inner)  # (capabilities in the namespace stay until exec: no uid 0 is mapped)
        _prctl(libc, PR_SET_DUMPABLE, 1, "dumpable")  # the uid change hid /proc/self/fd, where the sources are
    _build_root(spec, libc, sources)
    if libc.sethostname(b"sandbox", 7) != 0:
        _fail("sethostname")
    return alive_r


def _check_not_root_outside(uid):
    """A trainer that is not root here but is root one user namespace up (a container mapping its users onto the
    host's root) would give the program root's identity outside, for which the kernel does not apply RLIMIT_NPROC:
    a fork bomb would be unbounded. Refuse that, rather than run without a process limit."""
    with open("/proc/self/uid_map") as f:
        for line in f:
            inside, outside, count = map(int, line.split())
            if inside <= uid < inside + count and outside + uid - inside == 0:
                raise _SetupError(f"process limit: uid {uid} is root outside this user namespace, where the kernel "
                                  f"does not count processes against RLIMIT_NPROC; run the trainer as root or as an "
                                  f"ordinary user")


def _wait_and_report(pid, timeout, status_fd, control_fd):
    """Wait for the init; kill it when run() asks (a byte on the control pipe, or its end: run() is gone) or a
    second after the timeout; reap it, report its status and exit. The init, until reaped, is the launcher's alone
    to kill (its pid cannot be anyone else's), and it reaps every process of its namespace before it dies."""
    import select
    pidfd = os.pidfd_open(pid)
    if pidfd not in select.select([pidfd, control_fd], [], [], timeout + 1)[0]:
        os.kill(pid, 9)
    status = os.waitpid(pid, 0)[1]
    os.write(status_fd, f"X {status}\n".encode())
    os._exit(0)


def _mount(libc, source, target, fstype, flags, data, step):
    if libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                  data and data.encode()) != 0:
        _fail(f"mount: {step}")


def _open_sources(pairs):
    """{path inside: ("link", target) or (O_PATH descriptor, mount flags to keep)} of what the sandbox shows of the
    host, from (host path, path inside) pairs."""
    sources = {}
    for path, inside in pairs:
        if os.path.islink(path):  # /bin -> usr/bin
            sources[inside] = ("link", os.readlink(path))
        else:
            sources[inside] = (os.open(path, os.O_PATH | os.O_CLOEXEC), _kept_flags(path))
    return sources


def _kept_flags(path):
    """A bind mount made in a user namespace must keep its source's nosuid, nodev, noexec and atime flags."""
    f = os.statvfs(path).f_flag
    flags = MS_NOSUID | MS_NODEV | (MS_NOEXEC if f & os.ST_NOEXEC else 0)
    flags |= (MS_NOATIME if f & os.ST_NOATIME else 0) | (MS_NODIRATIME if f & os.ST_NODIRATIME else 0)
    return flags | (MS_RELATIME if f & os.ST_RELATIME else 0)


def _build_root(spec, libc, sources):
    """The program's filesystem: a tmpfs root holding the read-only paths, a few devices and a tmpfs /tmp with the
    program's files; pivot_root into it and drop the host's tree."""
    top = spec["mountpoint"]
    if top is None:
        raise _SetupError("mount: no host folder to build the sandbox's root on")
    _mount(libc, "sandbox", top, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755", f"tmpfs on {top}")
    # the program's own /tmp: nothing of the host's /tmp shows there (an installation under it is moved aside)
    os.makedirs(top + "/tmp")
    _mount(libc, "tmp", top + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['disk']},mode=0700",
           "tmpfs /tmp")
    for path in sorted(sources):  # a folder before what lies in it (a conda environment inside its base)
        fd, flags = sources[path]
        target = top + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if fd == "link":
            os.symlink(flags, target)
            continue
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(target, exist_ok=True)
        else:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
        _mount(libc, f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC, None, f"bind {path}")
        if not path.startswith("/dev/"):  # the devices stay writable (/dev/null)
            _mount(libc, None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags, None, f"read-only {path}")
        os.close(fd)
    os.symlink("/proc/self/fd", top + "/dev/fd")
    for name, data in spec["files"].items():
        fd = os.open(f"{top}/tmp/{name}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    _mount(libc, None, top, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None, "read-only root")
    os.chdir(top)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise _SetupError(f"pivot_root: no system call number known for {os.uname().machine}")
    if libc.syscall(number, b".", b".") != 0:  # the new root over the old one (pivot_root(2), notes) ...
        _fail("pivot_root")
    if libc.umount2(b".", MNT_DETACH) != 0:  # ... which is then dropped: the host's tree is gone
        _fail("umount the host's root")
    os.chdir("/tmp")


def _first_to_kill():
    """The program's processes (this one and all it starts) are the OOM killer's first choice, whether memory runs
    out in the machine or in the program's group; the launcher's and the trainer's scores stay as they are."""
    _write("/proc/self/oom_score_adj", "1000", "oom_score_adj")


def _unsafe(spec):
    """The folder made by run() gets the program's files and is its working folder; nothing else changes."""
    _first_to_kill()
    os.chdir(spec["workdir"])
    for name, data in spec["files"].items():
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


def _set_limits(limits, nproc):
    import resource
    pairs = [(resource.RLIMIT_AS, limits["memory"]), (resource.RLIMIT_CPU, limits["cpu"]),
             (resource.RLIMIT_FSIZE, limits["file_size"]), (resource.RLIMIT_NOFILE, limits["open_files"]),
             (resource.RLIMIT_CORE, 0)]
    # counted per user namespace, so per sandbox; outside one it would count all the user's processes. Not where
    # the program's control group counts them (it then names the budget a refused fork hit)
    if nproc:
        pairs.append((resource.RLIMIT_NPROC, limits["processes"]))
    for name, value in pairs:
        resource.setrlimit(name, (value, value))

