"""Run Python that the policy wrote: each program in a fresh process, sandboxed, with limits.

    result = executor.run("print(1 + 1)")     # Result: stdout, stderr, exit_code, timed_out, wall_time, sandbox_error
    results = executor.run_many(["print(1)", {"code": "print(input())", "stdin": "hi"}])  # a pool, one per CPU
    executor.python("print(2 ** 10)")         # the tool a policy calls: "1024\n"

Modes (the `sandbox` argument, else the environment variable GRPO_SANDBOX, which train.py sets from --sandbox):
  strict  Linux namespaces. A user namespace in which the program runs as uid 65534 (mapped to nobody outside when the
          trainer is root, else to the trainer's own uid) and keeps no capability; a network namespace (a loopback that
          is down: no network, not even the trainer's 127.0.0.1); a pid namespace whose init is the program, so that
          when it ends, or is killed, the kernel kills everything it started, daemons included (as an init, it also
          ignores the signals it sends itself without a handler); a mount namespace whose
          root holds only /usr, Python's installation and a few devices, read-only, and a private tmpfs for /tmp, the
          working folder (no home, no out_dir, no /etc/shadow, no /proc); ipc and uts namespaces. And all of unsafe.
  auto    strict. Where the kernel refuses a namespace, every run refuses with one line naming what is missing; it
          never falls back to unsafe by itself.
  unsafe  what needs no namespace: resource limits (no process limit: outside a user namespace RLIMIT_NPROC counts
          every process of the user), a new session killed as one group, an empty temporary folder and an empty
          environment. Not a sandbox: the program runs as the trainer's user (UNSAFE_BANNER says what it lacks).

Every program gets a wall-clock timeout, and limits on CPU time, address space (RLIMIT_AS), file size, processes and
open files; its stdout and stderr are cut at `max_output` bytes each. It runs as `python -I -S`: isolated mode, no
`site`, so only the standard library, and a faster start than a plain `python file.py` (README: Running
model-written code, for the measured overhead).

How: run() starts `python -I -S` running this module's _launch(STATUS, CONTROL) (the launcher), sends it a spec on
stdin (then the program's stdin), and reads the program's stdout and stderr. The launcher builds the sandbox, forks
the program's init and waits for it; it reports on STATUS, a pipe the program never holds, a failure while building
the sandbox ("E ..."), then the program's exit status ("X ..."), so a program cannot pass for a sandbox failure nor
fake its status; at the timeout run() writes to CONTROL and the launcher kills the init, which takes its whole
namespace with it, and reaps it: when the launcher exits, nothing of the program is left.
"""

import atexit
import os
import sys
import time
import _thread

# The launcher (a fresh interpreter running _launch, once per program) imports only what is above, plus ctypes,
# marshal, resource and select; the trainer's side imports subprocess, selectors and the thread pool inside the functions
# that use them, so that no program's start pays for them (about 25 ms on a slow core).

KiB, MiB = 1 << 10, 1 << 20
SANDBOX_MODES = ("auto", "strict", "unsafe")
SANDBOX_UID = 65534          # the program's uid: `nobody` on most systems
DEFAULT_TIMEOUT = 10.0       # seconds of wall clock
DEFAULT_MEMORY = 512 * MiB   # address space per process (RLIMIT_AS)
DEFAULT_FILE_SIZE = 16 * MiB  # largest file a program may write (RLIMIT_FSIZE)
DEFAULT_PROCESSES = 32       # processes and threads of one sandbox (RLIMIT_NPROC; strict only)
DEFAULT_DISK = 64 * MiB      # strict: size of the tmpfs at /tmp, the working folder
DEFAULT_MAX_OUTPUT = 64 * KiB  # bytes kept of stdout and of stderr each
OPEN_FILES = 256             # RLIMIT_NOFILE
PROGRAM_FILE = "main.py"

UNSAFE_BANNER = ("sandbox: UNSAFE mode: model-written programs run as the trainer's own user with resource limits, "
                 "a process group, an empty temporary folder and an empty environment only; they can reach the "
                 "network, read and change whatever that user can (its credentials, the out_dir), signal its "
                 "processes, fork without limit, and outlive their timeout by leaving their session")


class ExecutorUnavailable(RuntimeError):
    """The strict sandbox cannot be built on this machine; the message is one line naming what is missing."""


class Result:
    """What became of one program.

    stdout, stderr: text (undecodable bytes replaced), each cut at max_output bytes (`truncated` then True).
    exit_code: the program's exit status, negative for the signal that killed it, None when it timed out or never ran.
    timed_out: it was killed at the wall-clock timeout. wall_time: seconds from start to the end of its output.
    sandbox_error: why the sandbox could not run it (None when it ran); `sandbox_failed` is that as a flag.
    """
    __slots__ = ("stdout", "stderr", "exit_code", "timed_out", "wall_time", "sandbox_error", "truncated")

    def __init__(self, stdout="", stderr="", exit_code=None, timed_out=False, wall_time=0.0, sandbox_error=None,
                 truncated=False):
        self.stdout, self.stderr, self.exit_code, self.timed_out = stdout, stderr, exit_code, timed_out
        self.wall_time, self.sandbox_error, self.truncated = wall_time, sandbox_error, truncated

    @property
    def sandbox_failed(self):
        return self.sandbox_error is not None

    def __repr__(self):
        return "Result(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"


# ----------------------------------------------------------------------------- the trainer's side

_lock = _thread.allocate_lock()        # the counts and the spares
_probe_lock = _thread.allocate_lock()  # one probe at a time; it runs a program, which takes _lock
_probe_result = None  # None: not probed yet; "": strict works here; else what is missing
_STATS_ZERO = {"programs": 0, "timeouts": 0, "sandbox_failures": 0, "program_seconds": 0.0, "wait_seconds": 0.0}
_stats = dict(_STATS_ZERO)


def take_stats():
    """Counts since the last call, and reset: programs run, timeouts, sandbox failures, the programs' wall seconds
    summed, and the wall seconds callers waited in run_many. The trainer logs them per step."""
    global _stats
    with _lock:
        out, _stats = _stats, dict(_STATS_ZERO)
    return out


def _count(key, value=1):
    with _lock:
        _stats[key] += value


def check(sandbox=None):
    """The mode programs will run in ("strict" or "unsafe"); ExecutorUnavailable where strict is asked for (auto
    included) and the machine cannot give it. The first strict check runs one program to see (about 20 ms)."""
    mode = sandbox or os.environ.get("GRPO_SANDBOX") or "auto"
    if mode not in SANDBOX_MODES:
        raise ValueError(f"sandbox: one of {', '.join(SANDBOX_MODES)}, got {mode!r}")
    if mode == "unsafe":
        return mode
    global _probe_result
    with _probe_lock:
        if _probe_result is None:
            _probe_result = _probe()
        missing = _probe_result
    if missing:
        raise ExecutorUnavailable(f"strict sandbox unavailable here: {missing}; --sandbox=unsafe (sandbox='unsafe') "
                                  f"runs programs with resource limits, a process group, a temporary folder and an "
                                  f"empty environment only")
    return "strict"


def _probe():
    """'' when a program runs in the strict sandbox here, else what went wrong, as a clause."""
    result = _execute(_options(code="import sys; sys.stdout.write('ok')", timeout=20.0), "strict")
    if result.sandbox_error:
        return result.sandbox_error
    if result.stdout != "ok":
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return f"the sandboxed Python did not run (exit {result.exit_code}): {last[:200]}"
    return ""


def _options(code, stdin="", files=None, timeout=DEFAULT_TIMEOUT, memory=DEFAULT_MEMORY, cpu=None,
             file_size=DEFAULT_FILE_SIZE, processes=DEFAULT_PROCESSES, disk=DEFAULT_DISK,
             max_output=DEFAULT_MAX_OUTPUT):
    files = dict(files or {})
    for name in files:
        if not name or "/" in name or name in (".", "..") or name == PROGRAM_FILE:
            raise ValueError(f"files: {name!r} must be a plain file name other than {PROGRAM_FILE}")
    files[PROGRAM_FILE] = code
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    return dict(files={k: v.encode() if isinstance(v, str) else bytes(v) for k, v in files.items()},
                stdin=stdin.encode() if isinstance(stdin, str) else bytes(stdin), timeout=float(timeout),
                limits=dict(memory=int(memory), cpu=int(cpu) if cpu else int(timeout) + 1, file_size=int(file_size),
                            processes=int(processes), open_files=OPEN_FILES),
                disk=int(disk), max_output=int(max_output))


def run(code, stdin="", *, files=None, timeout=DEFAULT_TIMEOUT, memory=DEFAULT_MEMORY, cpu=None,
        file_size=DEFAULT_FILE_SIZE, processes=DEFAULT_PROCESSES, disk=DEFAULT_DISK, max_output=DEFAULT_MAX_OUTPUT,
        sandbox=None):
    """Run one program (Python source) and return its Result.

    stdin: text or bytes on its standard input. files: {name: text or bytes} written beside it in its empty folder
    (it runs as main.py there). timeout: wall-clock seconds. memory: bytes of address space per process. cpu: CPU
    seconds per process (default: the timeout rounded down, plus 1). file_size: bytes of the largest file it may
    write. processes: how many processes and threads it may have at once. disk: bytes of its tmpfs (strict).
    max_output: bytes kept of stdout and of stderr each. sandbox: auto, strict or unsafe (module docstring).
    ExecutorUnavailable where strict is asked for and the machine cannot give it.
    """
    options = _options(code, stdin, files, timeout, memory, cpu, file_size, processes, disk, max_output)
    result = _execute(options, check(sandbox))
    _count("programs")
    _count("program_seconds", result.wall_time)
    _count("timeouts", int(result.timed_out))
    _count("sandbox_failures", int(result.sandbox_failed))
    return result


def run_many(programs, *, workers=None, **options):
    """Run many programs at once, `workers` at a time (default: one per CPU this process may use); their Results,
    in order. A program is its source, or a dict of run()'s arguments ({"code": ..., "stdin": ..., "timeout": ...});
    `options` are run()'s keyword arguments for all of them. Each program has its own timeout, counted from its own
    start: a slow one costs its own time, not the others'."""
    from concurrent.futures import ThreadPoolExecutor
    jobs = [dict(options, **(p if isinstance(p, dict) else {"code": p})) for p in programs]
    if not jobs:
        return []
    check(options.get("sandbox"))  # once, before the pool: an unavailable sandbox is one error, not one per program
    t0 = time.monotonic()
    workers = workers or len(os.sched_getaffinity(0))
    with ThreadPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
        results = list(pool.map(lambda job: run(**job), jobs))
    _count("wait_seconds", time.monotonic() - t0)
    return results


TOOL_TIMEOUT = 10.0
TOOL_MAX_CHARS = 4000


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it printed.

    The program runs in a fresh Python 3 interpreter with the standard library only, no network, an empty working
    folder and a 10-second time limit; nothing is kept between calls. Print what you want to see.

    Args:
        code: The whole program, as Python source.

    Returns:
        What the program wrote to standard output, then to standard error, with a note when it timed out or exited
        with an error; the middle of a long output is cut. When it could not be run, the reason, starting with
        "error:".
    """
    try:
        result = run(code, timeout=TOOL_TIMEOUT)
    except (ExecutorUnavailable, ValueError) as e:
        return f"error: {e}"
    if result.sandbox_failed:
        return f"error: the sandbox failed: {result.sandbox_error}"
    text = result.stdout + result.stderr
    if result.timed_out:
        text += f"\n[timed out after {TOOL_TIMEOUT:g} seconds]"
    elif result.exit_code:
        text += f"\n[exit code {result.exit_code}]"
    if len(text) > TOOL_MAX_CHARS:
        half = TOOL_MAX_CHARS // 2
        text = f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"
    return text


def _read_only_paths():
    """Host paths the strict sandbox shows, read-only, at the same place: the system's programs and libraries, the
    dynamic linker's cache, Python's installation (wherever it lies: a pyenv under /root, a venv, conda)."""
    paths = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache"]
    for prefix in {sys.base_prefix, sys.prefix, sys.exec_prefix, os.path.dirname(os.path.dirname(_python()))}:
        real = os.path.realpath(prefix)
        if real != "/usr" and not real.startswith("/usr/"):
            paths.append(real)
    return [p for p in dict.fromkeys(paths) if os.path.lexists(p)]


def _mountpoint(paths):
    """A host folder under which none of `paths` lies: the strict sandbox mounts its new root there (inside its own
    mount namespace, so the host never sees it)."""
    for candidate in ("/mnt", "/media", "/srv", "/opt", "/var/tmp", "/tmp", "/home"):
        if os.path.isdir(candidate) and not os.path.islink(candidate) and \
                not any(p == candidate or p.startswith(candidate + "/") for p in paths):
            return candidate
    return None


def _python():
    return os.path.realpath(sys.executable)


_paths = None


def _sandbox_paths():
    """(read-only paths, mountpoint), found once."""
    global _paths
    if _paths is None:
        paths = _read_only_paths()
        _paths = paths, _mountpoint(paths)
    return _paths


_spares = []  # launchers started ahead of need, waiting for their spec
_spares_pid = os.getpid()


def _take_launcher():
    """(Popen, status pipe, control pipe) of a launcher waiting for its spec. One started ahead of time when there
    is one, so that its interpreter's start (about 12 ms) overlapped the program before; and a new one, started
    now, for the next program. At most one spare per program running at once."""
    global _spares, _spares_pid
    with _lock:
        if _spares_pid != os.getpid():  # a forked trainer: its parent's spares are not its children
            _spares, _spares_pid = [], os.getpid()
        taken = _spares.pop() if _spares else None
    spare = _start_launcher()
    with _lock:
        _spares.append(spare)
    return taken or _start_launcher()


def _start_launcher():
    import subprocess
    status_r, status_w = os.pipe()    # the launcher's reports
    control_r, control_w = os.pipe()  # strict: a byte, or end-of-file, and the launcher kills the sandbox's init
    try:
        proc = subprocess.Popen([_python(), "-I", "-S", "-c", _LAUNCH.format(
            os.path.dirname(os.path.abspath(__file__)), status_w, control_r)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_w, control_r), env={}, cwd="/",
            start_new_session=True)
    except OSError:
        os.close(status_r)
        os.close(control_w)
        raise
    finally:
        os.close(status_w)
        os.close(control_r)
    return proc, status_r, control_w


def _discard_spares():
    """At exit: a spare reads end-of-file for its spec and ends (as it does when the trainer dies)."""
    import subprocess
    if _spares_pid != os.getpid():
        return
    for proc, status_r, control_w in _spares:
        for f in (proc.stdin, proc.stdout, proc.stderr):
            f.close()
        os.close(status_r)
        os.close(control_w)
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.wait()


def _execute(options, mode):
    """Take a launcher for one program, feed it, collect its output; a Result (no exception for the program's
    doings: those are in the Result)."""
    import marshal
    import shutil
    import tempfile
    python, (paths, mountpoint) = _python(), _sandbox_paths()
    workdir = tempfile.mkdtemp(prefix="grpo-exec-") if mode == "unsafe" else None
    spec = dict(mode=mode, python=python, argv=[python, "-I", "-S", PROGRAM_FILE], files=options["files"],
                limits=options["limits"], timeout=options["timeout"], uid=SANDBOX_UID, read_only=paths,
                mountpoint=mountpoint, disk=options["disk"], workdir=workdir)
    header = marshal.dumps(spec)
    start = time.monotonic()
    try:
        try:
            proc, status_r, control_w = _take_launcher()
        except OSError as e:
            return Result(sandbox_error=f"cannot start the launcher: {e}", wall_time=time.monotonic() - start)
        try:
            data = len(header).to_bytes(8, "little") + header + options["stdin"]
            # strict: at the timeout the launcher kills the init and reaps it, so that when it exits nothing of the
            # sandbox is left; unsafe: the launcher is the program, and its process group is killed
            stop = (lambda: _write_ignoring(control_w, b"k")) if mode == "strict" else (lambda: _kill_group(proc))
            out, err, status, timed_out, truncated = _exchange(proc, data, status_r, start + options["timeout"],
                                                               options["max_output"], stop)
        finally:
            os.close(status_r)
            os.close(control_w)
    finally:
        if workdir:
            shutil.rmtree(workdir, onerror=_force_remove)
    wall = time.monotonic() - start
    report = status.decode(errors="replace").splitlines()
    errors = [line[2:] for line in report if line.startswith("E ")]
    exits = [line[2:] for line in report if line.startswith("X ")]
    sandbox_error = errors[0] if errors else None
    if mode == "strict":  # the launcher waited for the program (the sandbox's init) and reported its status
        exit_code = os.waitstatus_to_exitcode(int(exits[-1])) if exits else None
        if not exits and not timed_out and sandbox_error is None:
            sandbox_error = f"the launcher ended (exit {proc.returncode}) without reporting the program's status"
    else:  # the launcher became the program
        exit_code = proc.returncode
    if timed_out:
        exit_code = None
    return Result(out.decode(errors="replace"), err.decode(errors="replace"), exit_code, timed_out, wall,
                  sandbox_error, truncated)


def _force_remove(function, path, excinfo):
    """shutil.rmtree's onerror, for what a program left unreadable (a folder of mode 000): allow, then retry."""
    import shutil
    try:
        os.chmod(os.path.dirname(path), 0o700)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)
    except OSError:
        pass


atexit.register(_discard_spares)

_AFTER_EXIT = 0.2  # seconds to wait for the end of the output once the launcher has exited (unsafe: a detached child)
_AFTER_KILL = 2.0  # ... for the sandbox to end once stopped at the timeout


def _write_ignoring(fd, data):
    try:
        os.write(fd, data)
    except OSError:  # the launcher is already gone
        pass


def _exchange(proc, data, status_fd, deadline, cap, stop):
    """Write `data` to the launcher's stdin while reading its stdout, stderr and status pipe, until they end and it
    has exited, or the deadline, where stop() is called, and if that has not ended it _AFTER_KILL seconds later,
    its process group is killed. Returns (stdout, stderr, status, timed_out, truncated)."""
    import selectors
    sel = selectors.DefaultSelector()
    stdin, stdout, stderr = proc.stdin.fileno(), proc.stdout.fileno(), proc.stderr.fileno()
    os.set_blocking(stdin, False)
    sel.register(stdin, selectors.EVENT_WRITE)
    kept = {stdout: bytearray(), stderr: bytearray(), status_fd: bytearray()}
    for fd in kept:
        sel.register(fd, selectors.EVENT_READ)
    try:
        pidfd = os.pidfd_open(proc.pid)  # readable once the launcher has exited, before anyone reaps it
        sel.register(pidfd, selectors.EVENT_READ)
    except (AttributeError, OSError):
        pidfd = None
    reading, view = set(kept), memoryview(data)
    timed_out, truncated, exited = False, False, pidfd is None
    try:
        while reading or not exited:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if exited or timed_out:
                    break  # whatever still holds the pipes open is not the program's to wait for
                timed_out = True
                stop()
                deadline = time.monotonic() + _AFTER_KILL
                continue
            for key, _ in sel.select(remaining):
                fd = key.fd
                if fd == pidfd:
                    exited = True
                    sel.unregister(fd)
                    deadline = min(deadline, time.monotonic() + _AFTER_EXIT)
                elif fd == stdin:
                    try:
                        view = view[os.write(fd, view[:64 * KiB]):]
                    except BlockingIOError:
                        continue
                    except OSError:  # it closed its stdin, or ended: the rest is not wanted
                        view = view[:0]
                    if not view:
                        sel.unregister(fd)
                        proc.stdin.close()
                else:
                    chunk = os.read(fd, 64 * KiB)
                    if not chunk:
                        sel.unregister(fd)
                        reading.discard(fd)
                        continue
                    room = max(cap - len(kept[fd]), 0) if fd != status_fd else len(chunk)
                    kept[fd] += chunk[:room]
                    truncated |= room < len(chunk)
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)
        # the launcher is not reaped yet, so its process group id cannot be anyone else's: kill what is left of it
        _kill_group(proc)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            try:
                f.close()
            except OSError:
                pass
        proc.wait()
    return bytes(kept[stdout]), bytes(kept[stderr]), bytes(kept[status_fd]), timed_out, truncated


def _kill_group(proc):
    try:
        os.killpg(proc.pid, 9)  # SIGKILL
    except (ProcessLookupError, PermissionError):
        pass


# ----------------------------------------------------------------------------- the launcher (the sandbox's side)
#
# Imported as a module, from its cached bytecode (running this file as a script would compile it every time, 7 ms);
# appended to sys.path, so that nothing beside it can stand in for a standard module.
_LAUNCH = "import sys; sys.path.append({!r}); import executor; executor._launch({}, {})"

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


def _launch(status_fd, control_fd):
    for fd in (status_fd, control_fd):
        os.set_inheritable(fd, False)  # pass_fds made them inheritable; the program must not get them
    try:
        # every import now: once root has become uid 65534, the standard library may be out of reach (a pyenv in /root)
        import ctypes
        import marshal
        import resource  # noqa: F401 - for _set_limits
        import select
        spec = marshal.loads(_read_exactly(0, int.from_bytes(_read_exactly(0, 8), "little")))
        libc = ctypes.CDLL(None, use_errno=True)
        if spec["mode"] == "strict":
            alive = _strict(spec, libc, status_fd, control_fd)  # only the program's side returns
        else:
            _unsafe(spec)
        _set_limits(spec["limits"], spec["mode"] == "strict")
        _prctl(libc, PR_SET_NO_NEW_PRIVS, 1, "no_new_privs")  # no setuid binary can give privileges back
        if spec["mode"] == "strict":
            # the launcher's death (run() kills it at the timeout) kills this init, and with it the whole namespace
            _prctl(libc, PR_SET_PDEATHSIG, 9, "pdeathsig")
            if select.select([alive], [], [], 0)[0]:  # the launcher died before the line above: end now
                os._exit(1)
            os.close(alive)
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
    sources = _open_sources(spec["read_only"] + [f"/dev/{name}" for name in DEVICES])
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


def _open_sources(paths):
    """{path: ("link", target) or (O_PATH descriptor, mount flags to keep)} of what the sandbox shows of the host."""
    sources = {}
    for path in paths:
        if os.path.islink(path):  # /bin -> usr/bin
            sources[path] = ("link", os.readlink(path))
        else:
            sources[path] = (os.open(path, os.O_PATH | os.O_CLOEXEC), _kept_flags(path))
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
    for path, (fd, flags) in sources.items():
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
    os.makedirs(top + "/tmp")
    _mount(libc, "tmp", top + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['disk']},mode=0700",
           "tmpfs /tmp")
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


def _unsafe(spec):
    """The folder made by run() gets the program's files and is its working folder; nothing else changes."""
    os.chdir(spec["workdir"])
    for name, data in spec["files"].items():
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


def _set_limits(limits, strict):
    import resource
    pairs = [(resource.RLIMIT_AS, limits["memory"]), (resource.RLIMIT_CPU, limits["cpu"]),
             (resource.RLIMIT_FSIZE, limits["file_size"]), (resource.RLIMIT_NOFILE, limits["open_files"]),
             (resource.RLIMIT_CORE, 0)]
    if strict:  # counted per user namespace, so per sandbox; outside one it would count all the user's processes
        pairs.append((resource.RLIMIT_NPROC, limits["processes"]))
    for name, value in pairs:
        resource.setrlimit(name, (value, value))

