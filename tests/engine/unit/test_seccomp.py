"""The compiled filter, installed in a forked child: no root needed (no_new_privs suffices)."""

from __future__ import annotations

import ctypes
import errno
import os
import signal

import pytest

from sandboxes.engine import seccomp
from sandboxes.engine.kernel import PR_SET_NO_NEW_PRIVS, Kernel

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def _in_filtered_child(number: int, *args: int) -> int:
    """Run one system call under the filter; return errno (0 on success) or -signal."""
    program = seccomp.compile_filter()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            kernel = Kernel()
            kernel.prctl(PR_SET_NO_NEW_PRIVS, 1)
            kernel.set_seccomp_filter(program)
            result = libc.syscall(number, *[ctypes.c_long(arg) for arg in args])
            os.write(write_end, str(0 if result >= 0 else ctypes.get_errno()).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    data = os.read(read_end, 64)
    os.close(read_end)
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return int(data)


SYS = {
    "keyctl": 250,
    "bpf": 321,
    "unshare": 272,
    "clone3": 435,
    "personality": 135,
    "getpid": 39,
    "mount": 165,
    "socket": 41,
    "ioctl": 16,
    "mknodat": 259,
    "modify_ldt": 154,
}


@pytest.fixture(autouse=True)
def x86_64_only():
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("system call numbers below are x86_64's")


def test_denied_calls_get_eperm():
    assert _in_filtered_child(SYS["keyctl"], 0x7FFFFFFF) == errno.EPERM
    assert _in_filtered_child(SYS["bpf"], -1, 0, 0) == errno.EPERM
    assert _in_filtered_child(SYS["unshare"], 0) == errno.EPERM
    assert _in_filtered_child(SYS["mount"], 1, 1, 1, 0, 0) == errno.EPERM
    assert _in_filtered_child(SYS["modify_ldt"], 0, 1, 16) == errno.EPERM


def test_clone3_gets_enosys():
    assert _in_filtered_child(SYS["clone3"], 0, 0) == errno.ENOSYS


def test_harmless_calls_pass():
    assert _in_filtered_child(SYS["getpid"]) == 0


def test_personality_allows_only_harmless_values():
    assert _in_filtered_child(SYS["personality"], 0xFFFFFFFF) == 0
    assert _in_filtered_child(SYS["personality"], 0) == 0
    assert _in_filtered_child(SYS["personality"], 0x0040000) == errno.EPERM  # ADDR_NO_RANDOMIZE
    assert _in_filtered_child(SYS["personality"], 0x0400000) == errno.EPERM  # READ_IMPLIES_EXEC


def test_argument_filters_compare_the_low_32_bits():
    tiocsti = seccomp.TIOCSTI
    assert _in_filtered_child(SYS["ioctl"], 0, tiocsti, 0) == errno.EPERM
    assert _in_filtered_child(SYS["ioctl"], 0, (1 << 32) | tiocsti, 0) == errno.EPERM
    assert _in_filtered_child(SYS["socket"], seccomp.AF_ALG, 5, 0) == errno.EPERM
    assert _in_filtered_child(SYS["socket"], (1 << 32) | seccomp.AF_VSOCK, 1, 0) == errno.EPERM
    assert _in_filtered_child(SYS["mknodat"], -100, 1, 0o020600, 0) == errno.EPERM  # S_IFCHR


def test_x32_abi_is_killed():
    assert _in_filtered_child(0x40000000 | SYS["getpid"]) == -signal.SIGSYS


def test_the_deny_list_covers_security_md():
    denied = {name for group in seccomp.DENIED_SYSCALLS.values() for name in group}
    for name in (
        "keyctl",
        "add_key",
        "userfaultfd",
        "bpf",
        "perf_event_open",
        "io_uring_setup",
        "open_by_handle_at",
        "init_module",
        "finit_module",
        "kexec_load",
        "reboot",
        "swapon",
        "acct",
        "clock_settime",
        "syslog",
        "mount",
        "unshare",
        "setns",
        "modify_ldt",
    ):
        assert name in denied, name
