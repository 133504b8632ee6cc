"""Engines of a test's own, apart from the shared one in tests/conftest.py."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from sandboxes.engine.cgroups import CgroupsV1, detect
from sandboxes.engine.client import EngineClient
from tests.support.engine import EngineProcess
from tests.support.leaks import HostSnapshot
from tests.support.leaks import snapshot_host as snapshot_whole_host

T = TypeVar("T")


@contextmanager
def separate_engine(directory: Path, warm_pools: str = "", env: dict[str, str] | None = None) -> Iterator[EngineProcess]:
    """An engine with the base template, apart from the shared one (a test that
    crashes it, or whose failed creates must not count elsewhere); every trace
    of it is reclaimed after.  ``warm_pools`` as FORKYARD_ENGINE_WARM_POOLS
    ("base:tiny=1"), filled once the base template exists; ``env``: other
    FORKYARD_ENGINE_* settings of its own."""
    engine = EngineProcess(directory, warm_pools=warm_pools, env=env)
    engine.start()
    with engine.client() as client:
        client.call("templates.build_base", name="base", replace=True)
        for item in filter(None, warm_pools.split(",")):
            key, _, count = item.partition("=")
            template, _, size = key.partition(":")
            client.call("pools.set", template=template, size=size, count=int(count))
    try:
        yield engine
    finally:
        engine.reclaim()
        engine.remove_files()


def processes() -> dict[int, tuple[str, int]]:
    """pid -> (command name, parent pid) of every process on the host."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_bytes()
        except OSError:
            continue  # it exited meanwhile
        # The name may hold spaces and parentheses: split around the last ')'.
        name = stat[stat.index(b"(") + 1 : stat.rindex(b")")].decode(errors="replace")
        found[int(entry.name)] = (name, int(stat[stat.rindex(b")") + 2 :].split()[1]))
    return found


def assert_whole(client: EngineClient, sandbox: str, service: str = "") -> None:
    """The sandbox is fully usable: exec, its /dev (null, urandom, shm, a new
    pty under /dev/pts, mqueue), the file API, and the given service's page
    (``wget``'s URL) if one is named.  What an adopted sandbox must pass."""

    def run(command: str) -> bytes:
        result = client.exec(sandbox, command, timeout_s=30)
        assert result.exit_code == 0, (sandbox, command, result)
        return result.stdout

    assert run("echo alive") == b"alive\n"
    run("echo discarded > /dev/null")
    assert run("head -c 8 /dev/urandom | wc -c").strip() == b"8"
    assert run("head -c 4 /dev/zero | od -An -tx1").split() == [b"00"] * 4
    assert run("echo shared > /dev/shm/whole && cat /dev/shm/whole && rm /dev/shm/whole") == b"shared\n"
    # Opening the multiplexer makes a new terminal under /dev/pts.
    terminals = [name for name in run("exec 3<>/dev/ptmx; ls /dev/pts").split() if name != b"ptmx"]
    assert terminals and all(name.isdigit() for name in terminals), terminals
    mounts = {line.split()[4]: line.split(" - ")[1].split()[0] for line in run("cat /proc/self/mountinfo").decode().splitlines()}
    assert (mounts.get("/dev/pts"), mounts.get("/dev/mqueue")) == ("devpts", "mqueue"), mounts
    marker = os.urandom(8).hex().encode()
    client.write_file(sandbox, "/tmp/whole-check", marker)
    assert client.read_file(sandbox, "/tmp/whole-check") == marker
    assert run("cat /tmp/whole-check") == marker
    if service:
        assert run(f"wget -qO- {service}"), f"{service} did not answer in {sandbox}"


def snapshot_host(engine: EngineProcess) -> HostSnapshot:
    """``tests.support.leaks.snapshot_host``, with ``host_mounts`` counting only
    mounts this engine could have made: under its state or run directory, or
    a sandbox's scratch tmpfs (source "forkyard") wherever it leaked to.

    Other suites on this machine mount and unmount meanwhile (each engine's
    own nosuid,nodev layers mount, container runtimes' overlays), which a
    count of every host mount takes for a leak of ours, or hides one."""
    snapshot = snapshot_whole_host(engine)
    ours = (str(engine.config.state_dir), str(engine.config.run_dir))
    counted = 0
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mount_point, source = line.split()[4], line.split(" - ")[1].split()[1]
        if mount_point.startswith(ours) or source == "forkyard":
            counted += 1
    return dataclasses.replace(snapshot, host_mounts=counted)


def cgroup_file(engine: EngineProcess, sandbox: str, controller: str, name: str) -> Path:
    """A file of the sandbox's cgroup, as the kernel reports it: ``controller``'s
    hierarchy on cgroup v1, the one hierarchy on v2."""
    cgroups = detect(engine.config)
    if isinstance(cgroups, CgroupsV1):
        return cgroups.parents[controller] / f"fy-{sandbox}" / name
    return cgroups.directories(f"fy-{sandbox}")[0] / name


def memory_charged(engine: EngineProcess, sandbox: str) -> int:
    """Bytes the kernel charges to the sandbox's memory cgroup: memory.usage_in_bytes
    on cgroup v1, memory.current on v2."""
    cgroups = detect(engine.config)
    name = "memory.usage_in_bytes" if isinstance(cgroups, CgroupsV1) else "memory.current"
    return int(cgroup_file(engine, sandbox, "memory", name).read_text())


def frozen(engine: EngineProcess, sandbox: str) -> bool:
    """The kernel's word on whether the sandbox's cgroup is frozen."""
    cgroups = detect(engine.config)
    if isinstance(cgroups, CgroupsV1):
        return cgroup_file(engine, sandbox, "freezer", "freezer.state").read_text().strip() == "FROZEN"
    return "frozen 1" in cgroup_file(engine, sandbox, "", "cgroup.events").read_text()


def sandbox_processes(sandbox: str) -> dict[int, str]:
    """pid -> command line of every process in the sandbox's cgroup, read from the host's /proc."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if f"fy-{sandbox}" not in Path(entry.path, "cgroup").read_text():
                continue
            found[int(entry.name)] = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
    return found


def init_pid(sandbox: str) -> int:
    """The host pid of the sandbox's init: the one process of its cgroup whose parent is not in it."""
    found = sandbox_processes(sandbox)
    inits = []
    for pid in found:
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            continue
        if int(stat[stat.rindex(b")") + 2 :].split()[1]) not in found:
            inits.append(pid)
    assert len(inits) == 1, f"sandbox {sandbox}: not one init among {found}"
    return inits[0]


def root_uid(sandbox: str) -> int:
    """The host uid of root in the sandbox, as the kernel reports its init's (the Uid: line)."""
    status = Path(f"/proc/{init_pid(sandbox)}/status").read_text()
    uids = {int(uid) for uid in status.split("Uid:", 1)[1].splitlines()[0].split()}
    assert len(uids) == 1, status
    return uids.pop()


def cpu_ticks(pid: int) -> int:
    """User plus system CPU time a process has used, in clock ticks (/proc/<pid>/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


def wait_for(condition: Callable[[], T], what: str, timeout_s: float = 30.0) -> T:
    """Poll until ``condition()`` is truthy; the timeout is only the failure signal, never a speed check."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
