"""Creating a sandbox through the zygote: the steps native/confine.c runs, against the real kernel.

The plan's order is checked without root in unit/test_rootfs.py; here the C
side meets hostile templates, and the process tree it builds is checked:
every init is the spawner's child (so it is reaped and its exit reported),
with nothing inherited that it should not have.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import signal
import socket
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes.engine import errors
from sandboxes.engine.template_store import layer_directory_name
from tests.engine.engines import processes, separate_engine, snapshot_host
from tests.support.engine import EngineProcess

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def engine_process(work_dir: Path) -> Iterator[EngineProcess]:
    """This module's own engine (the ``engine`` and ``sandbox`` fixtures then use
    it): its failed creates must not count against the shared one."""
    with separate_engine(work_dir / f"create-{os.urandom(3).hex()}") as engine:
        yield engine


def _tampered_template(engine, engine_process, tmp_path: Path, name: str, change) -> str:
    """A busybox template whose layer ``change(layer_directory)`` then edits on disk.

    Import makes /proc, /sys, /dev, /tmp and /root plain directories, so a
    hostile root can only come from a layer written some other way: a
    snapshot of what sandbox code wrote.  Editing the layer stands in for that.
    """
    archive_path = tmp_path / f"{name}.tar"
    with tarfile.open(archive_path, "w") as archive:
        for entry, data in (("bin/busybox", Path("/bin/busybox").read_bytes()), ("unique", name.encode())):
            info = tarfile.TarInfo(entry)
            info.size, info.mode = len(data), 0o755
            archive.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("bin/sh")
        link.type, link.linkname = tarfile.SYMTYPE, "busybox"
        archive.addfile(link)
    engine.import_template(name, str(archive_path))
    (layer,) = engine.call("templates.get", name=name)["layers"]
    change(engine_process.config.layers_dir / layer_directory_name(layer))
    return name


def _plant(name: str, replacement: str | bytes):
    def change(layer: Path) -> None:
        shutil.rmtree(layer / name)
        if isinstance(replacement, str):
            (layer / name).symlink_to(replacement)
        else:
            (layer / name).write_bytes(replacement)

    return change


def _init_pid(sandbox_id: str) -> int:
    def in_sandbox(pid: int) -> bool:
        try:
            return f"fy-{sandbox_id}" in Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            return False

    (pid,) = [pid for pid, (name, _) in processes().items() if name == "forkyard-init" and in_sandbox(pid)]
    return pid


def _spawner_pid(engine_process) -> int:
    """The spawner's own pid, from a ping: the exit events it sends every
    connection (these tests kill many inits) are not the answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
        connection.settimeout(10)
        connection.connect(str(engine_process.config.spawner_socket_path))
        connection.send(b'{"op": "ping", "request_id": "ping"}')
        while True:
            message = json.loads(connection.recv(1 << 20))
            if message.get("request_id") == "ping":
                return int(message["pid"])


def _zygote_pid(spawner_pid: int, other_than: int = 0) -> int:
    """The spawner's zygote (a new one, if ``other_than`` names the old)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = [
            pid
            for pid, (comm, parent) in processes().items()
            if parent == spawner_pid and comm == "forkyard-zygote" and pid != other_than
        ]
        if found:
            (pid,) = found
            return pid
        time.sleep(0.02)  # a zygote being started takes its name only once it runs
    raise AssertionError(f"the spawner {spawner_pid} has no zygote")


@pytest.mark.parametrize("planted", ["proc", "dev", "sys"])
def test_a_layer_that_plants_a_symlink_over_a_mount_target_fails_cleanly(engine, engine_process, tmp_path, planted):
    template = _tampered_template(engine, engine_process, tmp_path, f"planted-{planted}", _plant(planted, "/"))
    before = snapshot_host(engine_process)
    with pytest.raises(errors.CreateFailed) as raised:
        engine.create(template=template, size="tiny")
    details = raised.value.details
    assert details["target"] == f"/{planted}"
    assert "open mount target" in details["step"]
    # Opened without following it: the symlink itself is not a directory.
    assert details["errno"] in (errno.ENOTDIR, errno.ELOOP)
    assert snapshot_host(engine_process).leaks_since(before) == {}
    engine.call("templates.delete", name=template)


def test_a_mount_target_that_is_a_file_fails_cleanly(engine, engine_process, tmp_path):
    template = _tampered_template(engine, engine_process, tmp_path, "proc-file", _plant("proc", b"not a directory"))
    with pytest.raises(errors.CreateFailed) as raised:
        engine.create(template=template, size="tiny")
    assert (raised.value.details["target"], raised.value.details["errno"]) == ("/proc", errno.ENOTDIR)
    engine.call("templates.delete", name=template)


def test_missing_directories_are_created_with_safe_modes(engine, engine_process, tmp_path):
    def remove(layer: Path) -> None:
        for name in ("tmp", "root", "proc", "sys", "dev"):
            (layer / name).rmdir()

    template = _tampered_template(engine, engine_process, tmp_path, "bare", remove)
    sandbox = engine.create(template=template, size="tiny")["id"]
    try:
        modes = engine.exec(sandbox, "/bin/busybox stat -c '%n %a' /tmp /root").stdout.decode().splitlines()
        assert modes == ["/tmp 1777", "/root 700"]
        assert engine.exec(sandbox, "/bin/busybox cat /proc/1/comm").stdout == b"forkyard-init\n"
    finally:
        engine.destroy(sandbox)
    engine.call("templates.delete", name=template)


def test_init_is_the_spawners_child_with_nothing_inherited(engine, engine_process, sandbox):
    spawner = _spawner_pid(engine_process)
    init = _init_pid(sandbox)
    assert processes()[init][1] == spawner, "the spawner must be the parent that reaps init"
    status = engine.exec(sandbox, ["cat", "/proc/self/status"]).stdout.decode()
    assert "SigIgn:\t0000000000000000" in status, "an ignored signal would pass to every command"
    host_status = Path(f"/proc/{init}/status").read_text()
    assert "SigIgn:\t0000000000000000" in host_status
    assert "SigBlk:\t0000000000010000" in host_status  # SIGCHLD, read through a signalfd
    # Stdio, the control socket, the writable layer and init's own signalfd;
    # the ready pipe is closed, and nothing of the zygote's or spawner's is left.
    # Besides: the connections the engine keeps between commands (execution.InitConnections,
    # at most 4 a sandbox), each a socket; the exec above left one.
    descriptors = {fd: os.readlink(f"/proc/{init}/fd/{fd}") for fd in os.listdir(f"/proc/{init}/fd")}
    kept = {fd: target for fd, target in descriptors.items() if fd not in ("0", "1", "2", "3", "5", "6")}
    assert all(target.startswith("socket:") for target in kept.values()) and 1 <= len(kept) <= 4, descriptors
    assert engine.info()["init_connections"]["idle"] >= len(kept)
    descriptors = {fd: target for fd, target in descriptors.items() if fd not in kept}
    assert sorted(descriptors, key=int) == ["0", "1", "2", "3", "5", "6"], descriptors
    assert descriptors["3"].startswith("socket:") and descriptors["6"] == "anon_inode:[signalfd]"
    assert os.readlink(f"/proc/{init}/exe").startswith("/memfd:forkyard-init")


def test_a_killed_zygote_is_replaced_and_running_sandboxes_carry_on(engine, engine_process, sandbox):
    spawner = _spawner_pid(engine_process)
    zygote = _zygote_pid(spawner)
    os.kill(zygote, signal.SIGKILL)
    _zygote_pid(spawner, other_than=zygote)  # the spawner started another
    assert engine.exec(sandbox, "echo still here").stdout == b"still here\n"
    fresh = engine.create(template="base", size="tiny")["id"]
    try:
        assert engine.exec(fresh, "hostname").stdout.decode().strip() == fresh
    finally:
        engine.destroy(fresh)
    # Exits are still reported: an init killed from outside is noticed.
    os.kill(_init_pid(sandbox), signal.SIGKILL)
    deadline = time.monotonic() + 5
    while engine.get(sandbox)["state"] != "stopped" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.get(sandbox)["state"] == "stopped"


def test_hidden_directories_are_empty_and_read_only(engine, sandbox):
    hidden = [path for path in ("/proc/acpi", "/proc/driver", "/sys/firmware") if os.path.isdir(path)]
    assert any(os.listdir(path) for path in hidden), "the control: nothing to hide on this host"
    for path in hidden:
        result = engine.exec(sandbox, f"ls -A {path}; touch {path}/x 2>&1; mkdir {path}/y 2>&1")
        assert result.stdout.decode().count("Read-only file system") == 2, (path, result)
        assert result.stdout.decode().splitlines()[0].startswith("touch:"), f"{path} is not empty inside"


def test_shared_memory_is_private_writable_and_never_executable(engine, sandbox):
    mounts = engine.exec(sandbox, "grep ' /dev/shm ' /proc/mounts").stdout.decode().split()
    # A directory of the sandbox's disk, bound: no filesystem of its own (its subvolume of the host's shared
    # btrfs, or its scratch tmpfs on a host without one).
    assert mounts[2] == {"btrfs": "btrfs", "memory": "tmpfs"}[engine.info()["disks"]["backend"]], mounts
    options = set(mounts[3].split(","))
    assert {"rw", "nosuid", "nodev", "noexec"} <= options, options
    script = "echo kept > /dev/shm/a && cat /dev/shm/a && cp /bin/busybox /dev/shm/x && /dev/shm/x true; echo $?"
    result = engine.exec(sandbox, script).stdout.decode().split()
    assert result[0] == "kept" and result[-1] == "126", result  # 126: found, not executable
    other = engine.create(template="base", size="tiny", ttl_s=60)["id"]
    try:
        assert engine.exec(other, "ls -A /dev/shm").stdout == b""
    finally:
        engine.destroy(other)


def _spawn_directly(engine_process, count: int, prefix: str) -> socket.socket:
    """Pipeline ``count`` spawn requests straight to the spawner, as an engine
    with that many creates in flight would."""
    config = engine_process.config
    with engine_process.client() as client:
        layers = client.call("templates.get", name="base")["layers"]
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.connect(str(config.spawner_socket_path))
    for index in range(count):
        spec = {
            "sandbox_id": f"{prefix}-{index}",
            "uid_base": config.uid_base,
            "uid_count": config.uid_count,
            "cgroup_procs": [],
            "socket_path": str(config.sandbox_socket_dir / f"{prefix}-{index}.sock"),
            "rootfs": {
                "layers_dir": str(config.layers_dir),
                "lower": [layer_directory_name(layer) for layer in layers],
                "scratch_dir": str(config.mount_dir / "scratch"),
                "root_dir": str(config.mount_dir / "root"),
                "disk_bytes": 1 << 24,
                "dev_dir": str(config.state_dir / "dev"),
                "empty_dir": str(config.mount_dir / "empty"),
            },
        }
        connection.send(json.dumps({"op": "spawn", "request_id": index, "spec": spec}).encode())
    return connection


def _answers(connection: socket.socket, count: int) -> tuple[list[int], list[dict]]:
    connection.settimeout(30)
    pids, failures = [], []
    while len(pids) + len(failures) < count:
        message = json.loads(connection.recv(1 << 20))
        if "event" in message:
            continue
        if message["ok"]:
            pids.append(message["pid"])
        else:
            failures.append(message["error"])
    return pids, failures


def _kill_all(engine_process, pids: list[int], prefix: str) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for path in engine_process.config.sandbox_socket_dir.glob(f"{prefix}-*.sock"):
        path.unlink()


def test_a_burst_larger_than_the_zygotes_socket_waits_its_turn(engine_process):
    spawner = _spawner_pid(engine_process)
    zygote = _zygote_pid(spawner)
    os.kill(zygote, signal.SIGSTOP)  # every request queues: first in the socket, then in the spawner
    try:
        connection = _spawn_directly(engine_process, 200, "burst")
    finally:
        os.kill(zygote, signal.SIGCONT)
    pids, failures = _answers(connection, 200)
    connection.close()
    _kill_all(engine_process, pids, "burst")
    assert failures == [] and len(pids) == 200


def test_requests_queued_when_the_zygote_dies_go_to_the_next_one(engine_process):
    spawner = _spawner_pid(engine_process)
    zygote = _zygote_pid(spawner)
    os.kill(zygote, signal.SIGSTOP)
    connection = _spawn_directly(engine_process, 200, "orphaned")
    time.sleep(0.2)  # let the spawner hand over what fits
    os.kill(zygote, signal.SIGKILL)
    pids, failures = _answers(connection, 200)
    connection.close()
    _kill_all(engine_process, pids, "orphaned")
    # What the dead zygote had taken fails, and says why; the rest was created.
    assert failures and pids, (len(failures), len(pids))
    assert {failure["message"] for failure in failures} == {"the zygote exited"}
