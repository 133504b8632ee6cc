"""Each sandbox has a host uid range of its own, and per-user kernel limits with it.

The kernel counts some objects per host uid and some per owner of a user
namespace.  When every sandbox's root was the same host uid, in a user
namespace owned by host root, one sandbox holding its 128 inotify instances
(or its message queue bytes) left none to any other sandbox, nor to host
root.  These tests read what the kernel reports (``/proc/<init>/status``,
``uid_map``, the owner of the user namespace, file owners, the errno a probe
gets), never a timing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes.engine import errors
from sandboxes.engine.cgroups import CgroupsV1, detect
from sandboxes.engine.client import EngineClient
from sandboxes.engine.template_store import layer_directory_name
from tests.engine.engines import init_pid, root_uid, separate_engine, wait_for
from tests.support.engine import EngineProcess

pytestmark = pytest.mark.root

NS_GET_OWNER_UID = 0xB704  # ioctl on a user namespace fd (linux/nsfs.h)


@pytest.fixture
def two_probed(engine: EngineClient, probe_binary: Path) -> Iterator[tuple[str, str]]:
    """Two sandboxes, as two teams would have them, each with the probe."""
    made = [engine.create(template="base", size="tiny", ttl_s=300)["id"] for _ in range(2)]
    try:
        for sandbox in made:
            engine.write_file(sandbox, "/probe", probe_binary.read_bytes(), mode=0o755)
        yield made[0], made[1]
    finally:
        for sandbox in made:
            engine.destroy(sandbox)


def _owner_of_user_namespace(pid: int) -> int:
    fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY)
    try:
        buffer = bytearray(4)
        fcntl.ioctl(fd, NS_GET_OWNER_UID, buffer)
        return int(struct.unpack("=I", buffer)[0])
    finally:
        os.close(fd)


def _result(output: bytes) -> str:
    lines = [line for line in output.decode().splitlines() if line.startswith("RESULT ")]
    assert lines, f"the probe printed no result: {output!r}"
    return lines[-1].split(" ", 1)[1]


def _on_host(probe_binary: Path, *args: str) -> str:
    completed = subprocess.run([str(probe_binary), *args], capture_output=True, timeout=20, stdin=subprocess.DEVNULL)
    return _result(completed.stdout)


def _hold(engine: EngineClient, sandbox: str, what: str) -> tuple[int, str]:
    """Start the probe holding every ``what`` the kernel lets the sandbox have;
    how many it got, and the errno that stopped it."""
    engine.exec(sandbox, f"setsid /probe hold_{what} > /tmp/{what}.out 2>&1 < /dev/null &")

    def finished() -> bytes:
        try:
            output = engine.read_file(sandbox, f"/tmp/{what}.out")
        except errors.FileNotFound:
            return b""  # the background shell has not made it yet
        return output if b"RESULT" in output else b""

    output = wait_for(finished, f"the probe to hold every {what}")
    return int(output.split(b"COUNT ", 1)[1].split()[0]), _result(output)


def test_each_sandbox_root_is_a_host_uid_of_its_own(engine: EngineClient, two_probed: tuple[str, str], engine_process):
    config = engine_process.config
    seen = {}
    for sandbox in two_probed:
        uid = root_uid(sandbox)
        assert uid >= config.uid_base + config.uid_count and (uid - config.uid_base) % config.uid_count == 0
        assert engine.exec(sandbox, "cat /proc/self/uid_map").stdout.split() == [b"0", str(uid).encode(), b"65536"]
        assert engine.exec(sandbox, "cat /proc/self/gid_map").stdout.split() == [b"0", str(uid).encode(), b"65536"]
        # Owned by its own root: the kernel's per-owner counts are the sandbox's.
        assert _owner_of_user_namespace(init_pid(sandbox)) == uid
        seen[sandbox] = uid
    assert len(set(seen.values())) == 2, seen


def test_one_sandbox_holding_every_inotify_instance_leaves_another_its_own(
    engine: EngineClient, two_probed: tuple[str, str], probe_binary: Path
):
    holder, other = two_probed
    # The kernel's default per-user limit, for the test: a host may have raised it (the engine's preflight
    # does, for its own watches at scale) past a sandbox's open-files limit, which would then stop the probe
    # first and show nothing about per-user counts.
    with _sysctl("/proc/sys/fs/inotify/max_user_instances", "128"):
        count, stopped_by = _hold(engine, holder, "inotify")
        assert (stopped_by, count) == ("EMFILE", 128)
        result = engine.exec(other, ["/probe", "inotify_init"])
        assert _result(result.stdout) == "OK", "the other sandbox's inotify_init1 failed"
        # Nor is host root starved (it was, when host root owned every sandbox's user namespace).
        assert _on_host(probe_binary, "inotify_init") == "OK"


@contextlib.contextmanager
def _sysctl(path: str, value: str) -> Iterator[None]:
    before = Path(path).read_text()
    Path(path).write_text(value)
    try:
        yield
    finally:
        Path(path).write_text(before)


def test_one_sandbox_filling_its_message_queues_leaves_another_its_own(
    engine: EngineClient, two_probed: tuple[str, str], probe_binary: Path
):
    holder, other = two_probed
    count, stopped_by = _hold(engine, holder, "mqueues")
    assert stopped_by == "EMFILE" and count > 0, (count, stopped_by)  # RLIMIT_MSGQUEUE's bytes, used up
    assert _result(engine.exec(other, ["/probe", "mq_open"]).stdout) == "OK", "the other sandbox's mq_open failed"
    assert _on_host(probe_binary, "mq_open") == "OK"


def test_a_file_is_root_inside_and_the_sandbox_own_uid_outside(
    engine: EngineClient, two_probed: tuple[str, str], engine_process: EngineProcess
):
    owners = set()
    for sandbox in two_probed:
        uid = root_uid(sandbox)
        engine.exec(sandbox, "echo made inside > /tmp/by-exec")
        engine.write_file(sandbox, "/tmp/by-api", b"written through the API")
        root = Path(f"/proc/{init_pid(sandbox)}/root")
        for name in ("/tmp/by-exec", "/tmp/by-api"):
            assert engine.exec(sandbox, f"stat -c '%u %g' {name}").stdout == b"0 0\n"
            info = os.stat(f"{root}{name}")
            assert (info.st_uid, info.st_gid) == (uid, uid), name
            owners.add(info.st_uid)
        # The template's files: root inside, through a mount shifted into the
        # sandbox's range; on disk they stay the layers' (uid_base).
        assert engine.exec(sandbox, "stat -c '%u %g' /etc/passwd").stdout == b"0 0\n"
        assert os.stat(f"{root}/etc/passwd").st_uid == uid
    assert len(owners) == 2, "the two sandboxes' files have one owner on the host"
    layers = engine_process.config.layers_dir
    base_layer = engine.call("templates.get", name="base")["layers"][0]
    on_disk = os.stat(layers / layer_directory_name(base_layer) / "etc" / "passwd")
    assert (on_disk.st_uid, on_disk.st_gid) == (engine_process.config.uid_base,) * 2


def test_forks_of_a_snapshot_see_its_files_owned_as_they_were(engine: EngineClient, engine_process: EngineProcess):
    config = engine_process.config
    source = engine.create(template="base", size="tiny", ttl_s=300)["id"]
    name = f"owners-{os.urandom(3).hex()}"
    forks: list[str] = []
    try:
        made = engine.exec(
            source,
            "mkdir -p /data/team && echo root > /data/root-file && echo user > /data/team/user-file"
            " && chown -R 1000:1001 /data/team && ln -s user-file /data/team/link && chown -h 1002:1003 /data/team/link"
            " && rm /etc/os-release",
        )
        assert made.exit_code == 0, made
        layer = engine.call("snapshots.create", sandbox=source, name=name)["layers"][0]
        # On disk the layer is the layers' range, whatever the source's.
        directory = config.layers_dir / layer_directory_name(layer) / "data"
        assert os.lstat(directory / "root-file").st_uid == config.uid_base
        assert (os.lstat(directory / "team" / "user-file").st_uid, os.lstat(directory / "team" / "user-file").st_gid) == (
            config.uid_base + 1000,
            config.uid_base + 1001,
        )
        assert os.lstat(directory / "team" / "link").st_uid == config.uid_base + 1002
        expected = b"0:0 /data/root-file\n1000:1001 /data/team\n1002:1003 /data/team/link\n1000:1001 /data/team/user-file\n"
        for _ in range(2):
            fork = engine.create(template=name, size="tiny", ttl_s=300)["id"]
            forks.append(fork)
            listing = engine.exec(fork, "stat -c '%u:%g %n' /data/root-file /data/team /data/team/link /data/team/user-file")
            assert listing.stdout == expected
            assert engine.exec(fork, "cat /data/team/link; test -e /etc/os-release || echo whited-out").stdout == (
                b"user\nwhited-out\n"
            )
            # What the fork writes is its own: its range, not the source's.
            engine.exec(fork, "echo mine >> /data/team/user-file")
            info = os.stat(f"/proc/{init_pid(fork)}/root/data/team/user-file")
            assert info.st_uid == root_uid(fork) + 1000
        assert len({root_uid(sandbox) for sandbox in (source, *forks)}) == 3
    finally:
        for sandbox in (source, *forks):
            engine.destroy(sandbox)
        engine.call("templates.delete", name=name)


# --- ranges are handed out again only once nothing of their sandbox is left ---------------------


def test_a_range_is_not_handed_out_while_its_sandbox_lives_or_rests(work_dir: Path):
    """Across a SIGKILL of the engine and a crash between destroy's steps: the
    running sandbox keeps its range; the destroyed one's rests, then is reused."""
    with separate_engine(work_dir / f"ranges-{os.urandom(3).hex()}", env={"FORKYARD_ENGINE_UID_COOLDOWN_S": "4"}) as engine:
        with engine.client() as client:
            first = client.create(template="base", size="tiny", ttl_s=600)["id"]
        first_uid = root_uid(first)
        engine.kill()
        engine.start()
        with engine.client() as client:
            assert client.info()["recovery"]["adopted_ids"] == [first]
            second = client.create(template="base", size="tiny", ttl_s=600)["id"]
            assert root_uid(second) != first_uid, "a running sandbox's range was handed out again"
        engine.stop()
        # Killed between destroy's steps: the init is dead, its cgroup left to recovery.
        engine.start(crash_at="destroy:killed")
        with engine.client(timeout_s=30) as client, pytest.raises(errors.Unavailable):
            client.destroy(first)
        assert engine.wait_exit() == 137
        engine.start()
        with engine.client() as client:
            assert client.info()["recovery"]["adopted_ids"] == [second]
            assert client.get(first)["state"] == "destroyed"
            assert client.info()["uid_ranges"]["cooling"] == 1
            third = client.create(template="base", size="tiny", ttl_s=600)["id"]
            assert root_uid(third) not in (first_uid, root_uid(second)), "a range was handed out while it rested"
            # Once it has rested (4 s here), it is the lowest free range: the next create's.
            wait_for(lambda: client.info()["uid_ranges"]["cooling"] == 0, "the range to rest", timeout_s=60)
            fourth = client.create(template="base", size="tiny", ttl_s=600)["id"]
            assert root_uid(fourth) == first_uid, "the rested range (the lowest free) was not reused"


def test_a_range_is_held_while_its_sandbox_cgroup_remains(work_dir: Path):
    """A cgroup the engine could not remove (here: a process the engine never
    sees holds a cgroup below it) keeps its sandbox's range, restarts included,
    until it is gone."""
    with separate_engine(work_dir / f"pinned-{os.urandom(3).hex()}", env={"FORKYARD_ENGINE_UID_COOLDOWN_S": "0"}) as engine:
        cgroups = detect(engine.config)
        if not isinstance(cgroups, CgroupsV1):
            pytest.skip("on cgroup v2, cgroup.kill ends every process below the sandbox's cgroup: none can be kept")
        with engine.client() as client:
            first = client.create(template="base", size="tiny", ttl_s=600)["id"]
            first_uid = root_uid(first)
            pin = cgroups.parents["memory"] / f"fy-{first}" / "pin" / "inner"
            pin.mkdir(parents=True)
            pinned = subprocess.Popen(["sleep", "600"])
            try:
                (pin / "cgroup.procs").write_text(str(pinned.pid))
                client.destroy(first)
                assert cgroups.exists(f"fy-{first}"), "the pin did not keep the cgroup"
                second = client.create(template="base", size="tiny", ttl_s=600)["id"]
                assert root_uid(second) != first_uid, "a range was handed out while its cgroup remained"
                engine.kill()
                engine.start()
                assert cgroups.exists(f"fy-{first}")
                with engine.client() as again:
                    third = again.create(template="base", size="tiny", ttl_s=600)["id"]
                    assert root_uid(third) not in (first_uid, root_uid(second))
            finally:
                pinned.send_signal(signal.SIGKILL)
                pinned.wait()
        engine.kill()
        engine.start()  # recovery removes the cgroup, now empty: the range goes
        assert not cgroups.exists(f"fy-{first}")
        with engine.client() as client:
            fourth = client.create(template="base", size="tiny", ttl_s=600)["id"]
            assert root_uid(fourth) == first_uid
