"""The engine's only door to the kernel through ctypes.

Python 3.11 has no wrappers for pidfds, openat2, statx, capabilities or
seccomp, so they live here, each raising :class:`KernelError` that names the
step and the path.  The rest of the engine calls these by name, through a
:class:`Kernel` object.  What a new sandbox does to itself (namespaces,
mounts, pivot_root, capabilities, seccomp) is not here: the zygote's child
does it in C (``native/confine.c``), from a plan that ``rootfs.py`` builds as
data.
"""

from __future__ import annotations

import ctypes
import os
import struct
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

# Namespace flags (linux/sched.h).
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

# Mount flags (linux/mount.h).
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24
MNT_DETACH = 2

# prctl options.
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36

# openat2 resolve flags (linux/openat2.h).
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10

AT_EMPTY_PATH = 0x1000
AT_SYMLINK_NOFOLLOW = 0x100
STATX_MNT_ID = 0x1000
SECCOMP_SET_MODE_FILTER = 1
LINUX_CAPABILITY_VERSION_3 = 0x20080522

_SYSCALL_NUMBERS = {
    "x86_64": {
        "seccomp": 317,
        "pidfd_send_signal": 424,
        "pidfd_open": 434,
        "openat2": 437,
        "capset": 126,
        "capget": 125,
        "statx": 332,
    },
    "aarch64": {
        "seccomp": 277,
        "pidfd_send_signal": 424,
        "pidfd_open": 434,
        "openat2": 437,
        "capset": 91,
        "capget": 90,
        "statx": 291,
    },
}


class KernelError(OSError):
    """A kernel call failed: which step, on which object, and why."""

    def __init__(self, error_number: int, step: str, target: str = "") -> None:
        message = f"{step} failed"
        if target:
            message += f" on {target}"
        message += f": {os.strerror(error_number)}"
        super().__init__(error_number, message)
        self.step = step
        self.target = target

    def __str__(self) -> str:
        return str(self.args[1])


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

MACHINE = os.uname().machine
try:
    _NUMBERS = _SYSCALL_NUMBERS[MACHINE]
except KeyError as missing:  # pragma: no cover - import-time platform guard
    raise ImportError(f"forkyard's engine does not support {MACHINE}") from missing


def _fail(step: str, target: str = "") -> KernelError:
    return KernelError(ctypes.get_errno(), step, target)


def _encode(value: str | bytes | None) -> bytes | None:
    if value is None:
        return None
    return value if isinstance(value, bytes) else os.fsencode(value)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class _SockFilterProgram(ctypes.Structure):
    _fields_ = [("length", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class Kernel:
    """Real system calls.  Every method raises KernelError on failure."""

    def mount(self, source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        """mount(2) in the engine's own (the host's) mount namespace: only the
        layers directory's bind onto itself (statedir.py); a sandbox's mounts
        are made by its own init, in its own namespace (native/confine.c)."""
        if _libc.mount(_encode(source), _encode(target), _encode(fstype), flags, _encode(data)) != 0:
            raise _fail("mount", target)

    def umount(self, target: str, flags: int = 0) -> None:
        if _libc.umount2(_encode(target), flags) != 0:
            raise _fail("umount", target)

    def prctl(self, option: int, arg2: int = 0, arg3: int = 0) -> None:
        if _libc.prctl(option, arg2, arg3, 0, 0) != 0:
            raise _fail("prctl", str(option))

    @contextmanager
    def filesystem_identity(self, uid: int, gid: int) -> Iterator[None]:
        """Act on files as ``uid``/``gid``, in this thread only.

        A sandbox's overlay is mounted in its user namespace, where host root
        is not mapped: creating a file there as uid 0 fails with EOVERFLOW.
        setfsuid is per thread, so a worker thread can act as the sandbox's
        root while the rest of the engine stays root.  Leaving uid 0 drops
        the file capabilities from the effective set; we take them back from
        the permitted set so that permissions inside the sandbox never stop
        the engine.
        """
        _libc.setfsgid(gid)
        _libc.setfsuid(uid)
        try:
            self._raise_effective_capabilities()
            yield
        finally:
            _libc.setfsuid(0)
            _libc.setfsgid(0)

    def _raise_effective_capabilities(self) -> None:
        header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
        data = (_CapData * 2)()
        if _libc.syscall(_NUMBERS["capget"], ctypes.byref(header), data) != 0:
            raise _fail("capget")
        for item in data:
            item.effective = item.permitted
        if _libc.syscall(_NUMBERS["capset"], ctypes.byref(header), data) != 0:
            raise _fail("capset")

    def set_seccomp_filter(self, program: bytes) -> None:
        """Install a classic-BPF seccomp program (8 bytes per instruction)."""
        buffer = ctypes.create_string_buffer(program, len(program))
        fprog = _SockFilterProgram(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
        if _libc.syscall(_NUMBERS["seccomp"], SECCOMP_SET_MODE_FILTER, 0, ctypes.byref(fprog)) != 0:
            raise _fail("seccomp")

    def pidfd_open(self, pid: int) -> int:
        fd = _libc.syscall(_NUMBERS["pidfd_open"], pid, 0)
        if fd < 0:
            raise _fail("pidfd_open", str(pid))
        return int(fd)

    def pidfd_send_signal(self, pidfd: int, signal_number: int) -> None:
        if _libc.syscall(_NUMBERS["pidfd_send_signal"], pidfd, signal_number, None, 0) != 0:
            raise _fail("pidfd_send_signal", f"pidfd {pidfd}")

    def setns(self, fd: int, nstype: int) -> None:
        """Move this thread into the namespace ``fd`` names (a network namespace is per thread)."""
        if _libc.setns(fd, nstype) != 0:
            raise _fail("setns", str(nstype))

    def openat2(self, dir_fd: int, path: str | bytes, flags: int, resolve: int, mode: int = 0) -> int:
        how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, resolve)
        fd = _libc.syscall(_NUMBERS["openat2"], dir_fd, _encode(path), ctypes.byref(how), ctypes.sizeof(how))
        if fd < 0:
            raise _fail("openat2", os.fsdecode(path))
        return int(fd)


def mount_id(fd: int, name: str = "") -> int:
    """The id of the mount holding ``name`` (relative to ``fd``), or ``fd`` itself.

    st_dev cannot tell mount points apart on overlayfs, whose files report the
    device of the layer they come from; the mount id can.
    """
    buffer = ctypes.create_string_buffer(256)
    flags = AT_SYMLINK_NOFOLLOW | (0 if name else AT_EMPTY_PATH)
    if _libc.syscall(_NUMBERS["statx"], fd, _encode(name) or b"", flags, STATX_MNT_ID, buffer) != 0:
        raise _fail("statx", name or f"fd {fd}")
    # struct statx: stx_mnt_id is the u64 at offset 144.
    return int(struct.unpack_from("=Q", buffer.raw, 144)[0])


def filesystem_type(fd: int) -> int:
    """The magic number of the filesystem holding ``fd`` (fstatfs' f_type: os.statvfs does not give it)."""
    buffer = ctypes.create_string_buffer(120)  # struct statfs; f_type is the long at its start
    if _libc.fstatfs(fd, buffer) != 0:
        raise _fail("fstatfs", f"fd {fd}")
    return int(struct.unpack_from("l", buffer.raw)[0])


def process_start_time(pid: int, proc: str = "/proc") -> int:
    """Field 22 of /proc/<pid>/stat: with the pid, it names one process forever."""
    # os.open and one read, not open(): a buffered file object cost as much again as the read (it is asked
    # before every file call on a sandbox, to know that its pid is still its init).
    fd = os.open(f"{proc}/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    try:
        raw = os.read(fd, 4096)  # a few hundred bytes: the command name is at most 64
    finally:
        os.close(fd)
    # The command name may hold spaces and parentheses: split after the last ')'.
    fields = raw[raw.rindex(b")") + 2 :].split()
    return int(fields[19])
