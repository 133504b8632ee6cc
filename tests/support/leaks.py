"""What a sandbox could leave behind on the host, counted so that tests can compare."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sandboxes.engine.cgroups import detect

if TYPE_CHECKING:
    from tests.support.engine import EngineProcess

NAMESPACE_TYPES = ("mnt", "net", "pid", "user", "uts", "ipc", "cgroup")


def _processes(cgroup_marker: str) -> list[tuple[int, str, int, set[str]]]:
    """(pid, state, parent pid, namespaces) of every process in this engine's
    cgroups (named after its parent), so other engines on the host do not count."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if cgroup_marker not in Path(entry.path, "cgroup").read_text():
                continue
            stat = Path(entry.path, "stat").read_bytes()
            fields = stat[stat.rindex(b")") + 2 :].split()
            namespaces = set()
            for kind in NAMESPACE_TYPES:
                try:
                    namespaces.add(os.readlink(f"{entry.path}/ns/{kind}"))
                except OSError:
                    pass
        except (OSError, ValueError):
            continue
        found.append((int(entry.name), fields[0].decode(), int(fields[1]), namespaces))
    return found


def _zombies_of(parents: set[int]) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        if fields[0] == b"Z" and int(fields[1]) in parents:
            count += 1
    return count


def _fd_counts(pid: int | None) -> tuple[int, int]:
    """(sockets, other fds) a process holds."""
    if not pid:
        return 0, 0
    sockets = others = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:"):
                sockets += 1
            else:
                others += 1
    except OSError:
        pass
    return sockets, others


def _directory_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


@dataclass
class HostSnapshot:
    host_mounts: int
    our_mounts: int
    cgroups: int
    sockets: int
    sandbox_processes: int
    zombies: int
    namespaces: int
    engine_fds: int
    engine_sockets: int
    spawner_fds: int
    spawner_sockets: int
    mount_dir_bytes: int
    layers_bytes: int
    disks: int  # sandbox disks (btrfs subvolumes, disks.py) in the engine's disk pool

    def leaks_since(self, before: HostSnapshot, slack: dict[str, int] | None = None) -> dict[str, tuple[int, int]]:
        """Every count that grew (beyond its slack) since ``before``.

        Socket counts allow one: measuring opens a connection, and the
        server may not have seen it close yet.  A real leak is one per
        sandbox or per exec, which a loop makes obvious.
        """
        slack = {"engine_sockets": 1, "spawner_sockets": 1, **(slack or {})}
        grown = {}
        for name, value in asdict(self).items():
            previous = getattr(before, name)
            if value > previous + slack.get(name, 0):
                grown[name] = (previous, value)
        return grown


def snapshot_host(engine: EngineProcess, settle_s: float = 3.0) -> HostSnapshot:
    """A snapshot taken once the host is still (connections just closed by a
    test are released asynchronously), or the last one after ``settle_s``."""
    import time

    deadline = time.monotonic() + settle_s
    previous = _snapshot(engine)
    while time.monotonic() < deadline:
        time.sleep(0.1)
        current = _snapshot(engine)
        if current == previous:
            return current
        previous = current
    return previous


def _snapshot(engine: EngineProcess) -> HostSnapshot:
    config = engine.config
    mountinfo = Path("/proc/self/mountinfo").read_text().splitlines()
    processes = _processes(config.cgroup_parent)
    engine_pid = engine.engine_pid if engine.running() else None
    spawner_pid = engine.spawner_pid()
    engine_fds = _fd_counts(engine_pid)
    spawner_fds = _fd_counts(spawner_pid)
    parents = {pid for pid in (engine_pid, spawner_pid, engine.reaper.process.pid) if pid}
    try:
        sockets = len(os.listdir(config.sandbox_socket_dir))
    except FileNotFoundError:
        sockets = 0
    return HostSnapshot(
        # Only mounts this engine could make: other engines and test sessions mount and unmount meanwhile.
        host_mounts=sum(
            1
            for line in mountinfo
            if line.split()[4].startswith((str(config.state_dir), str(config.run_dir)))
            or line.split(" - ")[1].split()[1] == "forkyard"
        ),
        our_mounts=sum(1 for line in mountinfo if str(config.state_dir) in line),
        cgroups=len(detect(config).names()),
        sockets=sockets,
        sandbox_processes=len(processes),
        zombies=_zombies_of(parents) + sum(1 for _, state, _, _ in processes if state == "Z"),
        namespaces=len(set().union(*(namespaces for *_, namespaces in processes))) if processes else 0,
        engine_sockets=engine_fds[0],
        engine_fds=engine_fds[1],
        spawner_sockets=spawner_fds[0],
        spawner_fds=spawner_fds[1],
        mount_dir_bytes=_directory_size(config.mount_dir),
        layers_bytes=_directory_size(config.layers_dir),
        disks=_entries(config.disks_dir),
    )


def _entries(directory: Path) -> int:
    try:
        return len(os.listdir(directory))
    except OSError:
        return 0
