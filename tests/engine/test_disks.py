"""The host's sandbox disks (disks.py): a subvolume each, deleted whole, and nothing left of them."""

from __future__ import annotations

import subprocess

import pytest

from sandboxes.engine.config import EngineConfig
from sandboxes.engine.disks import Disks
from sandboxes.engine.kernel import Kernel
from tests.support.engine import EngineProcess

pytestmark = pytest.mark.root


def test_a_disk_holding_a_subvolume_of_its_own_is_still_deleted_whole(engine_process: EngineProcess):
    """A sandbox cannot make a subvolume (its seccomp filter refuses btrfs's ioctls: test_isolation), but a disk
    left by an engine from before that filter may hold one; deleting the disk deletes it first."""
    config: EngineConfig = engine_process.config
    disks = Disks(config, Kernel())
    disks.setup()
    assert disks.backend == "btrfs"
    disks.make("sb-nested-test", 0, 16 << 20)
    inner = config.disks_dir / "sb-nested-test" / "a" / "b"
    inner.mkdir(parents=True)
    subprocess.run(["btrfs", "subvolume", "create", str(inner / "inside")], check=True, capture_output=True)
    assert disks.remove("sb-nested-test")
    assert not (config.disks_dir / "sb-nested-test").exists()
    assert disks.remove("sb-nested-test") is False  # gone: done already


def test_the_engine_says_where_disks_live(engine_process: EngineProcess):
    with engine_process.client() as client:
        disks = client.info()["disks"]
    assert disks["backend"] == "btrfs" and disks["quota"] in ("simple", "qgroup", "on")
    assert 0 < disks["free_bytes"] <= disks["total_bytes"]
