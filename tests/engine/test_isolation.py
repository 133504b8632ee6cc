"""Each isolation claim of SECURITY.md that the engine covers, proven with a probe.

Every probe runs twice: on the host as root (the control: it shows the probe
reaches the kernel and can succeed) and inside a sandbox (which must be
refused).  Tests are named after the attack they guard against.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes.engine.client import EngineClient

pytestmark = pytest.mark.root

PROBE = "/probe"


@pytest.fixture(scope="module")
def probed(engine_process, probe_binary: Path) -> Iterator[tuple[EngineClient, str]]:
    """One sandbox with the probe uploaded through the file API."""
    with engine_process.client() as client:
        sandbox = client.create(template="base", size="tiny", ttl_s=900)["id"]
        client.write_file(sandbox, PROBE, probe_binary.read_bytes(), mode=0o755)
        yield client, sandbox
        client.destroy(sandbox)


def inside(probed: tuple[EngineClient, str], *args: str, timeout_s: float = 20) -> str:
    client, sandbox = probed
    result = client.exec(sandbox, [PROBE, *args], timeout_s=timeout_s)
    if result.signal:
        return f"KILLED:{signal.Signals(result.signal).name}"
    lines = [line for line in result.stdout.decode().splitlines() if line.startswith("RESULT ")]
    assert lines, f"probe printed no result: {result}"
    return lines[-1].split(" ", 1)[1]


def on_host(probe_binary: Path, *args: str) -> str:
    completed = subprocess.run([str(probe_binary), *args], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=20)
    if completed.returncode < 0:
        return f"KILLED:{signal.Signals(-completed.returncode).name}"
    return [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")][-1].split(" ", 1)[1]


BLOCKED = {"EPERM", "EACCES", "ENOSYS", "KILLED:SIGSYS"}

# (probe, what a working control shows on the host, as root)
KERNEL_SURFACE = [
    ("mount", {"EFAULT"}),
    ("umount", {"EFAULT", "EINVAL"}),
    ("pivot_root", {"EFAULT", "EINVAL"}),
    ("unshare_user", {"OK"}),
    ("unshare_mount", {"OK"}),
    ("clone_newuser", {"OK"}),
    ("setns", {"EBADF"}),
    ("keyctl", {"EOPNOTSUPP", "EINVAL"}),
    ("add_key", {"EFAULT", "EINVAL"}),
    ("request_key", {"EFAULT", "EINVAL"}),
    ("bpf", {"EINVAL", "EFAULT"}),
    ("perf_event_open", {"EFAULT", "EINVAL", "ENOENT", "ENODEV"}),
    ("userfaultfd", {"EINVAL"}),
    ("io_uring_setup", {"EFAULT", "EINVAL"}),
    ("open_by_handle_at", {"EBADF", "EFAULT", "EINVAL"}),
    ("init_module", {"EFAULT", "ENOSYS"}),
    ("finit_module", {"EBADF", "ENOSYS"}),
    ("kexec_load", {"EINVAL", "ENOSYS"}),
    ("reboot", {"EINVAL"}),
    ("swapon", {"EFAULT"}),
    ("acct", {"EFAULT"}),
    ("clock_settime", {"EFAULT"}),
    ("settimeofday", {"EFAULT"}),
    ("syslog", {"EINVAL"}),
    ("modify_ldt", {"OK", "EFAULT"}),
    ("personality", {"OK"}),
]


@pytest.mark.parametrize("probe,control", KERNEL_SURFACE, ids=[name for name, _ in KERNEL_SURFACE])
def test_kernel_surface_is_refused(probed, probe_binary, probe, control):
    host = on_host(probe_binary, probe)
    assert host in control, f"control: {probe} on the host gave {host}, expected one of {control}"
    sandboxed = inside(probed, probe)
    assert sandboxed in BLOCKED, f"{probe} inside the sandbox gave {sandboxed}"


def test_clone3_is_answered_enosys_so_libc_falls_back_to_clone(probed, probe_binary):
    assert on_host(probe_binary, "clone3") in {"EFAULT", "EINVAL", "E7"}
    assert inside(probed, "clone3") == "ENOSYS"


def test_personality_query_still_works(probed):
    assert inside(probed, "personality_query") == "OK"


def test_32_bit_syscall_abi_kills_the_process(probed, probe_binary):
    assert on_host(probe_binary, "i386_syscall") == "OK"
    assert inside(probed, "i386_syscall") == "KILLED:SIGSYS"


def test_x32_syscall_abi_kills_the_process(probed, probe_binary):
    assert on_host(probe_binary, "x32_syscall") in {"OK", "ENOSYS"}
    assert inside(probed, "x32_syscall") == "KILLED:SIGSYS"


def test_af_alg_and_vsock_sockets_are_refused(probed, probe_binary):
    for probe in ("af_alg", "af_vsock"):
        assert on_host(probe_binary, probe) in {"OK", "EAFNOSUPPORT"}
        assert inside(probed, probe) == "EPERM"


def test_raw_sockets_cannot_spoof_source_addresses(probed, probe_binary):
    for probe in ("raw_socket", "packet_socket"):
        assert on_host(probe_binary, probe) == "OK"
        assert inside(probed, probe) == "EPERM"


def test_tiocsti_terminal_injection_is_refused(probed):
    # stdin is a pipe: allowed would be ENOTTY, refused is EPERM.
    assert inside(probed, "tiocsti") == "EPERM"


def test_btrfs_ioctls_cannot_make_a_subvolume_beyond_the_disk_quota(probed, probe_binary, engine_process):
    """/dev/shm is a directory of the sandbox's disk itself (a btrfs subvolume, not the overlay): a subvolume
    made there would be counted apart, unlimited. Every btrfs ioctl is refused inside."""
    control = engine_process.config.disks_dir
    assert on_host(probe_binary, "btrfs_subvolume", str(control)) == "OK"
    subprocess.run(["btrfs", "subvolume", "delete", str(control / "probe-subvolume")], check=True, capture_output=True)
    assert inside(probed, "btrfs_subvolume", "/dev/shm") == "EPERM"
    assert inside(probed, "btrfs_subvolume", "/tmp") in {"EPERM", "ENOTTY"}  # the overlay passes none on anyway


def test_mknod_of_a_device_is_refused(probed, probe_binary, tmp_path):
    node = tmp_path / "control-null"
    assert on_host(probe_binary, "mknod_char", str(node)) == "OK"
    node.unlink()
    assert inside(probed, "mknod_char", "/tmp/null") == "EPERM"


def test_interfaces_cannot_be_changed(probed, probe_binary):
    assert inside(probed, "lo_down") == "EPERM"


def test_proc_sys_and_sysrq_are_read_only(probed):
    assert inside(probed, "write", "/proc/sys/kernel/hostname", "evil") in {"EROFS", "EACCES"}
    assert inside(probed, "write", "/proc/sys/net/ipv4/ip_forward", "1") in {"EROFS", "EACCES"}
    assert inside(probed, "open_write", "/proc/sysrq-trigger") in {"EROFS", "EACCES", "ENOENT"}


def test_sys_is_read_only(probed):
    assert inside(probed, "write", "/sys/kernel/uevent_helper", "/evil") in {"EROFS", "EACCES", "ENOENT"}
    assert inside(probed, "write", "/sys/fs/cgroup/release_agent", "/evil") in {"EROFS", "EACCES", "ENOENT"}


def test_sys_is_one_shared_sysfs_of_an_empty_network_namespace(probed, engine_process):
    """Every sandbox's /sys is a bind of the engine's one sysfs (no superblock a sandbox), read-only,
    and shows no network device at all: the namespace that mounted it ended with the mount."""
    client, sandbox = probed
    shared = engine_process.config.state_dir / "sys"
    other = client.create(template="base", size="tiny", ttl_s=300)["id"]
    try:
        devices = {client.exec(name, "stat -c %d /sys").stdout.decode().strip() for name in (sandbox, other)}
        assert devices == {str(os.stat(shared).st_dev)}, "both /sys are the engine's sysfs superblock"
        assert client.exec(sandbox, "ls /sys/class/net").stdout.decode().split() == []
        assert len(os.listdir("/sys/class/net")) > 1, "the host has devices of its own to hide"
        mounts = client.exec(sandbox, "cat /proc/self/mountinfo").stdout.decode().splitlines()
        sys_mount = next(line for line in mounts if line.split()[4] == "/sys")
        assert "ro" in sys_mount.split()[5].split(",") and sys_mount.split(" - ")[1].split()[0] == "sysfs", sys_mount
        writable = next(path for path in ("/sys/kernel/mm/transparent_hugepage/enabled", "/sys/power/state") if os.path.exists(path))
        assert inside(probed, "write", writable, "never") == "EROFS"
    finally:
        client.destroy(other)


def test_host_kernel_interfaces_are_masked(probed):
    for path in ("/proc/kcore", "/proc/timer_list", "/proc/kmsg", "/proc/sched_debug"):
        assert inside(probed, "read_first_byte", path) in {"EMPTY", "ENOENT", "EACCES", "EPERM"}, path
    assert inside(probed, "read_first_byte", "/proc/keys") in {"EMPTY", "ENOENT"}


def test_the_kernels_crash_notes_address_is_masked(probed, probe_binary):
    # World-readable on the host: the physical address of the kernel's crash
    # notes, a step towards defeating its address randomization.
    if not os.path.exists("/sys/kernel/vmcoreinfo"):
        if os.environ.get("FORKYARD_CI"):
            pytest.fail("this kernel has no /sys/kernel/vmcoreinfo to mask")
        pytest.skip("this kernel has no /sys/kernel/vmcoreinfo")
    assert on_host(probe_binary, "read_first_byte", "/sys/kernel/vmcoreinfo") == "OK"
    assert inside(probed, "read_first_byte", "/sys/kernel/vmcoreinfo") == "EMPTY"
    client, sandbox = probed
    mounts = client.exec(sandbox, "cat /proc/self/mountinfo").stdout.decode()
    assert " /sys/kernel/vmcoreinfo " in mounts


def test_host_devices_are_absent(probed):
    for path in ("/dev/mem", "/dev/kmsg", "/dev/kvm", "/dev/sda", "/dev/vda", "/dev/loop0"):
        assert inside(probed, "open_read", path) == "ENOENT", path


def test_the_binary_that_enters_the_sandbox_cannot_be_overwritten(probed):
    # /proc/1/exe is init, executed from a sealed memfd: not writable, and
    # not even readable by code in the sandbox (init is not dumpable).
    assert inside(probed, "open_write", "/proc/1/exe") in {"EACCES", "EPERM", "ETXTBSY"}
    client, sandbox = probed
    result = client.exec(sandbox, "echo x > /proc/self/exe; echo rc=$?")
    assert b"rc=0" not in result.stdout


def test_init_file_descriptors_cannot_be_reached(probed):
    # init holds a handle on the sandbox's writable layer (fd 5) for the
    # engine; being non-dumpable, its fd links stay closed to the sandbox.
    client, sandbox = probed
    for fd in ("3", "5"):
        assert inside(probed, "open_read", f"/proc/1/fd/{fd}") in {"EACCES", "EPERM"}
    assert client.exec(sandbox, "readlink /proc/1/fd/5").exit_code != 0
    assert client.exec(sandbox, "ls /proc/1/fd/5/").exit_code != 0
    assert client.exec(sandbox, "cat /proc/1/environ").exit_code != 0
    assert inside(probed, "ptrace_attach", "1") == "EPERM"


def test_exec_holds_only_stdio_file_descriptors(probed):
    client, sandbox = probed
    result = client.exec(sandbox, [PROBE, "fds"])
    fds = result.stdout.decode().split("FDS", 1)[1].splitlines()[0].split()
    # 0, 1, 2, plus at most the directory handle the probe itself opens.
    assert set(fds) <= {"0", "1", "2", "3"}, fds
    cwd = client.exec(sandbox, "readlink /proc/self/cwd; readlink /proc/self/root").stdout.decode().split()
    assert cwd == ["/", "/"]


def test_host_processes_are_invisible_and_unsignalable(probed, probe_binary):
    host_pid = os.getpid()
    client, sandbox = probed
    listing = client.exec(sandbox, "ps -o pid,comm").stdout.decode()
    pids = [line.split()[0] for line in listing.splitlines()[1:]]
    assert "1" in pids and len(pids) <= 4, listing  # init, sh, ps
    assert "pytest" not in listing and "python" not in listing
    assert on_host(probe_binary, "kill", str(host_pid)) == "OK"
    assert inside(probed, "kill", str(host_pid)) == "ESRCH"
    assert inside(probed, "ptrace_attach", str(host_pid)) in {"ESRCH", "EPERM"}
    assert inside(probed, "process_vm_readv", str(host_pid)) in BLOCKED | {"ESRCH"}


def test_hostname_is_the_sandbox_id(probed):
    client, sandbox = probed
    assert client.exec(sandbox, "hostname").stdout.decode().strip() == sandbox
    assert client.exec(sandbox, "cat /proc/sys/kernel/hostname").stdout.decode().strip() == sandbox
    assert socket.gethostname() != sandbox


def test_root_inside_is_an_unprivileged_uid_outside(probed, engine_process):
    client, sandbox = probed
    config = engine_process.config
    assert client.exec(sandbox, "id -u").stdout.strip() == b"0"
    uid_map = client.exec(sandbox, "cat /proc/self/uid_map").stdout.split()
    # Its own range (test_uid_ranges.py): above the layers' range, one of uid_count ids.
    own = int(uid_map[1])
    assert uid_map[0::2] == [b"0", str(config.uid_count).encode()]
    assert own > config.uid_base and (own - config.uid_base) % config.uid_count == 0
    # A process in the sandbox, seen from the host, runs as that unprivileged uid.
    started = client.exec(sandbox, "sleep 30 >/dev/null 2>&1 & echo started")
    assert started.exit_code == 0
    holders = subprocess.run(["pgrep", "-u", str(own), "-x", "sleep"], capture_output=True, text=True)
    assert holders.stdout.split(), "the sandbox's sleep is not running as its root's host uid"


def test_posture_of_an_exec_process(probed):
    """Like gVisor's posture test: /proc/self/status, field by field."""
    client, sandbox = probed
    status = dict(
        line.split(":\t", 1)
        for line in client.exec(sandbox, "cat /proc/self/status").stdout.decode().splitlines()
        if ":\t" in line
    )
    kept = int(status["CapEff"], 16)
    dangerous = {
        "SYS_ADMIN": 21,
        "NET_ADMIN": 12,
        "SYS_PTRACE": 19,
        "SYS_MODULE": 16,
        "NET_RAW": 13,
        "MKNOD": 27,
        "SYS_RAWIO": 17,
    }
    for name, bit in dangerous.items():
        assert not kept & (1 << bit), f"CAP_{name} is effective"
    assert status["CapBnd"] == status["CapEff"]
    assert int(status["CapAmb"], 16) == 0
    assert status["NoNewPrivs"].strip() == "1"
    assert status["Seccomp"].strip() == "2"
    namespaces = client.exec(sandbox, "readlink /proc/self/ns/*").stdout.decode().split()
    host = {os.readlink(f"/proc/self/ns/{name}") for name in ("user", "pid", "mnt", "net", "ipc", "uts", "cgroup")}
    assert not host & set(namespaces), "the sandbox shares a namespace with the host"


def test_mounts_are_confined_to_the_sandbox(probed, engine_process):
    client, sandbox = probed
    mounts = client.exec(sandbox, "cat /proc/self/mounts").stdout.decode()
    assert "overlay / overlay" in mounts
    host_mounts = Path("/proc/self/mountinfo").read_text()
    assert str(engine_process.config.mount_dir) not in host_mounts, "a sandbox mount leaked into the host"


def test_network_is_loopback_only_and_host_ports_are_unreachable(probed, probe_binary):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    try:
        assert on_host(probe_binary, "connect", f"127.0.0.1:{port}") == "OK"
        assert inside(probed, "connect", f"127.0.0.1:{port}") == "ECONNREFUSED"
        # The sandbox's own network namespace, as procfs shows it (its /sys is the host's shared sysfs).
        devices = probed[0].exec(probed[1], "tail -n +3 /proc/net/dev").stdout.decode().splitlines()
        assert [line.split(":")[0].strip() for line in devices] == ["lo"]
        # No route anywhere else: the metadata address is unreachable.
        assert inside(probed, "connect", "169.254.169.254:80") in {"ENETUNREACH", "EHOSTUNREACH"}
    finally:
        listener.close()
        for connection in accepted:
            connection.close()


def test_one_sandbox_cannot_see_or_reach_another(engine, probed):
    client, first = probed
    second = engine.create(template="base", size="tiny", ttl_s=120)["id"]
    try:
        engine.exec(second, "nc -l -p 7000 >/dev/null 2>&1 & echo $!")
        assert inside(probed, "connect", "127.0.0.1:7000") == "ECONNREFUSED"
        assert second.encode() not in client.exec(first, "ps; hostname").stdout
        engine.write_file(second, "/tmp/secret", b"second's data")
        assert client.exec(first, "cat /tmp/secret").exit_code != 0
    finally:
        engine.destroy(second)
