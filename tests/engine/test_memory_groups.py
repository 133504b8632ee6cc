"""Memory groups: sandboxes that share one memory cgroup (an opt-in for scale), each with its own CPU, pids and freezer
(or, asked for, the group's CPU quota).

The group's own probe: a memory hog in a group is stopped at the group's
limit (the kernel's OOM killer, inside the group), and another group's
sandboxes and a sandbox of its own memory cgroup run on, their memory
untouched. What the kernel reports is read from the group's and the
sandboxes' cgroup files.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sandboxes.engine import errors
from sandboxes.engine.cgroups import CgroupsV1, detect
from tests.engine.engines import cgroup_file, separate_engine, wait_for
from tests.support.engine import EngineProcess

pytestmark = pytest.mark.root

MIB = 1024 * 1024


@pytest.fixture
def grouped_engine(work_dir: Path):
    with separate_engine(work_dir / "memory-groups") as engine:
        yield engine


def group_file(engine: EngineProcess, group: str, v1_name: str, v2_name: str) -> Path:
    cgroups = detect(engine.config)
    name = v1_name if isinstance(cgroups, CgroupsV1) else v2_name
    return cgroups.group_directory(f"mg-{group}") / name


def limit_of(engine: EngineProcess, group: str) -> int:
    return int(group_file(engine, group, "memory.limit_in_bytes", "memory.max").read_text())


def peak_of(engine: EngineProcess, group: str) -> int:
    return int(group_file(engine, group, "memory.max_usage_in_bytes", "memory.peak").read_text())


def test_a_hog_is_held_at_its_groups_limit_and_touches_no_other(grouped_engine: EngineProcess, probe_binary: Path):
    with grouped_engine.client() as client:

        def make(group: str | None) -> str:
            extra = {"memory_group": {"id": group, "memory_mib": 192}} if group else {}
            sandbox: str = client.create(template="base", size="tiny", ttl_s=300, **extra)["id"]
            client.write_file(sandbox, "/probe", probe_binary.read_bytes(), mode=0o755)
            return sandbox

        hog, mate, other, alone = make("a"), make("a"), make("b"), make(None)
        assert limit_of(grouped_engine, "a") == 192 * MIB and limit_of(grouped_engine, "b") == 192 * MIB
        # Each member keeps limits of its own below the group: its pids (and CPU).
        for sandbox in (hog, mate):
            assert int(cgroup_file_of(grouped_engine, sandbox, "pids", "pids.max").read_text()) == 256
        assert client.call("stats", id=hog)["memory_group"] == "a" and client.call("stats", id=alone)["memory_group"] is None

        result = client.exec(hog, ["/probe", "memory_hog"], timeout_s=60)
        assert result.oom_killed and result.signal == 9, result
        reached = [int(line.split()[1]) for line in result.stdout.decode().splitlines() if line.startswith("MiB")]
        assert reached and max(reached) < 192, "the hog got past its group's limit"
        assert peak_of(grouped_engine, "a") <= 192 * MIB
        assert peak_of(grouped_engine, "b") < 64 * MIB, "the other group's memory moved"
        for sandbox in (mate, other, alone):
            assert client.exec(sandbox, "echo alive").stdout == b"alive\n"
        assert client.exec(hog, "echo still").stdout == b"still\n", "the OOM killer took the hog, not its init"

        # Pausing one member freezes it alone.
        client.call("pause", id=mate)
        with pytest.raises(errors.SandboxNotRunning):
            client.exec(mate, "true")
        assert client.exec(hog, "echo unfrozen").stdout == b"unfrozen\n"
        client.call("resume", id=mate)

        # The group goes with its last member, and not before.
        directory = detect(grouped_engine.config).group_directory("mg-a")
        client.destroy(hog)
        assert directory.is_dir() and client.exec(mate, "echo kept").stdout == b"kept\n"
        client.destroy(mate)
        assert not directory.exists()
        for sandbox in (other, alone):
            client.destroy(sandbox)


def test_an_engine_restart_keeps_a_group_and_recovery_removes_an_empty_one(grouped_engine: EngineProcess):
    with grouped_engine.client() as client:
        first = client.create(template="base", size="tiny", memory_group={"id": "kept", "memory_mib": 128})["id"]
        second = client.create(template="base", size="tiny", memory_group={"id": "kept", "memory_mib": 128})["id"]
    cgroups = detect(grouped_engine.config)
    cgroups.group_directory("mg-leftover").mkdir()  # an empty group a crash left behind
    grouped_engine.kill()
    grouped_engine.start()
    with grouped_engine.client() as client:
        assert client.info()["recovery"]["adopted"] >= 2
        for sandbox in (first, second):
            assert client.exec(sandbox, "echo adopted").stdout == b"adopted\n"
        assert cgroups.group_directory("mg-kept").is_dir() and not cgroups.group_directory("mg-leftover").exists()
        client.destroy(first)
        client.destroy(second)
    wait_for(lambda: not cgroups.group_directory("mg-kept").exists(), "the emptied group to go")


def test_a_bad_memory_group_is_refused(grouped_engine: EngineProcess):
    with grouped_engine.client() as client:
        for group in (
            {"id": "Bad Name", "memory_mib": 128},
            {"id": "ok", "memory_mib": 1},
            {"id": "ok"},
            {"id": "ok", "memory_mib": 128, "x": 1},
        ):
            with pytest.raises(errors.InvalidRequest):
                client.create(template="base", size="tiny", memory_group=group)


def cgroup_file_of(engine: EngineProcess, sandbox: str, controller: str, name: str) -> Path:
    """A member's own cgroup file (not its group's): its own directory, wherever its group puts it."""
    cgroups = detect(engine.config)
    if isinstance(cgroups, CgroupsV1):
        return cgroup_file(engine, sandbox, controller, name)
    [own] = [entry for entry in cgroups.names() if entry.endswith(f"fy-{sandbox}")]
    return cgroups.directories(own)[0] / name


def cpu_quota_cores(directory: Path, v1: bool) -> float | None:
    """The CPU quota the kernel holds for a cgroup, in cores; None for none."""
    if v1:
        quota, period = (int((directory / name).read_text()) for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
    else:
        text, period_text = (directory / "cpu.max").read_text().split()
        quota, period = (-1 if text == "max" else int(text)), int(period_text)
    return None if quota < 0 else quota / period


def throttled(directory: Path) -> int:
    """How many periods the kernel has throttled the cgroup for (cpu.stat, on either version)."""
    stat = dict(line.split() for line in (directory / "cpu.stat").read_text().splitlines())
    return int(stat["nr_throttled"])


def test_a_group_may_carry_the_cpu_quota_which_its_members_then_share(grouped_engine: EngineProcess):
    """A group with ``cpu``: the quota is the group's and none is its members' (every quota write walks
    every CPU cgroup on the host), and the group is held to it: two spinning members are throttled at
    the group, not each. A group without ``cpu`` keeps a quota each."""
    cgroups = detect(grouped_engine.config)
    v1 = isinstance(cgroups, CgroupsV1)
    with grouped_engine.client() as client:
        group = {"id": "shared", "memory_mib": 256, "cpu": 0.5}
        spinners = [client.create(template="base", size="tiny", ttl_s=300, memory_group=group)["id"] for _ in range(2)]
        each = client.create(template="base", size="tiny", ttl_s=300, memory_group={"id": "each", "memory_mib": 128})["id"]

        def cpu_directory(name: str) -> Path:
            return cgroups.directory("cpu", name) if isinstance(cgroups, CgroupsV1) else cgroups.directories(name)[0]

        group_cpu = cpu_directory("mg-shared/fy-x").parent
        assert cpu_quota_cores(group_cpu, v1) == 0.5
        for sandbox in spinners:
            member = cpu_directory(f"mg-shared/fy-{sandbox}")
            assert member.is_dir() and cpu_quota_cores(member, v1) is None
        each_cpu = cpu_directory(f"mg-each/fy-{each}")
        assert cpu_quota_cores(each_cpu, v1) == 1.0
        assert cpu_quota_cores(each_cpu.parent, v1) is None, "a group without cpu has no quota of its own"

        before = throttled(group_cpu)
        for sandbox in spinners:
            client.exec(sandbox, "timeout 1 sh -c 'while :; do :; done'; true", timeout_s=30)
        assert throttled(group_cpu) > before, "the group's quota held nothing back"
        assert client.call("stats", id=spinners[0])["cpu_s"] > 0, "a member's own CPU time is still counted"
        for sandbox in (*spinners, each):
            client.destroy(sandbox)
    assert not group_cpu.exists(), "the group's CPU cgroup goes with its last member"


def test_a_bad_group_cpu_is_refused(grouped_engine: EngineProcess):
    with grouped_engine.client() as client:
        for cpu in (-1, 0.001, "2", True, 5000):
            with pytest.raises(errors.InvalidRequest):
                client.create(template="base", size="tiny", memory_group={"id": "ok", "memory_mib": 128, "cpu": cpu})
