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


def _writes(config: EngineConfig) -> int:
    """Write requests the disk pool's loop device completed (its stat's 5th field)."""
    source = subprocess.run(["findmnt", "-n", "-o", "SOURCE", str(config.disks_dir)], capture_output=True, text=True).stdout
    device = source.strip().removeprefix("/dev/")
    assert device.startswith("loop"), f"the disk pool is the engine's own image on a loop device, not {source!r}"
    fields = open(f"/sys/block/{device}/stat").read().split()
    return int(fields[4])


def test_a_sandbox_asking_for_its_writes_to_be_flushed_flushes_nothing(engine_process: EngineProcess):
    """fsync, fdatasync, syncfs and sync answer 0 without running (seccomp.SKIPPED_SYSCALLS): the writes the
    loop device under the disk pool completed say whether any reached it (each fsync run is a few: the
    file's data and btrfs's log tree, written through at once; unflushed, they stay in the page cache)."""
    with engine_process.client() as client:
        sandbox = client.create(template="base", size="tiny", ttl_s=120)["id"]
        try:
            script = (
                "i=0; while [ $i -lt 60 ]; do dd if=/dev/zero of=/f$i bs=4k count=1 conv=fsync 2>/dev/null"
                " || exit 1; i=$((i+1)); done; sync && echo synced"
            )
            before = _writes(engine_process.config)
            ran = client.exec(sandbox, script, timeout_s=120)
            after = _writes(engine_process.config)
            assert ran.exit_code == 0 and ran.stdout == b"synced\n", ran
            assert client.exec(sandbox, "ls / | grep -c '^f[0-9]'").stdout == b"60\n", "the files are written all the same"
        finally:
            client.destroy(sandbox)
    # Run, the 60 fsyncs and the sync were about 250 writes here; a background commit may add a few.
    assert after - before < 30, (before, after)
