"""Cgroup v1 and v2 drivers on fake trees: the files they write, without root."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandboxes.engine import cgroups, kernel
from sandboxes.engine.cgroups import Remount, favor_moves_plan
from sandboxes.engine.config import EngineConfig


def _proc(tmp_path: Path, lines: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(lines)
    return proc


def test_v1_limits_under_the_engines_own_nested_memory_cgroup(tmp_path: Path):
    root = tmp_path / "cgroup"
    for controller in cgroups.CgroupsV1.CONTROLLERS:
        (root / controller).mkdir(parents=True)
        (root / controller / "cgroup.procs").write_text("")
    proc = _proc(tmp_path, "4:memory:/host/job-1\n3:pids:/\n2:freezer:/\n1:cpu:/\n5:cpuacct:/\n0::/\n")
    driver = cgroups.detect(EngineConfig(cgroup_root=root, proc_dir=proc))
    assert isinstance(driver, cgroups.CgroupsV1)
    driver.setup()
    assert driver.parents["memory"] == root / "memory" / "host" / "job-1" / "forkyard"
    assert driver.parents["pids"] == root / "pids" / "forkyard"
    procs = driver.create("fy-a", cgroups.Limits(cpu=1.5, memory_bytes=128 << 20, pids=256))
    assert str(root / "memory/host/job-1/forkyard/fy-a/cgroup.procs") in procs
    assert (root / "memory/host/job-1/forkyard/fy-a/memory.limit_in_bytes").read_text() == str(128 << 20)
    assert (root / "cpu/forkyard/fy-a/cpu.cfs_quota_us").read_text() == "150000"
    assert (root / "pids/forkyard/fy-a/pids.max").read_text() == "256"
    assert driver.names() == ["fy-a"]


def test_v1_a_group_with_cpu_holds_the_quota_and_its_members_sit_below_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    root = tmp_path / "cgroup"
    for controller in cgroups.CgroupsV1.CONTROLLERS:
        (root / controller).mkdir(parents=True)
        (root / controller / "cgroup.procs").write_text("")
    driver = cgroups.CgroupsV1(EngineConfig(cgroup_root=root, proc_dir=_proc(tmp_path, "0::/\n")))
    driver.setup()
    limits = cgroups.Limits(cpu=1.0, memory_bytes=128 << 20, pids=256)
    procs = driver.create("mg-g/fy-a", limits, group_memory_bytes=256 << 20, group_cpu=2.0)
    parent = {controller: root / controller / "forkyard" for controller in cgroups.CgroupsV1.CONTROLLERS}
    assert (parent["cpu"] / "mg-g" / "cpu.cfs_quota_us").read_text() == "200000"
    assert not (parent["cpu"] / "mg-g" / "fy-a" / "cpu.cfs_quota_us").exists(), "a member writes no quota"
    assert str(parent["cpu"] / "mg-g" / "fy-a" / "cgroup.procs") in procs
    assert str(parent["cpuacct"] / "mg-g" / "fy-a" / "cgroup.procs") in procs
    assert str(parent["memory"] / "mg-g" / "cgroup.procs") in procs
    assert (parent["pids"] / "fy-a" / "pids.max").read_text() == "256"
    # The group's next member writes no CPU file: each quota or period write walks every CPU cgroup.
    (parent["cpu"] / "mg-g" / "cpu.cfs_period_us").write_text("100000")
    written: list[str] = []
    write = cgroups._write
    monkeypatch.setattr(cgroups, "_write", lambda path, value: (written.append(str(path)), write(path, value)))
    driver.create("mg-g/fy-a2", limits, group_memory_bytes=256 << 20, group_cpu=2.0)
    assert written and not [path for path in written if "/cpu/" in path], written
    monkeypatch.undo()
    for directory in driver.own_directories("mg-g/fy-a2"):
        for leftover in directory.iterdir():
            leftover.unlink()
    driver.remove("mg-g/fy-a2")
    # Without cpu the group has no quota and its member one of its own, below it all the same.
    driver.create("mg-h/fy-b", limits, group_memory_bytes=128 << 20)
    assert not (parent["cpu"] / "mg-h" / "cpu.cfs_quota_us").exists()
    assert (parent["cpu"] / "mg-h" / "fy-b" / "cpu.cfs_quota_us").read_text() == "100000"
    assert driver.groups() == ["mg-g", "mg-h"] and driver.names() == ["fy-a", "fy-b"]
    for name in ("mg-g/fy-a", "mg-h/fy-b"):
        for directory in driver.own_directories(name):
            for leftover in directory.iterdir():
                leftover.unlink()  # a fake tree's files; the kernel's go with the directory
        assert driver.remove(name)
        group = name.partition("/")[0]
        for directory in driver.group_directories(group):
            for leftover in directory.iterdir():
                if leftover.is_file():
                    leftover.unlink()
        assert driver.remove_empty_group(group)
        assert not any(directory.exists() for directory in driver.group_directories(group))
    assert driver.groups() == []


def test_v2_engine_moves_into_a_leaf_and_enables_controllers(tmp_path: Path):
    root = tmp_path / "cgroup"
    service = root / "system.slice" / "forkyard.service"
    service.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory pids io\n")
    (service / "cgroup.controllers").write_text("cpu memory pids\n")
    (service / "cgroup.subtree_control").write_text("")
    (service / "cgroup.procs").write_text("4242\n")
    proc = _proc(tmp_path, "0::/system.slice/forkyard.service\n")
    driver = cgroups.detect(EngineConfig(cgroup_root=root, proc_dir=proc))
    assert isinstance(driver, cgroups.CgroupsV2)
    (service / "forkyard").mkdir()
    (service / "forkyard" / "cgroup.subtree_control").write_text("")
    driver.setup()
    assert (service / "engine" / "cgroup.procs").read_text() == "4242"
    assert (service / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    driver.create("fy-b", cgroups.Limits(cpu=0.5, memory_bytes=1 << 30, pids=100))
    sandbox = service / "forkyard" / "fy-b"
    assert (sandbox / "cpu.max").read_text() == "50000 100000"
    assert (sandbox / "memory.max").read_text() == str(1 << 30)
    assert (sandbox / "pids.max").read_text() == "100"
    # A memory group with cpu: the quota is the group's, its member writes none.
    (service / "forkyard" / "mg-g").mkdir()
    (service / "forkyard" / "mg-g" / "cgroup.subtree_control").write_text("")
    driver.create("mg-g/fy-c", cgroups.Limits(cpu=1, memory_bytes=1 << 30, pids=100), group_memory_bytes=2 << 30, group_cpu=2)
    assert (service / "forkyard" / "mg-g" / "cpu.max").read_text() == "200000 100000"
    assert (service / "forkyard" / "mg-g" / "memory.max").read_text() == str(2 << 30)
    assert not (service / "forkyard" / "mg-g" / "fy-c" / "cpu.max").exists()
    assert (service / "forkyard" / "mg-g" / "fy-c" / "pids.max").read_text() == "100"


def test_v2_refuses_to_run_without_its_controllers(tmp_path: Path):
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("io\n")
    (root / "cgroup.subtree_control").write_text("")
    proc = _proc(tmp_path, "0::/\n")
    driver = cgroups.detect(EngineConfig(cgroup_root=root, proc_dir=proc))
    (root / "forkyard").mkdir()
    (root / "forkyard" / "cgroup.subtree_control").write_text("")
    with pytest.raises(cgroups.CgroupError) as raised:
        driver.setup()
    assert raised.value.details["missing"] == ["cpu", "memory", "pids"]


def test_absolute_parent_is_taken_as_is(tmp_path: Path):
    root = tmp_path / "cgroup"
    for controller in cgroups.CgroupsV1.CONTROLLERS:
        (root / controller).mkdir(parents=True)
        (root / controller / "cgroup.procs").write_text("")
    proc = _proc(tmp_path, "4:memory:/deep/inside\n")
    driver = cgroups.CgroupsV1(EngineConfig(cgroup_root=root, proc_dir=proc, cgroup_parent="/sandboxes"))
    assert driver.parents["memory"] == root / "memory" / "sandboxes"


def test_stats_read_each_versions_own_files(tmp_path: Path):
    """memory now and at its peak, CPU time, OOM kills and processes, from v2's files and from v1's."""
    v2 = tmp_path / "v2"
    (v2 / "cgroup.controllers").parent.mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("cpu memory pids\n")
    sandbox = v2 / "forkyard" / "fy-s"
    sandbox.mkdir(parents=True)
    for name, text in {
        "memory.current": "1048576\n",
        "memory.peak": "3145728\n",
        "cpu.stat": "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n",
        "memory.events": "low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n",
        "cgroup.procs": "10\n11\n",
    }.items():
        (sandbox / name).write_text(text)
    (sandbox / "x-cmd").mkdir()
    (sandbox / "x-cmd" / "cgroup.procs").write_text("12\n")
    driver2 = cgroups.CgroupsV2(
        EngineConfig(cgroup_root=v2, proc_dir=_proc(tmp_path / "p2", "0::/\n")), require_controllers=False
    )
    assert driver2.stats("fy-s") == cgroups.Stats(
        memory_bytes=1 << 20, cpu_usage_us=2_500_000, oom_kills=2, pids=3, memory_peak_bytes=3 << 20
    )
    v1 = tmp_path / "v1"
    for controller in cgroups.CgroupsV1.CONTROLLERS:
        (v1 / controller / "forkyard" / "fy-s").mkdir(parents=True)
        (v1 / controller / "cgroup.procs").write_text("")
    memory = v1 / "memory" / "forkyard" / "fy-s"
    (memory / "memory.usage_in_bytes").write_text("2097152\n")
    (memory / "memory.max_usage_in_bytes").write_text("4194304\n")
    (memory / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    (v1 / "cpuacct" / "forkyard" / "fy-s" / "cpuacct.usage").write_text("7000000000\n")
    (v1 / "pids" / "forkyard" / "fy-s" / "cgroup.procs").write_text("20\n")
    proc = _proc(tmp_path / "p1", "4:memory:/\n3:pids:/\n2:freezer:/\n1:cpu:/\n5:cpuacct:/\n0::/\n")
    driver1 = cgroups.CgroupsV1(EngineConfig(cgroup_root=v1, proc_dir=proc))
    assert driver1.stats("fy-s") == cgroups.Stats(
        memory_bytes=2 << 20, cpu_usage_us=7_000_000, oom_kills=1, pids=1, memory_peak_bytes=4 << 20
    )


SYSTEMD_V2 = (
    "24 30 0:22 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n"
)
HYBRID = (
    "30 25 0:26 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "35 25 0:31 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
)


def test_favor_moves_remounts_with_every_option_the_mount_had():
    plan = favor_moves_plan(SYSTEMD_V2)
    assert plan == Remount(
        target="/sys/fs/cgroup",
        flags=kernel.MS_REMOUNT | kernel.MS_NOSUID | kernel.MS_NODEV | kernel.MS_NOEXEC | kernel.MS_RELATIME,
        data="nsdelegate,memory_recursiveprot,favordynmods",
    )
    hybrid = favor_moves_plan(HYBRID)
    assert hybrid == Remount(target="/sys/fs/cgroup/unified", flags=kernel.MS_REMOUNT | kernel.MS_RELATIME, data="favordynmods")


def test_favor_moves_leaves_a_hierarchy_that_has_it_and_a_host_without_cgroup2():
    assert favor_moves_plan(SYSTEMD_V2.replace("memory_recursiveprot", "memory_recursiveprot,favordynmods")) == "already"
    assert favor_moves_plan(HYBRID.splitlines()[0]) == "no cgroup2 mount"
    assert favor_moves_plan("garbage\n\n1 2 3 - cgroup2\n") == "no cgroup2 mount"
    spaced = favor_moves_plan(HYBRID.replace("/sys/fs/cgroup/unified", "/srv/my\\040cgroups"))
    assert not isinstance(spaced, str) and spaced.target == "/srv/my cgroups"
