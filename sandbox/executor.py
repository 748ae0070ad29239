"""Run Python that the policy wrote: each program in a fresh process, sandboxed, with limits.

One concern in one file (at the 650-line mark): the trainer's side of the sandbox, running programs,
their limits, the pool and their results; the sandbox's own side is sandbox/launcher.py, the kernel's
control groups and system-call filter sandbox/cgroups.py and sandbox/seccomp.py.

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
          working folder (no home, no out_dir, no /etc/shadow, no /proc); ipc and uts namespaces; a system-call
          filter (sandbox/seccomp.py: no new namespaces, mount, ptrace, bpf, keys, perf, userfaultfd, io_uring,
          modules, reboot, raw or netlink sockets; EPERM). And all of unsafe.
  auto    strict. Where the kernel refuses a namespace, every run refuses with one line naming what is missing; it
          never falls back to unsafe by itself.
  unsafe  what needs no namespace: resource limits (a process limit only from a control group: outside a user
          namespace RLIMIT_NPROC counts every process of the user), the control group and the system-call filter,
          a new session killed as one group, an empty temporary folder and an empty environment. Not a sandbox: the program runs as the trainer's user (UNSAFE_BANNER says what it lacks).

Every program gets a wall-clock timeout, and limits on CPU time, address space (RLIMIT_AS), file size, processes and
open files; its stdout and stderr are cut at `max_output` bytes each. Where a control group can be made
(sandbox/cgroups.py), each program has one: memory (resident and swap), CPU time and processes are budgets for all
its processes together, and passing the memory or CPU budget kills it whole (Result.exceeded names which); where
none can be made, the first strict check says so once on stderr and the limits stay per process. Either way every
process of a program has oom_score_adj 1000 (the OOM killer's first choice; the trainer's score is not touched),
and a program is only started while the memory budget of all running programs (MEMORY_SHARE of what the machine
has available) holds it, which also sizes run_many's pool. It runs as `python -I -S`: isolated mode, no
`site`, so only the standard library, and a faster start than a plain `python file.py` (docs/sandbox.md, for
the measured overhead).

How: run() starts `python -I -S` running sandbox.launcher.launch(STATUS, CONTROL) (the launcher), puts it in the
program's control group, sends it a spec on stdin (then the program's stdin), and reads the program's stdout and
stderr. The launcher builds the sandbox, forks
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

# The launcher (a fresh interpreter per program) imports sandbox/launcher.py, not this module; here the trainer's side
# imports subprocess, selectors, threading and the thread pool inside the functions that use them, so that a trainer
# that never runs a program pays nothing for them.

KiB, MiB = 1 << 10, 1 << 20
SANDBOX_MODES = ("auto", "strict", "unsafe")
SANDBOX_UID = 65534          # the program's uid: `nobody` on most systems
DEFAULT_TIMEOUT = 10.0       # seconds of wall clock
DEFAULT_MEMORY = 512 * MiB   # address space per process (RLIMIT_AS)
DEFAULT_TOTAL_MEMORY = 1 << 30  # resident and swap of all the program's processes together (its control group)
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
    exceeded: the budget of its control group it passed: "memory" or "cpu" (it was then killed as a whole, and
    exit_code is -9 even where its first process ended by itself once the kernel had killed another at the memory
    budget), "processes" (a fork or a thread was refused), else None.
    """
    __slots__ = ("stdout", "stderr", "exit_code", "timed_out", "wall_time", "sandbox_error", "truncated", "exceeded")

    def __init__(self, stdout="", stderr="", exit_code=None, timed_out=False, wall_time=0.0, sandbox_error=None,
                 truncated=False, exceeded=None):
        self.stdout, self.stderr, self.exit_code, self.timed_out = stdout, stderr, exit_code, timed_out
        self.wall_time, self.sandbox_error, self.truncated, self.exceeded = wall_time, sandbox_error, truncated, \
            exceeded

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


_groups_lock = _thread.allocate_lock()
_groups_found = None  # None: not looked yet; a cgroups.Groups; or a str: why no group can be made here


def _groups():
    """The control groups programs run in, or None where none can be made (said once, on stderr, when first
    looked for, by the first strict check or program: programs then keep per-process limits only)."""
    global _groups_found
    with _groups_lock:
        if _groups_found is None:
            from sandbox import cgroups
            _groups_found = cgroups.find()
            if isinstance(_groups_found, str) and os.environ.get("RANK", "0") == "0":
                print(NO_GROUPS_BANNER.format(_groups_found), file=sys.stderr, flush=True)
    return None if isinstance(_groups_found, str) else _groups_found


NO_GROUPS_BANNER = ("sandbox: no control group for programs here: {}; each program's memory, CPU time and processes "
                    "are then bounded per process (RLIMIT_AS, RLIMIT_CPU, RLIMIT_NPROC), not for all its processes "
                    "together; the OOM killer takes programs' processes first (oom_score_adj 1000)")


def _probe():
    """'' when a program runs in the strict sandbox here, else what went wrong, as a clause."""
    _groups()
    result = _execute(_options(code="import sys; sys.stdout.write('ok')", timeout=20.0), "strict")
    if result.sandbox_error:
        return result.sandbox_error
    if result.stdout != "ok":
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return f"the sandboxed Python did not run (exit {result.exit_code}): {last[:200]}"
    return ""


def _options(code, stdin="", files=None, timeout=DEFAULT_TIMEOUT, memory=DEFAULT_MEMORY, cpu=None,
             file_size=DEFAULT_FILE_SIZE, processes=DEFAULT_PROCESSES, disk=DEFAULT_DISK,
             max_output=DEFAULT_MAX_OUTPUT, total_memory=DEFAULT_TOTAL_MEMORY):
    files = dict(files or {})
    for name in files:
        if not name or "/" in name or name in (".", "..") or name == PROGRAM_FILE:
            raise ValueError(f"files: {name!r} must be a plain file name other than {PROGRAM_FILE}")
    files[PROGRAM_FILE] = code
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    if not total_memory >= 16 * MiB:
        raise ValueError(f"total_memory must be at least 16 MiB (a Python interpreter's start), got {total_memory}")
    return dict(files={k: v.encode() if isinstance(v, str) else bytes(v) for k, v in files.items()},
                stdin=stdin.encode() if isinstance(stdin, str) else bytes(stdin), timeout=float(timeout),
                limits=dict(memory=int(memory), cpu=int(cpu) if cpu else int(timeout) + 1, file_size=int(file_size),
                            processes=int(processes), open_files=OPEN_FILES),
                disk=int(disk), max_output=int(max_output), total_memory=int(total_memory))


def run(code, stdin="", *, files=None, timeout=DEFAULT_TIMEOUT, memory=DEFAULT_MEMORY, cpu=None,
        file_size=DEFAULT_FILE_SIZE, processes=DEFAULT_PROCESSES, disk=DEFAULT_DISK, max_output=DEFAULT_MAX_OUTPUT,
        total_memory=DEFAULT_TOTAL_MEMORY, sandbox=None):
    """Run one program (Python source) and return its Result.

    stdin: text or bytes on its standard input. files: {name: text or bytes} written beside it in its empty folder
    (it runs as main.py there). timeout: wall-clock seconds. memory: bytes of address space per process.
    total_memory: bytes resident and swapped of all its processes together (tmpfs files included). cpu: CPU seconds
    of all its processes together, and of each (default: the timeout rounded down, plus 1). processes: how many
    processes and threads it may have at once. total_memory, cpu and processes bound the program as a whole where
    a control group can be made (`exceeded` in the Result says which it passed), else each process alone.
    file_size: bytes of the largest file it may write. disk: bytes of its tmpfs (strict). max_output: bytes kept of
    stdout and of stderr each. sandbox: auto, strict or unsafe (module docstring).
    ExecutorUnavailable where strict is asked for and the machine cannot give it.
    """
    options = _options(code, stdin, files, timeout, memory, cpu, file_size, processes, disk, max_output, total_memory)
    mode = check(sandbox)
    with _admitted(_worst_case(options)):
        result = _execute(options, mode)
    _count("programs")
    _count("program_seconds", result.wall_time)
    _count("timeouts", int(result.timed_out))
    _count("sandbox_failures", int(result.sandbox_failed))
    return result


def run_many(programs, *, workers=None, **options):
    """Run many programs at once, `workers` at a time (default: one per CPU this process may use, as many as the
    memory budget of all running programs holds); their Results, in order. A program is its source, or a dict of run()'s arguments ({"code": ..., "stdin": ..., "timeout": ...});
    `options` are run()'s keyword arguments for all of them. Each program has its own timeout, counted from its own
    start: a slow one costs its own time, not the others'."""
    from concurrent.futures import ThreadPoolExecutor
    jobs = [dict(options, **(p if isinstance(p, dict) else {"code": p})) for p in programs]
    if not jobs:
        return []
    check(options.get("sandbox"))  # once, before the pool: an unavailable sandbox is one error, not one per program
    t0 = time.monotonic()
    if not workers:  # one per CPU, as many as the memory budget of all running programs holds
        worst = max(_worst_case(_options(**{k: v for k, v in job.items() if k != "sandbox"})) for job in jobs)
        workers = max(1, min(len(os.sched_getaffinity(0)), _memory_budget() // worst))
    with ThreadPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
        results = list(pool.map(lambda job: run(**job), jobs))
    _count("wait_seconds", time.monotonic() - t0)
    return results


MEMORY_SHARE = 0.5  # of the memory the machine can still give (at a moment no program runs): all programs' budget
_admission = None   # (threading.Condition, [bytes of the programs running, their budget])


def _worst_case(options):
    """The most memory one program can hold: its group's budget; without a group, one process's address space (a
    program of many processes can hold more: then its processes' OOM score is what keeps the trainer alive)."""
    return options["total_memory"] if _groups() else options["limits"]["memory"]


def _memory_budget():
    """Bytes all running programs may hold together: MEMORY_SHARE of the memory available when none ran."""
    condition, state = _admission_state()
    with condition:
        if state[0] == 0:
            from sandbox import cgroups
            state[1] = int(cgroups.available_memory() * MEMORY_SHARE)
        return state[1]


def _admission_state():
    global _admission
    if _admission is None:
        import threading
        with _lock:
            if _admission is None:
                _admission = (threading.Condition(), [0, 0])
    return _admission


class _admitted:
    """Wait until a program of `size` bytes fits the budget of all running programs (one alone always runs)."""

    def __init__(self, size):
        self.size = size

    def __enter__(self):
        condition, state = _admission_state()
        with condition:
            condition.wait_for(lambda: state[0] == 0 or state[0] + self.size <= state[1])
            if state[0] == 0:
                from sandbox import cgroups
                state[1] = int(cgroups.available_memory() * MEMORY_SHARE)
            state[0] += self.size

    def __exit__(self, *exc):
        condition, state = _admission_state()
        with condition:
            state[0] -= self.size
            condition.notify_all()


TOOL_TIMEOUT = 10.0
TOOL_MAX_CHARS = 4000


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it printed.

    The program runs in a fresh Python 3 interpreter with the standard library only, no network, an empty working
    folder and a 10-second time limit; nothing is kept between calls. Print what you want to see.

    Args:
        code: The whole program, as Python source.

    Returns:
        What the program wrote to standard output, then to standard error, with a note when it timed out, passed
        its memory or CPU limit, or exited with an error; the middle of a long output is cut. When it could not be run, the reason, starting with
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
    elif result.exceeded in ("memory", "cpu"):
        text += f"\n[killed: it passed its {'memory' if result.exceeded == 'memory' else 'CPU time'} limit]"
    elif result.exit_code:
        text += f"\n[exit code {result.exit_code}]"
    if len(text) > TOOL_MAX_CHARS:
        half = TOOL_MAX_CHARS // 2
        text = f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"
    return text


HOST_TMP = "/.host-tmp"  # where the strict sandbox shows what Python needs of the host's /tmp


def _read_only_paths():
    """Host paths the strict sandbox shows, read-only: the system's programs and libraries, the dynamic linker's
    cache, Python's installation (wherever it lies: a pyenv under /root, a venv, conda, uv, /opt, /home)."""
    paths = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache"]
    for prefix in {sys.base_prefix, sys.prefix, sys.exec_prefix, os.path.dirname(os.path.dirname(_python()))}:
        real = os.path.realpath(prefix)
        if real not in ("/", "/usr") and not real.startswith("/usr/"):
            paths.append(real)
    return [p for p in dict.fromkeys(paths) if os.path.lexists(p)]


def _inside(path):
    """Where the strict sandbox shows a host path: at the same place, except under /tmp, which inside is the
    program's own empty folder; an installation there (a venv made in a temporary folder) moves to HOST_TMP."""
    return HOST_TMP + path[4:] if path == "/tmp" or path.startswith("/tmp/") else path


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
    """([(host path, path inside), ...] shown read-only, mountpoint), found once."""
    global _paths
    if _paths is None:
        paths = _read_only_paths()
        _paths = [(p, _inside(p)) for p in paths], _mountpoint(paths)
    return _paths


_spares = []  # launchers started ahead of need, waiting for their spec
_spares_pid = os.getpid()
_launcher_groups = {}  # launcher's pid: its program's control group, which it joins as it starts


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


# The launcher is imported as a module, from its cached bytecode (running a file as a script would compile it every
# time, 7 ms); its folder is appended to sys.path, so that nothing beside it can stand in for a standard module.
_LAUNCH = "import sys; sys.path.append({!r}); from sandbox import launcher; launcher.launch({}, {}, {!r})"


def _start_launcher():
    """A launcher, and its program's control group (made now, with the default budgets; run() sets the program's
    own). The launcher joins the group as it starts: moving a process between groups waits for the kernel (an RCU
    grace period, about 10 ms on a busy 2-core VM), and a spare does so while the program before it runs."""
    import subprocess
    groups = _groups()
    group = groups.make(DEFAULT_TOTAL_MEMORY, DEFAULT_PROCESSES + 1) if groups else None
    status_r, status_w = os.pipe()    # the launcher's reports
    control_r, control_w = os.pipe()  # strict: a byte, or end-of-file, and the launcher kills the sandbox's init
    try:
        proc = subprocess.Popen([_python(), "-I", "-S", "-c", _LAUNCH.format(
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))), status_w, control_r, group.procs_files() if group else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_w, control_r),
            env={}, cwd="/", start_new_session=True)
    except OSError:
        os.close(status_r)
        os.close(control_w)
        if group:
            group.remove()
        raise
    finally:
        os.close(status_w)
        os.close(control_r)
    if group:
        with _lock:
            _launcher_groups[proc.pid] = group
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
        group = _launcher_groups.pop(proc.pid, None)
        if group:
            group.remove(wait=False)


def _execute(options, mode):
    """Take a launcher for one program, feed it, collect its output; a Result (no exception for the program's
    doings: those are in the Result)."""
    import marshal
    import shutil
    import tempfile
    (paths, mountpoint), python = _sandbox_paths(), _python()
    python = _inside(python) if mode == "strict" else python
    workdir = tempfile.mkdtemp(prefix="grpo-exec-") if mode == "unsafe" else None
    spec = dict(mode=mode, python=python, argv=[python, "-I", "-S", PROGRAM_FILE], files=options["files"],
                limits=options["limits"], timeout=options["timeout"], uid=SANDBOX_UID, read_only=paths,
                mountpoint=mountpoint, disk=options["disk"], workdir=workdir, seccomp=_seccomp_filter())
    groups, group, exceeded, kernel, alarm = _groups(), None, None, None, None
    spec["group_counts_processes"] = bool(groups and groups.counts_processes)
    header = marshal.dumps(spec)
    start = time.monotonic()
    try:
        try:
            proc, status_r, control_w = _take_launcher()
        except OSError as e:
            return Result(sandbox_error=f"cannot start the launcher: {e}", wall_time=time.monotonic() - start)
        try:
            with _lock:
                group = _launcher_groups.pop(proc.pid, None)
            if group:  # the launcher joined it before reading its spec: all it forks is counted
                try:
                    group.set_limits(options["total_memory"], options["limits"]["processes"] + 1)
                except OSError as e:
                    _kill_group(proc)
                    proc.wait()
                    group.remove()
                    return Result(sandbox_error=f"control group: {e}", wall_time=time.monotonic() - start)
            data = len(header).to_bytes(8, "little") + header + options["stdin"]
            # strict: at the timeout the launcher kills the init and reaps it, so that when it exits nothing of the
            # sandbox is left; unsafe: the launcher is the program, and its process group is killed
            stop = (lambda: _write_ignoring(control_w, b"k")) if mode == "strict" else (lambda: _kill_all(proc, group))
            watch = group and (lambda: group.exceeded(options["limits"]["cpu"]))
            alarm = group.oom_alarm() if group else None
            out, err, status, timed_out, truncated, exceeded = _exchange(
                proc, data, status_r, start + options["timeout"], options["max_output"], stop, watch, alarm)
        finally:
            os.close(status_r)
            os.close(control_w)
            if alarm is not None:
                os.close(alarm)
            if group:  # read once the launcher is reaped (the kernel counts a kill before it sends it): final
                kernel = (group.oom_kills() > 0, group.memory_limit_hit(), group.processes_refused())
                if not group.remove():  # kills what is left first (unsafe: what left the process group)
                    groups.leftover.append(group)
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
    if kernel:
        exceeded, exit_code = _verdict(exceeded, exit_code, timed_out, mode, *kernel)
    return Result(out.decode(errors="replace"), err.decode(errors="replace"), exit_code, timed_out, wall,
                  sandbox_error, truncated, exceeded)


def _verdict(watched, exit_code, timed_out, mode, oom_killed, memory_hit, refused):
    """(exceeded, exit_code) from what the trainer saw while the program ran (`watched`: the budget it named, and
    the program was then killed) and the group's own counts once nothing of it is left. The kernel kills one
    process at the memory budget; the program's other processes may see that death and end by themselves (exit 0)
    before the trainer's next look kills them. Whatever the order, a program the kernel killed at its budget is
    reported as killed whole: exceeded "memory", exit_code -9 (SIGKILL). In strict mode a SIGKILL of the program
    (the sandbox's init, which nothing inside can kill) not sent by the trainer is the kernel's, at the budget it
    hit."""
    exceeded = watched
    if exceeded is None and (oom_killed or (mode == "strict" and exit_code == -9 and memory_hit and not timed_out)):
        exceeded = "memory"
    if exceeded is None and refused:
        exceeded = "processes"
    if exceeded in ("memory", "cpu") and not timed_out:
        exit_code = -9
    return exceeded, exit_code


_filter = []


def _seccomp_filter():
    """The system-call filter's program for this machine (seccomp), built once; None where its system call
    numbers are not known (strict then refuses, naming the architecture)."""
    if not _filter:
        from sandbox import seccomp
        machine = os.uname().machine
        _filter.append(seccomp.build(machine) if machine in seccomp.AUDIT_ARCH else None)
    return _filter[0]


def _kill_all(proc, group):
    _kill_group(proc)
    if group:  # what left the process group (a new session) is still in the control group
        group.kill()


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


WATCH_EVERY = 0.05  # seconds between two looks at a program's group (its CPU time; a process killed at its memory)


def _exchange(proc, data, status_fd, deadline, cap, stop, watch=None, alarm=None):
    """Write `data` to the launcher's stdin while reading its stdout, stderr and status pipe, until they end and it
    has exited, or the deadline, where stop() is called, and if that has not ended it _AFTER_KILL seconds later,
    its process group is killed. Every WATCH_EVERY seconds, watch() (when given) names a budget the program has
    passed, or None; stop() is then called as at the deadline. `alarm`, a descriptor that becomes readable when
    the kernel is about to kill at the memory budget, names "memory" and calls stop() at once. Returns (stdout,
    stderr, status, timed_out, truncated, the budget named)."""
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
    if alarm is not None and watch:
        sel.register(alarm, selectors.EVENT_READ)
    reading, view = set(kept), memoryview(data)
    timed_out, truncated, exited, exceeded = False, False, pidfd is None, None
    next_watch = time.monotonic() + WATCH_EVERY
    try:
        while reading or not exited:
            now = time.monotonic()
            if watch and not exceeded and not timed_out and now >= next_watch:
                exceeded = watch()
                next_watch = now + WATCH_EVERY
                if exceeded:
                    stop()
                    deadline = min(deadline, now + _AFTER_KILL)
            remaining = deadline - now
            if remaining <= 0:
                if exited or timed_out or exceeded:
                    break  # whatever still holds the pipes open is not the program's to wait for
                timed_out = True
                stop()
                deadline = time.monotonic() + _AFTER_KILL
                continue
            wait = min(remaining, next_watch - now) if watch and not exceeded else remaining
            for key, _ in sel.select(max(wait, 0)):
                fd = key.fd
                if fd == alarm:  # the group is at its budget with nothing left to reclaim: kill it whole now
                    sel.unregister(fd)
                    if not exceeded and not timed_out:
                        exceeded = "memory"
                        stop()
                        deadline = min(deadline, time.monotonic() + _AFTER_KILL)
                elif fd == pidfd:
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
    return bytes(kept[stdout]), bytes(kept[stderr]), bytes(kept[status_fd]), timed_out, truncated, exceeded


def _kill_group(proc):
    try:
        os.killpg(proc.pid, 9)  # SIGKILL
    except (ProcessLookupError, PermissionError):
        pass
