"""What the engine keeps on the host is root's alone: layers unreachable and inert, the record private.

A layer holds what sandbox code wrote: a setuid binary snapshotted in a
sandbox sits on the host owned by the sandbox's host uid.  Host users must
neither reach it nor gain by running it (SECURITY.md, "Host-side files").
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes.engine import rootfs
from sandboxes.engine.client import EngineClient
from sandboxes.engine.template_store import layer_directory_name
from tests.engine.engines import assert_whole, separate_engine
from tests.support.engine import EngineProcess

pytestmark = pytest.mark.root

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]


def _as_nobody(*command: str) -> subprocess.CompletedProcess[str]:
    # Through a shell: setpriv looks its command up before its capabilities
    # are gone (they go at the exec), the shell as nobody.
    return subprocess.run([*NOBODY, "sh", "-c", 'exec "$@"', "sh", *command], capture_output=True, text=True, timeout=30)


def _mounts_on(path: Path) -> list[set[str]]:
    target = str(path.resolve())
    return [
        set(line.split()[5].split(","))
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split()[4] == target
    ]


@pytest.fixture
def setuid_layer(engine: EngineClient, engine_process: EngineProcess) -> Iterator[Path]:
    """A snapshot of a sandbox that made a setuid copy of busybox: the file on the host."""
    sandbox = engine.create(template="base", size="tiny", ttl_s=300)["id"]
    name = f"setuid-{os.urandom(3).hex()}"
    try:
        made = engine.exec(sandbox, "mkdir -p /suid && cp /bin/busybox /suid/busybox && chmod 6755 /suid/busybox")
        assert made.exit_code == 0, made
        layer = engine.call("snapshots.create", sandbox=sandbox, name=name)["layers"][0]
    finally:
        engine.destroy(sandbox)
    yield engine_process.config.layers_dir / layer_directory_name(layer) / "suid" / "busybox"
    engine.call("templates.delete", name=name)


def test_a_setuid_file_from_a_snapshot_cannot_be_reached_by_host_users(setuid_layer: Path, engine_process: EngineProcess):
    info = setuid_layer.stat()
    # Kept as the sandbox made it (forks see the same file), but out of reach:
    assert info.st_mode & (stat.S_ISUID | stat.S_ISGID) and info.st_uid == engine_process.config.uid_base
    for command in (["stat", str(setuid_layer)], [str(setuid_layer), "id", "-u"], ["ls", str(engine_process.config.state_dir)]):
        reached = _as_nobody(*command)
        assert reached.returncode != 0 and "Permission denied" in reached.stderr, (command, reached)


def test_a_setuid_file_in_a_layer_is_inert_even_when_reached(setuid_layer: Path):
    """Handed an open handle on the file (as if the permissions were wrong), a
    host user runs it without gaining its owner: the layers are mounted nosuid."""
    drop_and_run = (
        "import os, sys; fd = os.open(sys.argv[1], os.O_PATH); os.setgroups([]);"
        " os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534);"
        " os.execv(f'/proc/self/fd/{fd}', ['busybox', 'cat', '/proc/self/status'])"
    )
    ran = subprocess.run([sys.executable, "-c", drop_and_run, str(setuid_layer)], capture_output=True, text=True, timeout=30)
    assert ran.returncode == 0, ran
    status = dict(line.split(":", 1) for line in ran.stdout.splitlines() if ":" in line)
    # Real, effective, saved and filesystem ids: busybox gives up an effective
    # id it gained, but a saved one would let it take it back.
    assert status["Uid"].split() == ["65534"] * 4, f"the setuid bit took effect on the host: {status['Uid']}"
    assert status["Gid"].split() == ["65534"] * 4, f"the setgid bit took effect on the host: {status['Gid']}"


def test_the_state_directory_and_record_are_private_to_root(engine: EngineClient, engine_process: EngineProcess):
    config = engine_process.config
    sandbox = engine.create(template="base", size="tiny", ttl_s=60, env={"SECRET": "in the record"})["id"]
    # The state directory: a new sandbox's init passes through it (holding the
    # layers' group until its root is built); the layers: root's alone (the
    # zygote opens them for every sandbox, as idmapped mounts).
    for directory, owner in ((config.state_dir, (0, config.uid_base, 0o710)), (config.layers_dir, (0, 0, 0o700))):
        info = directory.stat()
        assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == owner, directory
    records = list(config.state_dir.glob("engine.sqlite3*"))
    assert config.database_path in records
    for record in records:
        assert stat.S_IMODE(record.stat().st_mode) == 0o600, record
    assert _as_nobody("cat", str(config.database_path)).returncode != 0
    mounted = _mounts_on(config.layers_dir)
    assert mounted and {"nosuid", "nodev"} <= mounted[-1], mounted
    engine.destroy(sandbox)


def test_the_layers_mount_is_made_once_kept_by_recovery_and_repaired_at_start(work_dir: Path):
    with separate_engine(work_dir / f"layers-{os.urandom(3).hex()}") as engine:
        layers = engine.config.layers_dir
        assert [{"nosuid", "nodev"} <= options for options in _mounts_on(layers)] == [True]
        with engine.client() as client:
            sandbox = client.create(template="base", size="tiny", ttl_s=600)["id"]
        engine.kill()
        engine.start()
        assert [{"nosuid", "nodev"} <= options for options in _mounts_on(layers)] == [True], "not stacked again"
        # An operator's remount drops the flags; the next start puts them back.
        subprocess.run(["mount", "-o", "remount,bind,suid,dev", str(layers)], check=True)
        assert not {"nosuid", "nodev"} & _mounts_on(layers)[0]
        engine.stop()
        engine.start()
        assert [{"nosuid", "nodev"} <= options for options in _mounts_on(layers)] == [True]
        with engine.client() as client:
            assert client.info()["recovery"]["adopted_ids"] == [sandbox]
            assert_whole(client, sandbox)
            fork_source = client.create(template="base", size="tiny", ttl_s=600)["id"]
            client.exec(fork_source, "echo kept > /kept")
            client.call("snapshots.create", sandbox=fork_source, name="after-restart")
            fork = client.create(template="after-restart", size="tiny", ttl_s=600)["id"]
            assert client.exec(fork, "cat /kept").stdout == b"kept\n"
    # The offline reclaim (what the tests clean up with) detaches it.
    assert _mounts_on(layers) == []


def test_preparing_dev_again_changes_nothing_a_sandbox_binds(tmp_path: Path):
    """Every live sandbox's /dev is a bind of this directory, with mounts on
    its subdirectories: a restart must leave both alone, and mend a wrong
    entry in place (a restart once renamed the directory away and emptied it)."""
    directory = tmp_path / "dev"
    assert rootfs.prepare_dev(str(directory)) > 0
    inodes = {name: os.lstat(directory / name).st_ino for name in (".", "null", "urandom")}
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "as-in-a-sandbox", str(directory / "pts")], check=True)
    try:
        assert rootfs.prepare_dev(str(directory)) == 0
        (directory / "null").unlink()
        (directory / "null").write_text("not a device")
        os.chmod(directory / "zero", 0o600)
        assert rootfs.prepare_dev(str(directory)) == 2
        assert (
            stat.S_ISCHR((directory / "null").lstat().st_mode)
            and (directory / "null").lstat().st_rdev == os.stat("/dev/null").st_rdev
        )
        assert stat.S_IMODE((directory / "zero").lstat().st_mode) == 0o666
        assert {name: os.lstat(directory / name).st_ino for name in (".", "urandom")} == {
            name: inodes[name] for name in (".", "urandom")
        }, "an entry that was right was made again"
        assert _mounts_on(directory / "pts"), "the mount on pts was disturbed"
        assert sorted(os.listdir(directory)) == sorted([*rootfs.DEVICES, *rootfs.DEVICE_LINKS, *rootfs.DEVICE_DIRECTORIES])
    finally:
        subprocess.run(["umount", str(directory / "pts")], check=False)
