"""The sandbox's system-call filter: a seccomp BPF program, assembled here and installed through the kernel's own
interface (prctl(PR_SET_NO_NEW_PRIVS) and seccomp(SECCOMP_SET_MODE_FILTER)) with ctypes.

The launcher installs it in the program's init as its last step, after building the namespaces and the root (which
need mount, unshare and pivot_root) and just before exec'ing Python; every process of the program inherits it and
none can remove it. A denied call fails with EPERM: the program sees an error, the trainer a normal result.

Denied, because a Python program has no use for them and each is kernel attack surface that a user namespace would
otherwise open (capabilities inside a new user namespace reach code paths an unprivileged user never does):
new namespaces (unshare, setns, clone with a namespace flag), the mount calls (the old mount and umount2, pivot_root,
chroot, and the new mount API), ptrace and process_vm_readv/writev, bpf, the key calls, perf_event_open, userfaultfd,
io_uring (whose operations would run without passing this filter), module loading, kexec, reboot, and sockets of the
netlink and packet families or of the raw type. bubblewrap and nsjail close the same doors.

    program = build(arch)       # bytes: the BPF program for "x86_64" or "aarch64"
    install(program)            # in the process to be filtered (and, through exec and fork, all it starts)
"""

import os

EPERM, ENOSYS = 1, 38
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]; (little-endian on both arches)
OFFSET_NR, OFFSET_ARCH = 0, 4


def _offset_arg_low(i):
    return 16 + 8 * i  # the low 32 bits of args[i]: every flag and number checked here lies there


# classic BPF opcodes (linux/filter.h)
LD_W_ABS = 0x20                                # A = the 32-bit word at offset k of seccomp_data
JEQ, JGE, JSET = 0x15, 0x35, 0x45              # if A == k / A >= k / A & k: jump jt, else jf
AND_K = 0x54                                   # A &= k
RET_K = 0x06
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | errno

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000  # x86_64: the x32 ABI's calls, the same calls under other numbers
SYS_SECCOMP = {"x86_64": 317, "aarch64": 277}
SECCOMP_SET_MODE_FILTER = 1
PR_SET_NO_NEW_PRIVS = 38

# Namespace flags of clone(2) (CLONE_NEWTIME, 0x80, exists only for unshare and clone3: in clone's flags it is CSIGNAL)
CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
AF_NETLINK, AF_PACKET, SOCK_RAW, SOCK_TYPE_MASK = 16, 17, 3, 0xF

# System call numbers: x86_64 from arch/x86/entry/syscalls/syscall_64.tbl, aarch64 from the generic table
# (include/uapi/asm-generic/unistd.h); numbers from 424 up are the same on every architecture.
SYSCALLS = {
    #                      x86_64 aarch64
    "unshare":             (272, 97),
    "setns":               (308, 268),
    "mount":               (165, 40),
    "umount2":             (166, 39),
    "pivot_root":          (155, 41),
    "chroot":              (161, 51),
    "ptrace":              (101, 117),
    "process_vm_readv":    (310, 270),
    "process_vm_writev":   (311, 271),
    "bpf":                 (321, 280),
    "keyctl":              (250, 219),
    "add_key":             (248, 217),
    "request_key":         (249, 218),
    "perf_event_open":     (298, 241),
    "userfaultfd":         (323, 282),
    "init_module":         (175, 105),
    "finit_module":        (313, 273),
    "delete_module":       (176, 106),
    "kexec_load":          (246, 104),
    "kexec_file_load":     (320, 294),
    "reboot":              (169, 142),
    "io_uring_setup":      (425, 425),
    "io_uring_enter":      (426, 426),
    "io_uring_register":   (427, 427),
    "open_tree":           (428, 428),
    "move_mount":          (429, 429),
    "fsopen":              (430, 430),
    "fsconfig":            (431, 431),
    "fsmount":             (432, 432),
    "fspick":              (433, 433),
    "mount_setattr":       (442, 442),
    "open_tree_attr":      (467, 467),
    # checked on their arguments, below
    "clone":               (56, 220),
    "clone3":              (435, 435),
    "socket":              (41, 198),
}
DENIED = [name for name in SYSCALLS if name not in ("clone", "clone3", "socket")]


def number(name, arch):
    return SYSCALLS[name][("x86_64", "aarch64").index(arch)]


def build(arch):
    """The filter for `arch` ("x86_64" or "aarch64"), as the bytes of an array of struct sock_filter."""
    import struct  # here: the launcher, which only installs, need not import it
    if arch not in AUDIT_ARCH:
        raise ValueError(f"seccomp: no system call table for {arch!r} (x86_64 and aarch64 are known)")
    code = []  # (opcode, k, true label or None, false label or None); None: the next instruction

    def op(opcode, k, jt=None, jf=None):
        code.append((opcode, k, jt, jf))

    labels = {}

    def label(name):
        labels[name] = len(code)

    # A call made under another architecture's numbers (an i386 int 0x80 from an x86_64 process) would slip past
    # every number below: deny it whole.
    op(LD_W_ABS, OFFSET_ARCH)
    op(JEQ, AUDIT_ARCH[arch], None, "eperm")
    op(LD_W_ABS, OFFSET_NR)
    if arch == "x86_64":
        op(JGE, X32_SYSCALL_BIT, "eperm", None)
    for name in DENIED:
        op(JEQ, number(name, arch), "eperm", None)
    # clone3 passes its flags in a struct in memory, which a seccomp filter cannot read; so clone3 fails with
    # ENOSYS, as on a kernel that predates it, and glibc (threads, posix_spawn, fork) falls back to clone, whose
    # flags are a register this filter checks.
    op(JEQ, number("clone3", arch), "enosys", None)
    op(JEQ, number("clone", arch), "clone", None)
    op(JEQ, number("socket", arch), "socket", None)
    op(RET_K, RET_ALLOW)
    label("clone")
    op(LD_W_ABS, _offset_arg_low(0))        # clone's flags: the first argument on both architectures
    op(JSET, CLONE_NAMESPACES, "eperm", None)
    op(RET_K, RET_ALLOW)
    label("socket")
    op(LD_W_ABS, _offset_arg_low(0))        # domain
    op(JEQ, AF_NETLINK, "eperm", None)
    op(JEQ, AF_PACKET, "eperm", None)
    op(LD_W_ABS, _offset_arg_low(1))        # type, with SOCK_NONBLOCK and SOCK_CLOEXEC above its low 4 bits
    op(AND_K, SOCK_TYPE_MASK)
    op(JEQ, SOCK_RAW, "eperm", None)
    op(RET_K, RET_ALLOW)
    label("eperm")
    op(RET_K, RET_ERRNO | EPERM)
    label("enosys")
    op(RET_K, RET_ERRNO | ENOSYS)

    out = bytearray()
    for i, (opcode, k, jt, jf) in enumerate(code):
        offsets = []
        for target in (jt, jf):
            offset = 0 if target is None else labels[target] - i - 1  # jumps count from the next instruction
            if not 0 <= offset <= 255:
                raise AssertionError(f"seccomp: jump of {offset} at {i}")
            offsets.append(offset)
        out += struct.pack("<HBBI", opcode, offsets[0], offsets[1], k)
    return bytes(out)


def install(program, libc=None):
    """Install `program` (from build) on the calling thread, and so on what it execs and forks; OSError naming the
    step that failed. The process must be single-threaded (the filter is not synchronized to other threads)."""
    import ctypes
    libc = libc or ctypes.CDLL(None, use_errno=True)
    arch = os.uname().machine
    if arch not in SYS_SECCOMP:
        raise OSError(0, f"seccomp: no system call number known for {arch}")

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buffer = ctypes.create_string_buffer(program, len(program))
    prog = SockFprog(len(program) // 8, ctypes.addressof(buffer))
    # no_new_privs: required of an unprivileged caller, and no setuid program can then undo the filter
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"seccomp: prctl no_new_privs ({os.strerror(errno)})")
    if libc.syscall(SYS_SECCOMP[arch], SECCOMP_SET_MODE_FILTER, 0, ctypes.byref(prog)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"seccomp: install the filter ({os.strerror(errno)})")
