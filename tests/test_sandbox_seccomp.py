"""The system-call filter (sandbox/seccomp.py): its BPF program run, for both architectures, by a small interpreter
written here against the kernel's own syscall tables (the installed headers), and the calls tried from inside the
sandbox, with the filter and, as the reference that shows the filter is what stops them, without it.
"""

import errno
import os
import re
import struct
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sandbox import executor  # noqa: E402
from sandbox import seccomp  # noqa: E402

HEADERS = {"x86_64": "/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "aarch64": "/usr/include/asm-generic/unistd.h"}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7, "i386": 0x40000003}
MUST_DENY = ["unshare", "setns", "mount", "umount2", "pivot_root", "ptrace", "bpf", "keyctl", "add_key",
             "request_key", "perf_event_open", "userfaultfd", "init_module", "finit_module", "delete_module",
             "kexec_load", "kexec_file_load", "reboot"]
ALLOW, EPERM, ENOSYS = "allow", "EPERM", "ENOSYS"


def _table(arch):
    path = HEADERS[arch]
    if not os.path.exists(path):
        pytest.skip(f"no kernel header {path} to read {arch}'s system call numbers from")
    with open(path) as f:
        return {m[1]: int(m[2]) for m in re.finditer(r"#define __NR_(\w+)\s+(\d+)\b", f.read())}


def _run_bpf(program, arch, nr, args=()):
    """Classic BPF, as the kernel runs a seccomp filter over struct seccomp_data (the few opcodes a filter uses)."""
    args = list(args) + [0] * (6 - len(args))
    data = struct.pack("<iIQ6Q", nr, AUDIT_ARCH[arch], 0, *args)
    code = [struct.unpack_from("<HBBI", program, i) for i in range(0, len(program), 8)]
    a, pc = 0, 0
    while True:
        op, jt, jf, k = code[pc]
        pc += 1
        if op == 0x20:    # ld [k]
            a = struct.unpack_from("<I", data, k)[0]
        elif op == 0x54:  # and #k
            a &= k
        elif op in (0x15, 0x35, 0x45):  # jeq, jge, jset
            taken = a == k if op == 0x15 else a >= k if op == 0x35 else bool(a & k)
            pc += jt if taken else jf
        elif op == 0x06:  # ret #k
            if k == 0x7FFF0000:
                return ALLOW
            assert k & 0xFFFF0000 == 0x00050000, hex(k)
            return errno.errorcode[k & 0xFFFF]
        else:
            raise AssertionError(f"opcode {op:#x}")


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_filter_decisions_against_the_kernels_tables(arch):
    table = _table(arch)
    program = seccomp.build(arch)
    for name in MUST_DENY:
        if name in table:  # a table without a call (kexec_file_load on older headers) cannot be asked about it
            assert _run_bpf(program, arch, table[name]) == EPERM, name
    for name in ("read", "write", "openat", "mmap", "exit_group", "wait4", "execve", "futex", "getrandom",
                 "socketpair", "connect", "prctl", "rt_sigaction"):
        if name in table:
            assert _run_bpf(program, arch, table[name]) == ALLOW, name
    clone, socket = table["clone"], table["socket"]
    thread_flags = 0x3D0F00  # glibc's pthread_create: CLONE_VM|FS|FILES|SIGHAND|THREAD|SYSVSEM|SETTLS|PARENT_SETTID...
    assert _run_bpf(program, arch, clone, [thread_flags]) == ALLOW
    assert _run_bpf(program, arch, clone, [0x01200011]) == ALLOW  # fork: CLONE_CHILD_SETTID|CHILD_CLEARTID|SIGCHLD
    for flag in (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000):
        assert _run_bpf(program, arch, clone, [flag | 17]) == EPERM, hex(flag)  # each namespace, with SIGCHLD
    assert _run_bpf(program, arch, table.get("clone3", 435)) == ENOSYS
    assert _run_bpf(program, arch, socket, [2, 1]) == ALLOW                # AF_INET, SOCK_STREAM
    assert _run_bpf(program, arch, socket, [1, 1 | 0o2000000]) == ALLOW    # AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC
    assert _run_bpf(program, arch, socket, [16, 3]) == EPERM               # AF_NETLINK
    assert _run_bpf(program, arch, socket, [16, 2 | 0o4000]) == EPERM      # AF_NETLINK, SOCK_DGRAM | SOCK_NONBLOCK
    assert _run_bpf(program, arch, socket, [17, 2]) == EPERM               # AF_PACKET
    assert _run_bpf(program, arch, socket, [2, 3 | 0o2000000]) == EPERM    # AF_INET, SOCK_RAW | SOCK_CLOEXEC
    assert _run_bpf(program, "i386", table["read"]) == EPERM  # another ABI's numbers: all denied
    if arch == "x86_64":
        assert _run_bpf(program, arch, 0x40000000 | table["read"]) == EPERM  # x32


DOORS = """
import ctypes, errno, os, socket
libc = ctypes.CDLL(None, use_errno=True)
machine = os.uname().machine
CLONE, CLONE3 = {"x86_64": (56, 435), "aarch64": (220, 435)}[machine]

def call(name, f):
    ctypes.set_errno(0)
    result = f()
    if result == 0:  # a child of a clone that went through, or a call that did: it must not go on
        print(name, "ok", flush=True)
    else:
        print(name, errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno()), flush=True)
    return result

def make_socket(family, kind):
    try:
        socket.socket(family, kind).close()
        return 0
    except OSError as e:
        ctypes.set_errno(e.errno)
        return -1

pid = libc.syscall(CLONE, 0x10000000 | 17, 0, 0, 0, 0)  # clone(CLONE_NEWUSER | SIGCHLD)
if pid == 0:
    os._exit(0)
print("clone_user", "ok" if pid > 0 else errno.errorcode[ctypes.get_errno()], flush=True)
if pid > 0:
    os.waitpid(pid, 0)
call("unshare_user", lambda: libc.unshare(0x10000000))
call("unshare_mount", lambda: libc.unshare(0x20000))
call("mount", lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None))
call("ptrace", lambda: libc.ptrace(0, 0, None, None))
call("netlink", lambda: make_socket(16, socket.SOCK_RAW))
call("raw", lambda: make_socket(socket.AF_INET, socket.SOCK_RAW))
call("clone3", lambda: libc.syscall(CLONE3, None, 0))
"""


def _doors(monkeypatch=None, program=None):
    if monkeypatch:
        monkeypatch.setattr(executor, "_filter", [program])
    r = executor.run(DOORS, timeout=20)
    assert r.exit_code == 0, r
    return dict(line.split() for line in r.stdout.splitlines())


def test_the_kernels_doors_are_closed_from_inside(strict, monkeypatch):
    """Inside the sandbox each call fails with EPERM (clone3 with ENOSYS); with a filter that allows everything, the
    namespaces, the netlink socket and the namespace clone go through: the filter is what closes them."""
    seen = _doors()
    assert seen == {"unshare_user": "EPERM", "unshare_mount": "EPERM", "mount": "EPERM", "ptrace": "EPERM",
                    "netlink": "EPERM", "raw": "EPERM", "clone_user": "EPERM", "clone3": "ENOSYS"}, seen
    allow_all = struct.pack("<HBBI", 0x06, 0, 0, 0x7FFF0000)
    open_doors = _doors(monkeypatch, allow_all)
    assert open_doors["unshare_user"] == open_doors["netlink"] == open_doors["clone_user"] == "ok", open_doors


ORDINARY = r"""
import concurrent.futures, hashlib, json, os, socket, subprocess, sys, threading, zlib
with concurrent.futures.ThreadPoolExecutor(4) as pool:
    squares = list(pool.map(lambda x: x * x, range(8)))
out = subprocess.run([sys.executable, "-I", "-S", "-c", "print(6 * 7)"], capture_output=True, text=True).stdout
pid = os.fork()
if pid == 0:
    os._exit(3)
_, status = os.waitpid(pid, 0)
spawned = os.posix_spawn(sys.executable, [sys.executable, "-I", "-S", "-c", "pass"], {})
_, spawn_status = os.waitpid(spawned, 0)
a, b = socket.socketpair()
a.sendall(b"ping")
tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
tcp.close()
print(json.dumps([squares, out.strip(), os.waitstatus_to_exitcode(status), spawn_status, b.recv(4).decode(),
                  hashlib.sha256(b"x").hexdigest()[:8], len(zlib.compress(b"a" * 1000)) < 100]))
"""


def test_ordinary_programs_still_run(strict):
    """Threads, a subprocess of Python, fork, posix_spawn (glibc tries clone3 first), sockets that are not raw."""
    import hashlib
    import json
    r = executor.run(ORDINARY, timeout=20)
    assert r.exit_code == 0, r
    assert json.loads(r.stdout) == [[x * x for x in range(8)], "42", 3, 0, "ping",
                                    hashlib.sha256(b"x").hexdigest()[:8], True]
    assert executor.python("import threading; t = threading.Thread(target=print, args=('hi',)); t.start(); "
                           "t.join()") == "hi\n"
