"""The cgroup v2 driver against the real kernel.

On a pure v2 host this runs on /sys/fs/cgroup with its controllers. On this
project's hybrid development machines the v2 hierarchy is mounted at
/sys/fs/cgroup/unified with no controllers (v1 holds them all), so limits
cannot be shown there, but everything v2 does without controllers can:
membership, freezing, cgroup.kill, removal.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from sandboxes.engine import kernel
from sandboxes.engine.cgroups import FAVOR_MOVES, CgroupsV2, Limits, favor_moves, favor_moves_plan
from sandboxes.engine.config import EngineConfig

pytestmark = pytest.mark.root


def _v2_root() -> Path:
    for candidate in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if (candidate / "cgroup.controllers").exists():
            return candidate
    pytest.fail("no cgroup v2 hierarchy mounted on this host")


def test_v2_membership_freeze_kill_and_removal():
    root = _v2_root()
    full = root == Path("/sys/fs/cgroup")
    driver = CgroupsV2(
        EngineConfig(cgroup_root=root, cgroup_parent=f"forkyard-v2-{uuid.uuid4().hex[:6]}"), require_controllers=full
    )
    driver.setup()
    name = "fy-v2test"
    procs = driver.create(name, Limits(cpu=0.5, memory_bytes=64 << 20, pids=32))
    worker = subprocess.Popen(["sh", "-c", "while :; do :; done"])
    try:
        Path(procs[0]).write_text(str(worker.pid))
        assert driver.pids(name) == [worker.pid]
        if full:
            assert (driver.parent / name / "memory.max").read_text().strip() == str(64 << 20)
        driver.freeze(name, True)
        assert "frozen 1" in (driver.parent / name / "cgroup.events").read_text()
        ticks = int(Path(f"/proc/{worker.pid}/stat").read_text().split()[13])
        time.sleep(0.3)
        assert int(Path(f"/proc/{worker.pid}/stat").read_text().split()[13]) == ticks, "a frozen task kept running"
        driver.freeze(name, False)
        assert "frozen 0" in (driver.parent / name / "cgroup.events").read_text()
        assert driver.kill_all(name) == 1
        worker.wait(5)
        driver.remove(name)
        assert not (driver.parent / name).exists()
        assert driver.names() == []
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        if (driver.parent / name).exists():
            os.rmdir(driver.parent / name)
        os.rmdir(driver.parent)


def test_v2_exec_cgroups_hold_what_a_command_started_and_die_with_it():
    """A cgroup per exec (cgroups.py): what joins it is counted with the
    sandbox's, killed with ``kill_exec``, and removed with the sandbox."""
    root = _v2_root()
    driver = CgroupsV2(
        EngineConfig(cgroup_root=root, cgroup_parent=f"forkyard-v2-{uuid.uuid4().hex[:6]}"),
        require_controllers=root == Path("/sys/fs/cgroup"),
    )
    driver.setup()
    name = "fy-v2exec"
    driver.create(name, Limits(cpu=0.5, memory_bytes=64 << 20, pids=32))
    procs = driver.create_exec(name, "x-test")
    assert driver.exec_empty(name, "x-test")
    workers = [subprocess.Popen(["sleep", "600"]) for _ in range(2)]
    try:
        for worker in workers:
            Path(procs).write_text(str(worker.pid))
        assert not driver.exec_empty(name, "x-test"), "a kept exec cgroup that holds a process is not reused"
        assert driver.pids(name) == sorted(worker.pid for worker in workers), "counted as the sandbox's"
        assert sorted(driver.exec_pids(name, "x-test")) == sorted(worker.pid for worker in workers), "a process finds its own"
        assert not driver.remove_exec(name, "x-test"), "removed while it holds processes"
        assert driver.kill_exec(name, "x-test") == 2
        for worker in workers:
            worker.wait(10)
        assert driver.exec_empty(name, "x-test")
        assert driver.remove_exec(name, "x-test")
        assert not driver.exec_empty(name, "x-test"), "one that is gone is not reused either"
        driver.create_exec(name, "x-left")
        driver.remove(name)  # an exec cgroup left behind goes with its sandbox
        assert not (driver.parent / name).exists()
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        for leftover in (driver.parent / name / "x-test", driver.parent / name / "x-left", driver.parent / name):
            if leftover.exists():
                os.rmdir(leftover)
        os.rmdir(driver.parent)


def test_v2_a_memory_group_holds_its_members_each_in_a_cgroup_of_its_own():
    root = _v2_root()
    full = root == Path("/sys/fs/cgroup")
    driver = CgroupsV2(
        EngineConfig(cgroup_root=root, cgroup_parent=f"forkyard-v2-{uuid.uuid4().hex[:6]}"), require_controllers=full
    )
    driver.setup()
    names = ["mg-g1/fy-v2a", "mg-g1/fy-v2b"]
    workers = []
    try:
        for name in names:
            [procs] = driver.create(name, Limits(cpu=0.5, memory_bytes=64 << 20, pids=32), group_memory_bytes=128 << 20)
            workers.append(subprocess.Popen(["sleep", "60"]))
            Path(procs).write_text(str(workers[-1].pid))
        assert driver.names() == names and driver.groups() == ["mg-g1"]
        assert driver.pids(names[0]) == [workers[0].pid], "a member's processes are its own, not its group's"
        if full:
            group = driver.group_directory("mg-g1")
            assert (group / "memory.max").read_text().strip() == str(128 << 20)
            assert "memory" not in (group / "cgroup.subtree_control").read_text().split(), "members share the group's"
            assert (driver.parent / names[0] / "pids.max").read_text().strip() == "32"
        driver.freeze(names[0], True)
        assert "frozen 1" in (driver.parent / names[0] / "cgroup.events").read_text()
        assert "frozen 0" in (driver.parent / names[1] / "cgroup.events").read_text(), "the freeze reached a group mate"
        driver.freeze(names[0], False)
        driver.remove(names[0])
        assert not driver.remove_empty_group("mg-g1"), "removed while a member was left"
        driver.remove(names[1])
        assert driver.remove_empty_group("mg-g1") and driver.groups() == []
    finally:
        for worker in workers:
            worker.kill()
        for name in names:
            driver.remove(name)
        driver.remove_empty_group("mg-g1")
        os.rmdir(driver.parent)


def _cgroup2_mount() -> tuple[str, set[str], set[str]]:
    """The first cgroup2 mount: (where, its own options, the hierarchy's options), as mountinfo has them."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mount, _, filesystem = line.partition(" - ")
        if filesystem.startswith("cgroup2 "):
            return mount.split()[4], set(mount.split()[5].split(",")), set(filesystem.split()[2].split(","))
    pytest.fail("no cgroup v2 hierarchy mounted on this host")


def test_favor_moves_sets_the_option_and_keeps_every_other_one():
    target, own, hierarchy = _cgroup2_mount()
    if FAVOR_MOVES in hierarchy:  # set by an engine before: taken off first, the way favor_moves puts it on
        plan = favor_moves_plan(Path("/proc/self/mountinfo").read_text().replace(f",{FAVOR_MOVES}", ""))
        assert not isinstance(plan, str)
        kept = ",".join(option for option in plan.data.split(",") if option != FAVOR_MOVES)
        kernel.Kernel().mount("none", plan.target, None, plan.flags, kept)
        assert FAVOR_MOVES not in _cgroup2_mount()[2]
    before = _cgroup2_mount()
    assert favor_moves(kernel.Kernel(), Path("/proc")) == "set"
    after = _cgroup2_mount()
    assert after[0] == target and after[1] == before[1] == own, "the mount's own options (nosuid...) stay"
    assert after[2] == before[2] | {FAVOR_MOVES}, "the hierarchy's other options stay"
    assert favor_moves(kernel.Kernel(), Path("/proc")) == "already"
