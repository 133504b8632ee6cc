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

from sandboxes.engine.cgroups import CgroupsV2, Limits
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
