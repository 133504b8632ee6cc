"""The seccomp filter every sandbox process runs under.

The policy is a deny list (SECURITY.md): everything is allowed except the
kernel surface that lets code leave or attack its sandbox.  libseccomp (a
Debian system library, reached through ctypes) compiles it once per engine
start into classic BPF; each new sandbox installs those bytes with one
``seccomp()`` call, so the compiler never runs on the create path.

libseccomp adds the architecture checks we rely on: a 32-bit (int 0x80) or
x32 system call does not match the native architecture and kills the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import stat
import struct
from dataclasses import dataclass

from .kernel import (
    CLONE_NEWCGROUP,
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    CLONE_NEWUTS,
    MACHINE,
)

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_ACT_KILL_PROCESS = 0x80000000
SCMP_FLTATR_ACT_BADARCH = 2
SCMP_CMP_MASKED_EQ = 7

NAMESPACE_FLAGS = (
    CLONE_NEWNS,
    CLONE_NEWUTS,
    CLONE_NEWIPC,
    CLONE_NEWUSER,
    CLONE_NEWPID,
    CLONE_NEWNET,
    CLONE_NEWCGROUP,
)

# Refused outright with EPERM.  Grouped by what they would give away.
DENIED_SYSCALLS: dict[str, tuple[str, ...]] = {
    "namespaces and mounts": (
        "unshare",
        "setns",
        "mount",
        "umount2",
        "pivot_root",
        "move_mount",
        "open_tree",
        "fsopen",
        "fsconfig",
        "fsmount",
        "fspick",
        "mount_setattr",
    ),
    "kernel keyrings": ("keyctl", "add_key", "request_key"),
    "kernel attack surface": (
        "bpf",
        "perf_event_open",
        "userfaultfd",
        "io_uring_setup",
        "io_uring_enter",
        "io_uring_register",
        "kcmp",
        "lookup_dcookie",
    ),
    "file handles that bypass the mount tree": ("open_by_handle_at", "name_to_handle_at"),
    "modules and reboot": (
        "init_module",
        "finit_module",
        "delete_module",
        "create_module",
        "kexec_load",
        "kexec_file_load",
        "reboot",
    ),
    "host-wide state": (
        "swapon",
        "swapoff",
        "acct",
        "clock_settime",
        "clock_adjtime",
        "settimeofday",
        "adjtimex",
        "syslog",
        "quotactl",
        "quotactl_fd",
        "nfsservctl",
        "vhangup",
        "sysfs",
        "ustat",
        "uselib",
        "iopl",
        "ioperm",
        "_sysctl",
        "get_kernel_syms",
        "query_module",
        "fanotify_init",
        "move_pages",
        "migrate_pages",
    ),
    "other processes' memory": ("process_vm_readv", "process_vm_writev"),
    # x86's local descriptor table: 16-bit and segment tricks no program of
    # a sandbox needs, and a history of kernel bugs (Docker denies it too).
    "x86 segments": ("modify_ldt",),
}

# Answered ENOSYS rather than EPERM: clone3 passes its flags in memory that a
# filter cannot read, and ENOSYS makes libc fall back to clone, which it can.
ENOSYS_SYSCALLS = ("clone3",)

# Answered 0 without running: a sandbox's disk is gone at its destroy and with its host, so asking
# for its writes to reach the platter buys nothing, and each one flushed the whole shared disk pool
# (dpkg's fsync per file made a package install 1.8x slower than on tmpfs); sync and syncfs flushed
# every sandbox's writes, or the host's, at one sandbox's word.  Snapshots read the page cache.
SKIPPED_SYSCALLS = ("fsync", "fdatasync", "sync_file_range", "syncfs", "sync")

TIOCSTI = 0x5412
TIOCLINUX = 0x541C
IOCTL_TYPE_MASK = 0xFF00  # an ioctl request's type byte (linux/ioctl.h)
BTRFS_IOCTL_TYPE = 0x94
AF_ALG = 38
AF_VSOCK = 40
FILE_TYPE_MASK = 0o170000  # S_IFMT
# personality() values that do not weaken the process (as Docker allows).
ALLOWED_PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)


class _ArgCompare(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def _errno_action(number: int) -> int:
    return 0x00050000 | (number & 0xFFFF)


@dataclass(frozen=True)
class _Rule:
    syscall: str
    action: int
    conditions: tuple[tuple[int, int, int, int], ...] = ()


def _rules() -> list[_Rule]:
    deny = _errno_action(errno.EPERM)
    rules = [_Rule(name, deny) for group in DENIED_SYSCALLS.values() for name in group]
    rules += [_Rule(name, _errno_action(errno.ENOSYS)) for name in ENOSYS_SYSCALLS]
    rules += [_Rule(name, _errno_action(0)) for name in SKIPPED_SYSCALLS]
    # clone with any namespace flag: one rule per flag, since conditions AND.
    rules += [_Rule("clone", deny, ((0, SCMP_CMP_MASKED_EQ, flag, flag),)) for flag in NAMESPACE_FLAGS]
    # Compare only the low 32 bits the kernel itself reads, so setting high
    # bits cannot slip past the filter.
    low = 0xFFFFFFFF
    rules += [_Rule("ioctl", deny, ((1, SCMP_CMP_MASKED_EQ, low, request),)) for request in (TIOCSTI, TIOCLINUX)]
    # Every btrfs ioctl (type 0x94): a sandbox's /dev/shm is a directory of its disk, a btrfs subvolume, and
    # a subvolume made under it would be counted apart from its quota, unlimited (disks.py).
    rules.append(_Rule("ioctl", deny, ((1, SCMP_CMP_MASKED_EQ, IOCTL_TYPE_MASK, BTRFS_IOCTL_TYPE << 8),)))
    rules += [_Rule("socket", deny, ((0, SCMP_CMP_MASKED_EQ, low, family),)) for family in (AF_ALG, AF_VSOCK)]
    for device_type in (stat.S_IFCHR, stat.S_IFBLK):
        rules.append(_Rule("mknod", deny, ((1, SCMP_CMP_MASKED_EQ, FILE_TYPE_MASK, device_type),)))
        rules.append(_Rule("mknodat", deny, ((2, SCMP_CMP_MASKED_EQ, FILE_TYPE_MASK, device_type),)))
    return rules


_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_BPF_LOAD_WORD, _BPF_JUMP_EQUAL, _BPF_RETURN = 0x20, 0x15, 0x06


def _instruction(code: int, jump_true: int, jump_false: int, value: int) -> bytes:
    return struct.pack("=HBBI", code, jump_true, jump_false, value)


def _personality_prefix(personality_number: int) -> bytes:
    """Hand-written BPF that runs before libseccomp's program.

    libseccomp cannot say "none of these values" (its conditions on one
    argument cannot be combined), so personality() is checked here: the
    listed values pass, any other is EPERM, other system calls fall through.
    """
    allowed = ALLOWED_PERSONALITIES
    # Layout: load arch, check, load nr, check, load arg0, N compares, deny, allow.
    length = 5 + len(allowed) + 2
    program = [
        _instruction(_BPF_LOAD_WORD, 0, 0, 4),  # seccomp_data.arch
        _instruction(_BPF_JUMP_EQUAL, 0, length - 2, _AUDIT_ARCH[MACHINE]),
        _instruction(_BPF_LOAD_WORD, 0, 0, 0),  # seccomp_data.nr
        _instruction(_BPF_JUMP_EQUAL, 0, length - 4, personality_number),
        # The kernel reads an unsigned int: the low word of args[0] is all that counts.
        _instruction(_BPF_LOAD_WORD, 0, 0, 16),
    ]
    for index, value in enumerate(allowed):
        remaining = len(allowed) - index - 1
        program.append(_instruction(_BPF_JUMP_EQUAL, remaining + 1, 0, value))
    program.append(_instruction(_BPF_RETURN, 0, 0, _errno_action(errno.EPERM)))
    program.append(_instruction(_BPF_RETURN, 0, 0, SCMP_ACT_ALLOW))
    assert len(program) == length
    return b"".join(program)


class SeccompUnavailable(RuntimeError):
    pass


def _library() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        library = ctypes.CDLL(name, use_errno=True)
    except OSError as error:
        raise SeccompUnavailable("libseccomp is missing: install Debian's libseccomp2 package") from error
    library.seccomp_init.restype = ctypes.c_void_p
    library.seccomp_init.argtypes = [ctypes.c_uint32]
    library.seccomp_release.argtypes = [ctypes.c_void_p]
    library.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    library.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    library.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCompare),
    ]
    library.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return library


def compile_filter() -> bytes:
    """Compile the policy to classic BPF for this machine's architecture."""
    library = _library()
    context = library.seccomp_init(SCMP_ACT_ALLOW)
    if not context:
        raise SeccompUnavailable("seccomp_init failed")
    try:
        result = library.seccomp_attr_set(context, SCMP_FLTATR_ACT_BADARCH, SCMP_ACT_KILL_PROCESS)
        if result < 0:
            raise SeccompUnavailable(f"seccomp_attr_set: {os.strerror(-result)}")
        for rule in _rules():
            number = library.seccomp_syscall_resolve_name(rule.syscall.encode())
            if number < 0:
                continue  # not a system call on this architecture
            conditions = (_ArgCompare * max(1, len(rule.conditions)))(*[_ArgCompare(*condition) for condition in rule.conditions])
            result = library.seccomp_rule_add_array(context, rule.action, number, len(rule.conditions), conditions)
            if result < 0:
                raise SeccompUnavailable(f"seccomp rule for {rule.syscall}: {os.strerror(-result)}")
        read_end, write_end = os.pipe()
        try:
            result = library.seccomp_export_bpf(context, write_end)
            os.close(write_end)
            write_end = -1
            if result < 0:
                raise SeccompUnavailable(f"seccomp_export_bpf: {os.strerror(-result)}")
            chunks = []
            while chunk := os.read(read_end, 65536):
                chunks.append(chunk)
        finally:
            os.close(read_end)
            if write_end >= 0:
                os.close(write_end)
        personality = library.seccomp_syscall_resolve_name(b"personality")
        return _personality_prefix(personality) + b"".join(chunks)
    finally:
        library.seccomp_release(context)
