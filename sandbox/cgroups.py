"""One control group per sandboxed program: a budget for all its processes together, memory (resident and swap),
CPU time and the number of processes, where the kernel's control groups can be made here.

    groups = cgroups.find()     # Groups, or a str saying why no group can be made here
    group = groups.make(memory=1 << 30, processes=33)
    group.add(pid)                       # or the process writes its pid to group.procs_files(): all it forks counts
    group.exceeded(cpu_seconds)          # "memory" (the kernel killed one of its processes), "cpu", or None
    group.oom_alarm()                    # v1: an eventfd readable when the kernel is about to kill at the budget
    group.remove()                       # kills what is left, removes the group

Where: the trainer's own group of each hierarchy (cgroup v1's memory, pids and cpuacct controllers, each mounted on
its own or together; else a cgroup v2 tree whose controllers include memory and pids: the root, as root in a
container, or a subtree delegated to the user). A program's group is a child of the trainer's, so a limit the
trainer runs under (a container's) still holds for the trainer and its programs together; the groups are named
grpo-sandbox-<trainer pid>-<n>, and those of a trainer that died are removed by the next one.
"""

import itertools
import os
import signal
import time

PREFIX = "grpo-sandbox-"


def _read(path):
    with open(path) as f:
        return f.read()


def _write(path, text):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _field(text, key):
    """The number after `key` in a flat-keyed file (memory.events, memory.oom_control, cpu.stat, pids.events)."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return int(parts[1])
    return 0


def _unescape(path):
    return path.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _mounts(mountinfo="/proc/self/mountinfo"):
    """({v1 controller: (mount point, mount root)}, (mount point, mount root) of cgroup2 or None)."""
    v1, v2 = {}, None
    for line in _read(mountinfo).splitlines():
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        where = (_unescape(fields[4]), _unescape(fields[3]))
        if rest[0] == "cgroup2" and v2 is None:
            v2 = where
        elif rest[0] == "cgroup":
            for option in rest[2].split(","):
                v1.setdefault(option, where)
    return v1, v2


def _own(procfile="/proc/self/cgroup"):
    """{v1 controller: path, "": v2 path} of this process's groups."""
    own = {}
    for line in _read(procfile).splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            own[name] = path
    return own


def _folder(mount, path):
    point, root = mount
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root):]  # a mount of a subtree (a container's view): its path is relative to that subtree
    return os.path.join(point, path.lstrip("/")).rstrip("/") or "/"


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class Groups:
    """Where this trainer makes its programs' groups: `version` 1 or 2, `bases` {controller: folder}."""

    def __init__(self, version, bases):
        self.version, self.bases = version, bases
        self.count = itertools.count(1)  # next() on it is atomic: programs start from many threads at once
        self.leftover = []  # groups that could not be removed yet (a process still dying): tried again later

    @property
    def counts_processes(self):
        return self.version == 2 or "pids" in self.bases

    def describe(self):
        names = sorted(self.bases) if self.version == 1 else ["memory", "pids", "cpu.stat"]
        return f"cgroup v{self.version} ({', '.join(names)})"

    def make(self, memory, processes):
        """A new group with these budgets: `memory` bytes resident and swap for all its processes together,
        `processes` at once. OSError when the kernel refuses."""
        name = f"{PREFIX}{os.getpid()}-{next(self.count)}"
        group = Group(self.version, {c: os.path.join(base, name) for c, base in self.bases.items()})
        try:
            for folder in dict.fromkeys(group.dirs.values()):
                os.mkdir(folder)
            if self.version == 2:
                folder = group.dirs[""]
                if os.path.exists(f"{folder}/memory.swap.max"):
                    _write(f"{folder}/memory.swap.max", "0")  # memory.max is then resident and swap together
                _write(f"{folder}/memory.oom.group", "1")     # an OOM kill takes every process of the group
            group.set_limits(memory, processes)
        except BaseException:
            group.remove()
            raise
        self.retry_leftovers()
        return group

    def retry_leftovers(self):
        self.leftover = [g for g in self.leftover if not g.remove(wait=False)]

    def clean_stale(self):
        """Remove the empty groups of trainers that are gone (killed before they could remove their own; their
        launchers killed their programs when the trainer's end closed their control pipes). A group with processes
        is left alone: its trainer may live in another pid namespace, where its pid means nothing here."""
        for base in set(self.bases.values()):
            try:
                names = os.listdir(base)
            except OSError:
                continue
            for name in names:
                owner = name[len(PREFIX):].split("-")[0]
                if name.startswith(PREFIX) and owner.isdigit() and not _alive(int(owner)):
                    try:
                        os.rmdir(os.path.join(base, name))
                    except OSError:
                        pass


class Group:
    """One program's group, in each hierarchy that counts something (`dirs` {controller: folder})."""

    def __init__(self, version, dirs):
        self.version, self.dirs = version, dirs
        self.memory = self.processes = None

    def set_limits(self, memory, processes):
        """The budgets: `memory` bytes resident and swap for all its processes together, `processes` at once."""
        if memory != self.memory:
            if self.version == 1:
                folder = self.dirs["memory"]
                files = ["memory.limit_in_bytes"]
                if os.path.exists(f"{folder}/memory.memsw.limit_in_bytes"):  # swap counted too
                    # the kernel keeps limit <= memsw.limit at every step: raise memsw first, lower it last
                    files.insert(0 if self.memory is not None and memory > self.memory else 1,
                                 "memory.memsw.limit_in_bytes")
                for name in files:
                    _write(f"{folder}/{name}", str(memory))
            else:
                _write(f"{self.dirs['']}/memory.max", str(memory))
            self.memory = memory
        if processes != self.processes and (self.version == 2 or "pids" in self.dirs):
            _write(f"{self.dirs.get('pids') or self.dirs['']}/pids.max", str(processes))
            self.processes = processes

    def procs_files(self):
        """The files a process writes its pid to, to join the group (and so will all it starts)."""
        return [f"{folder}/cgroup.procs" for folder in dict.fromkeys(self.dirs.values())]

    def add(self, pid):
        for path in self.procs_files():
            _write(path, str(pid))

    def cpu_seconds(self):
        try:
            if self.version == 1:
                return int(_read(f"{self.dirs['cpuacct']}/cpuacct.usage")) / 1e9 if "cpuacct" in self.dirs else 0.0
            return _field(_read(f"{self.dirs['']}/cpu.stat"), "usage_usec") / 1e6
        except OSError:
            return 0.0

    def oom_kills(self):
        try:
            if self.version == 1:
                return _field(_read(f"{self.dirs['memory']}/memory.oom_control"), "oom_kill")
            return _field(_read(f"{self.dirs['']}/memory.events"), "oom_kill")
        except OSError:
            return 0

    def oom_alarm(self):
        """A descriptor (to close after use) that becomes readable as soon as the kernel finds the group at its
        memory budget with nothing left to reclaim, about to kill one of its processes (cgroup v1's OOM notice,
        asked for through cgroup.event_control), so that the caller can kill the rest at once; None where there is
        none (v2, where memory.oom.group has the kernel kill every process of the group together)."""
        if self.version != 1 or not hasattr(os, "eventfd"):
            return None
        folder, alarm = self.dirs["memory"], None
        try:
            alarm = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            control = os.open(f"{folder}/memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
            try:  # the kernel keeps the notice until the eventfd is closed
                _write(f"{folder}/cgroup.event_control", f"{alarm} {control}")
            finally:
                os.close(control)
        except OSError:  # then the trainer's look every WATCH_EVERY seconds finds the kill, a little later
            if alarm is not None:
                os.close(alarm)
            return None
        return alarm

    def memory_limit_hit(self):
        """Whether a charge ever found the group at its memory budget (v1 memory.failcnt or memsw.failcnt, v2
        memory.events max): the kernel then reclaimed, and when it could not, killed (oom_kills)."""
        try:
            if self.version == 1:
                folder = self.dirs["memory"]
                return any(int(_read(f"{folder}/{name}")) > 0 for name in ("memory.failcnt", "memory.memsw.failcnt")
                           if name == "memory.failcnt" or os.path.exists(f"{folder}/{name}"))
            return _field(_read(f"{self.dirs['']}/memory.events"), "max") > 0
        except (OSError, ValueError):
            return False

    def processes_refused(self):
        """Whether a fork or a thread was refused at the process budget."""
        folder = self.dirs.get("pids") or self.dirs.get("")
        try:
            return folder is not None and _field(_read(f"{folder}/pids.events"), "max") > 0
        except OSError:
            return False

    def exceeded(self, cpu_budget):
        """"memory" once the kernel has killed one of its processes at the memory budget, "cpu" once all of them
        together have used `cpu_budget` seconds of CPU, else None. The caller then kills the program as a whole."""
        if self.oom_kills():
            return "memory"
        if self.cpu_seconds() >= cpu_budget:
            return "cpu"
        return None

    def pids(self):
        found = set()
        for path in self.procs_files():
            try:
                found.update(int(p) for p in _read(path).split())
            except OSError:
                pass
        return found

    def kill(self):
        """SIGKILL every process of the group: at once through cgroup.kill (v2), else one by one until none is left
        (a fork in between is caught by the next round; the process budget bounds how many there can be)."""
        folder = self.dirs.get("")
        if folder and os.path.exists(f"{folder}/cgroup.kill"):
            try:
                _write(f"{folder}/cgroup.kill", "1")
                return
            except OSError:
                pass
        for _ in range(100):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def remove(self, wait=True):
        """Kill what is left and remove the group; True when it is gone. With `wait`, up to a second for killed
        processes to be reaped."""
        deadline = time.monotonic() + (1.0 if wait else 0.0)
        while True:
            left = []
            for folder in dict.fromkeys(self.dirs.values()):
                try:
                    os.rmdir(folder)
                except FileNotFoundError:
                    pass
                except OSError:
                    left.append(folder)
            if not left:
                return True
            self.kill()
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)


def find():
    """Groups where this process can make its programs' groups, or a str saying why it cannot."""
    try:
        v1, v2 = _mounts()
        own = _own()
    except (OSError, ValueError) as e:
        return f"cannot read this process's control groups ({e})"
    if "memory" in v1 and "memory" in own:
        bases = {c: _folder(v1[c], own[c]) for c in ("memory", "pids", "cpuacct") if c in v1 and c in own}
        groups = Groups(1, bases)
    elif v2 is not None and "" in own:
        base = _folder(v2, own[""])
        why = _enable_v2(base)
        if why:
            return why
        groups = Groups(2, {"": base})
    else:
        return "no memory controller is mounted (cgroup v1) and no cgroup v2 tree is mounted"
    groups.clean_stale()
    try:  # try one, as the programs' will be
        groups.make(64 << 20, 8).remove()
    except OSError as e:
        return f"cannot make a control group under {sorted(set(groups.bases.values()))[0]} ({e.strerror})"
    return groups


def _enable_v2(base):
    """Enable the memory and pids controllers for the children of `base`; None, or why not. A group with processes
    of its own cannot give controllers to children (the root excepted): when this process is alone in its group,
    it moves into a leaf of it first."""
    try:
        available = _read(f"{base}/cgroup.controllers").split()
    except OSError as e:
        return f"cannot read {base}/cgroup.controllers ({e.strerror})"
    missing = [c for c in ("memory", "pids") if c not in available]
    if missing:
        return f"the cgroup v2 group {base} has no {' or '.join(missing)} controller to give its children"
    if all(c in _read(f"{base}/cgroup.subtree_control").split() for c in ("memory", "pids")):
        return None
    try:
        _write(f"{base}/cgroup.subtree_control", "+memory +pids")
        return None
    except OSError as e:
        first = e
    procs = _read(f"{base}/cgroup.procs").split()
    if procs != [str(os.getpid())]:
        return (f"cannot enable memory and pids for the children of {base} ({first.strerror}); other processes share "
                f"its group")
    leaf = f"{base}/{PREFIX}{os.getpid()}-trainer"
    try:
        os.makedirs(leaf, exist_ok=True)
        _write(f"{leaf}/cgroup.procs", str(os.getpid()))
        _write(f"{base}/cgroup.subtree_control", "+memory +pids")
    except OSError as e:
        return f"cannot enable memory and pids for the children of {base} ({e.strerror})"
    return None


_own_memory = []  # [(version, folder) or None], found once


def _own_memory_group():
    if not _own_memory:
        try:
            v1, v2 = _mounts()
            own = _own()
            if "memory" in v1 and "memory" in own:
                _own_memory.append((1, _folder(v1["memory"], own["memory"])))
            elif v2 is not None and "" in own:
                _own_memory.append((2, _folder(v2, own[""])))
        except (OSError, ValueError):
            pass
        _own_memory.append(None)
    return _own_memory[0]


def available_memory():
    """Bytes of memory the machine can still give (MemAvailable), or less where this process's own group has a
    tighter limit (a container's)."""
    try:
        meminfo = _read("/proc/meminfo")
        available = _field(meminfo.replace(":", "").replace(" kB", ""), "MemAvailable") * 1024
    except OSError:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    found = _own_memory_group()
    try:
        if found is None:
            return available
        version, folder = found
        if version == 1:
            limit, used = (int(_read(f"{folder}/memory.{k}")) for k in ("limit_in_bytes", "usage_in_bytes"))
        else:
            limit, used = _read(f"{folder}/memory.max").strip(), int(_read(f"{folder}/memory.current"))
            limit = int(limit) if limit != "max" else 1 << 62
        return max(min(available, limit - used), 0)
    except (OSError, ValueError):
        return available
