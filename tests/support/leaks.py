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


def _processes() -> list[tuple[int, str, int]]:
    """(pid, state, real uid) of every process on the host."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_bytes()
            state = stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3].decode()
            uid = os.stat(entry.path).st_uid
        except (OSError, ValueError):
            continue
        found.append((int(entry.name), state, uid))
    return found


def _namespaces() -> int:
    seen = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        for kind in NAMESPACE_TYPES:
            try:
                seen.add(os.readlink(f"/proc/{entry.name}/ns/{kind}"))
            except OSError:
                continue
    return len(seen)


def _fd_count(pid: int | None) -> int:
    if not pid:
        return 0
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


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
    spawner_fds: int
    mount_dir_bytes: int
    layers_bytes: int

    def leaks_since(self, before: HostSnapshot, slack: dict[str, int] | None = None) -> dict[str, tuple[int, int]]:
        """Every count that grew (beyond its slack) since ``before``."""
        slack = slack or {}
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
    base, count = config.uid_base, config.uid_count
    processes = _processes()
    try:
        sockets = len(os.listdir(config.sandbox_socket_dir))
    except FileNotFoundError:
        sockets = 0
    return HostSnapshot(
        host_mounts=len(mountinfo),
        our_mounts=sum(1 for line in mountinfo if str(config.state_dir) in line),
        cgroups=len(detect(config).names()),
        sockets=sockets,
        sandbox_processes=sum(1 for _, _, uid in processes if base <= uid < base + count),
        zombies=sum(1 for _, state, _ in processes if state == "Z"),
        namespaces=_namespaces(),
        engine_fds=_fd_count(engine.engine_pid if engine.running() else None),
        spawner_fds=_fd_count(engine.spawner_pid()),
        mount_dir_bytes=_directory_size(config.mount_dir),
        layers_bytes=_directory_size(config.layers_dir),
    )
