"""Kill the engine at any moment and start it again: the record matches the kernel, nothing leaks."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes.engine import errors, faults
from sandboxes.engine.cgroups import detect
from tests.engine.engines import assert_whole, separate_engine, snapshot_host
from tests.support.engine import EngineProcess

pytestmark = pytest.mark.root


@pytest.fixture
def own_engine(work_dir: Path) -> Iterator[EngineProcess]:
    with separate_engine(work_dir / f"recovery-{os.urandom(3).hex()}") as engine:
        yield engine


def test_sigkill_and_restart_adopts_running_and_paused_sandboxes(own_engine: EngineProcess):
    with own_engine.client() as client:
        running = client.create(template="base", size="tiny", ttl_s=600)["id"]
        client.write_file(running, "/state.txt", b"kept across the restart")
        client.exec(running, "setsid sleep 600 >/dev/null 2>&1 < /dev/null &")
        paused = client.create(template="base", size="tiny", ttl_s=600)["id"]
        client.call("pause", id=paused)
        doomed = client.create(template="base", size="tiny", ttl_s=600)["id"]
        client.destroy(doomed)
    own_engine.kill()
    # While the engine is down, sandboxes keep running (they are the spawner's children).
    own_engine.start()
    with own_engine.client() as client:
        recovery = client.info()["recovery"]
        assert set(recovery["adopted_ids"]) == {running, paused}
        assert recovery["reaped"] == 0
        assert client.read_file(running, "/state.txt") == b"kept across the restart"
        assert client.exec(running, "ps -o args | grep -c '[s]leep 600'").stdout.strip() == b"1"
        assert client.get(paused)["state"] == "paused"
        client.call("resume", id=paused)
        assert client.exec(paused, "echo back").stdout == b"back\n"
        for sandbox in (running, paused):
            assert_whole(client, sandbox)
        assert client.get(doomed)["state"] == "destroyed"
        for sandbox in (running, paused):
            client.destroy(sandbox)
        assert client.list() == []


def test_the_shared_sysfs_is_mounted_once_kept_across_restarts_and_gone_at_reclaim(own_engine: EngineProcess):
    shared = str(own_engine.config.state_dir / "sys")

    def mounted() -> int:
        return sum(1 for line in Path("/proc/self/mountinfo").read_text().splitlines() if line.split()[4] == shared)

    assert mounted() == 1
    own_engine.kill()
    own_engine.start()
    assert mounted() == 1, "a restart binds the sysfs it finds, and mounts no other"
    with own_engine.client() as client:
        sandbox = client.create(template="base", size="tiny", ttl_s=600)["id"]
        assert client.exec(sandbox, "ls /sys/kernel >/dev/null && echo ok").stdout == b"ok\n"
        client.destroy(sandbox)
    own_engine.reclaim()
    assert mounted() == 0


HTTPD = {"name": "web", "command": "httpd -f -p 8080 -h /srv", "ready": {"tcp": 8080}}


def test_sandboxes_in_every_state_are_whole_after_an_engine_sigkill(work_dir: Path):
    """Running, paused, pooled, and a fork with a service: after a SIGKILL and
    a restart each is adopted and works exactly as before, /dev included (the
    restart once emptied every adopted sandbox's /dev)."""
    with separate_engine(work_dir / f"whole-{os.urandom(3).hex()}", warm_pools="base:tiny=1") as engine:
        with engine.client() as client:
            running = client.create(template="base", size="tiny", ttl_s=600, id="whole-running")["id"]
            paused = client.create(template="base", size="tiny", ttl_s=600, id="whole-paused")["id"]
            source = client.create(template="base", size="tiny", ttl_s=600, id="whole-source")["id"]
            client.exec(source, "mkdir -p /srv && echo served > /srv/index.html")
            client.call("snapshots.create", sandbox=source, name="whole-snapshot", services=[HTTPD])
            client.destroy(source)
            fork = client.create(template="whole-snapshot", size="tiny", ttl_s=600, id="whole-fork")["id"]
            for sandbox in (running, paused, fork):
                assert_whole(client, sandbox, "http://127.0.0.1:8080/" if sandbox == fork else "")
            client.call("pause", id=paused)
            _wait_pool_ready(client)
            before = snapshot_host(engine)
        engine.kill()
        engine.start()
        with engine.client() as client:
            recovery = client.info()["recovery"]
            assert (recovery["broken"], recovery["reaped"], recovery["stopped"]) == (0, 0, 0), recovery
            (pooled,) = set(recovery["adopted_ids"]) - {running, paused, fork}
            assert client.get(paused)["state"] == "paused"
            client.call("resume", id=paused)
            claimed = client.create(template="base", size="tiny", ttl_s=600)["id"]
            assert claimed == pooled, "the create was served by the adopted pooled sandbox"
            for sandbox in (running, paused, claimed, fork):
                assert_whole(client, sandbox, "http://127.0.0.1:8080/" if sandbox == fork else "")
            client.call("pools.set", template="base", size="tiny", count=0)
            for sandbox in (running, paused, claimed, fork):
                client.destroy(sandbox)
            client.call("templates.delete", name="whole-snapshot")
        assert snapshot_host(engine).leaks_since(before) == {}


def _wait_pool_ready(client, count: int = 1) -> None:
    deadline = time.monotonic() + 60
    while client.call("pools")["pools"]["base/tiny"]["ready"] < count:
        assert time.monotonic() < deadline, client.call("pools")
        time.sleep(0.05)


def test_a_sandbox_that_is_not_whole_is_stopped_and_reported(own_engine: EngineProcess):
    """Recovery checks what it adopts: one whose /dev lost its devices is
    stopped with the reason, counted as broken, and its kernel objects go."""
    with own_engine.client() as client:
        healthy = client.create(template="base", size="tiny", ttl_s=600)["id"]
        damaged = client.create(template="base", size="tiny", ttl_s=600)["id"]
    own_engine.kill()
    # Detach devpts inside the damaged sandbox only (as host root, in its mount namespace).
    subprocess.run(["nsenter", "-t", str(_init_pid(own_engine, damaged)), "-m", "umount", "-l", "/dev/pts"], check=True)
    own_engine.start()
    with own_engine.client() as client:
        recovery = client.info()["recovery"]
        assert recovery["adopted_ids"] == [healthy]
        assert (recovery["broken"], recovery["broken_ids"]) == (1, [damaged])
        record = client.get(damaged)
        assert record["state"] == "stopped" and "/dev/pts is not mounted" in record["reason"], record
        with pytest.raises(errors.SandboxNotRunning):
            client.exec(damaged, "true")
        assert not detect(own_engine.config).exists(f"fy-{damaged}")
        assert_whole(client, healthy)
        client.destroy(damaged)
        client.destroy(healthy)


def test_sigkill_of_engine_and_spawner_reaps_orphans_without_leaks(own_engine: EngineProcess):
    with own_engine.client() as client:
        before = snapshot_host(own_engine)
        for _ in range(3):
            client.create(template="base", size="tiny", ttl_s=600)
    spawner = own_engine.spawner_pid()
    assert spawner
    own_engine.kill()
    os.kill(spawner, signal.SIGKILL)
    own_engine.start()
    with own_engine.client() as client:
        # The spawner is gone, so the inits answer nobody's waitpid but ours;
        # they are alive, healthy and adopted.
        adopted = client.info()["recovery"]["adopted_ids"]
        assert len(adopted) == 3
        for sandbox in adopted:
            assert_whole(client, sandbox)
            client.destroy(sandbox)
    after = snapshot_host(own_engine)
    assert after.leaks_since(before) == {}


def test_the_spawner_killed_under_a_running_engine_is_replaced_and_nothing_leaks(own_engine: EngineProcess):
    with own_engine.client() as client:
        before = snapshot_host(own_engine)
        sandboxes = [client.create(template="base", size="tiny", ttl_s=600)["id"] for _ in range(2)]
        client.call("pause", id=sandboxes[1])
        spawner = own_engine.spawner_pid()
        assert spawner
        os.kill(spawner, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while own_engine.spawner_pid() in (None, spawner):
            assert time.monotonic() < deadline, "no new spawner"
            time.sleep(0.05)
        # Their inits are now the engine's children (it is their subreaper), still whole.
        client.call("resume", id=sandboxes[1])
        for sandbox in sandboxes:
            assert client.get(sandbox)["state"] == "running"
            assert_whole(client, sandbox)
        sandboxes.append(client.create(template="base", size="tiny", ttl_s=600)["id"])
        assert_whole(client, sandboxes[-1])
        for sandbox in sandboxes:
            client.destroy(sandbox)
    assert snapshot_host(own_engine).leaks_since(before) == {}


def test_sandbox_dying_while_the_engine_is_down_is_noticed(own_engine: EngineProcess):
    with own_engine.client() as client:
        sandbox = client.create(template="base", size="tiny", ttl_s=600)
    own_engine.kill()
    os.kill(client_pid := _init_pid(own_engine, sandbox["id"]), signal.SIGKILL)
    assert client_pid > 1
    own_engine.start()
    with own_engine.client() as client:
        assert client.info()["recovery"]["stopped"] == 1
        # Its disk went with it (nothing can run there any more), deleted by recovery.
        assert client.info()["recovery"]["disks_removed"] == 1
        assert not (own_engine.config.disks_dir / sandbox["id"]).exists()
        assert client.get(sandbox["id"])["state"] == "stopped"
        with pytest.raises(errors.SandboxNotRunning):
            client.exec(sandbox["id"], "true")
        assert client.destroy(sandbox["id"])["state"] == "destroyed"
    assert not detect(own_engine.config).exists(f"fy-{sandbox['id']}")


def _init_pid(engine: EngineProcess, sandbox_id: str) -> int:
    database = sqlite3.connect(engine.config.database_path)
    import json

    (raw,) = database.execute("SELECT record FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
    database.close()
    return int(json.loads(raw)["pid"])


def test_init_killed_from_outside_is_noticed_live(own_engine: EngineProcess):
    with own_engine.client() as client:
        sandbox = client.create(template="base", size="tiny", ttl_s=600)["id"]
        os.kill(_init_pid(own_engine, sandbox), signal.SIGKILL)
        deadline = time.monotonic() + 5
        while client.get(sandbox)["state"] != "stopped" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.get(sandbox)["state"] == "stopped"
        assert "init exited" in client.get(sandbox)["reason"]
        client.destroy(sandbox)


@pytest.mark.parametrize("step", faults.STEPS)
def test_crash_at_each_step_is_cleaned_up_at_start(own_engine: EngineProcess, step: str):
    with own_engine.client() as client:
        before = snapshot_host(own_engine)
        survivor = client.create(template="base", size="tiny", ttl_s=600)["id"]
        victim = client.create(template="base", size="tiny", ttl_s=600)["id"] if step.startswith("destroy") else None
    own_engine.stop()
    own_engine.start(crash_at=step)
    with own_engine.client(timeout_s=30) as client:
        with pytest.raises(errors.Unavailable):
            if victim:
                client.destroy(victim)
            else:
                client.create(template="base", size="tiny", id="crash-victim")
    assert own_engine.wait_exit() == 137
    own_engine.start()
    with own_engine.client() as client:
        recovery = client.info()["recovery"]
        assert recovery["adopted_ids"] == [survivor]
        cleaned = recovery["reaped"] + recovery["cgroups_removed"] + recovery["sockets_removed"] + recovery["processes_killed"]
        if step != "create:recorded":
            assert cleaned > 0, recovery
        assert recovery["broken"] == 0
        assert_whole(client, survivor)
        gone = victim or "crash-victim"
        assert client.get(gone)["state"] == "destroyed"
        client.destroy(survivor)
    assert snapshot_host(own_engine).leaks_since(before) == {}


def test_corrupted_record_is_quarantined_and_the_rest_unaffected(own_engine: EngineProcess):
    with own_engine.client() as client:
        healthy = client.create(template="base", size="tiny", ttl_s=600)["id"]
        corrupted = client.create(template="base", size="tiny", ttl_s=600)["id"]
    own_engine.kill()
    database = sqlite3.connect(own_engine.config.database_path)
    database.execute("UPDATE sandboxes SET record = ? WHERE id = ?", ('{"id": "half-writ', corrupted))
    database.commit()
    database.close()
    own_engine.start()
    with own_engine.client() as client:
        recovery = client.info()["recovery"]
        assert recovery["quarantined"] == 1
        assert recovery["adopted_ids"] == [healthy]
        # The corrupted sandbox's kernel objects were found through its cgroup and removed.
        assert recovery["cgroups_removed"] == 1
        assert client.exec(healthy, "echo fine").stdout == b"fine\n"
        with pytest.raises(errors.SandboxNotFound):
            client.get(corrupted)
        client.destroy(healthy)


def test_unreadable_database_is_set_aside(own_engine: EngineProcess):
    own_engine.kill()
    for suffix in ("", "-wal", "-shm"):
        path = Path(str(own_engine.config.database_path) + suffix)
        if path.exists():
            path.write_bytes(b"this is not a database" * 100)
    own_engine.start()
    with own_engine.client() as client:
        assert client.list() == []
    assert list(own_engine.config.state_dir.glob("engine.sqlite3.corrupt-*"))
