"""A sandbox's lifetime in the engine: its TTL moved while it runs (and kept across a restart), its idle
timeout, and what its cgroup reports about it."""

from __future__ import annotations

import os
import time

import pytest

from sandboxes.engine.client import EngineClient
from sandboxes.engine.errors import InvalidRequest

from .engines import separate_engine, wait_for

pytestmark = pytest.mark.root


def test_update_moves_the_expiry_and_a_restart_keeps_it(work_dir):
    with separate_engine(work_dir / f"life-{os.urandom(3).hex()}") as engine:
        with engine.client() as client:
            sandbox = client.create(template="base", size="tiny", ttl_s=60)
            moved = client.call("update", id=sandbox["id"], ttl_s=3000)
            assert moved["expires_at"] > sandbox["expires_at"] + 2900
            assert client.get(sandbox["id"])["expires_at"] == moved["expires_at"]
            with pytest.raises(InvalidRequest) as over:
                client.call("update", id=sandbox["id"], ttl_s=8 * 24 * 3600)
            assert over.value.code == "ttl_over_maximum" and over.value.details["field"] == "ttl_s"
            with pytest.raises(InvalidRequest) as far:
                client.call("update", id=sandbox["id"], expires_at=time.time() + 8 * 24 * 3600)
            assert far.value.code == "ttl_over_maximum" and far.value.details["field"] == "expires_at"
            with pytest.raises(InvalidRequest):
                client.call("update", id=sandbox["id"], expires_at=time.time() - 5)
            assert client.get(sandbox["id"])["expires_at"] == moved["expires_at"]
        engine.kill()
        engine.start()
        with engine.client() as client:
            adopted = client.get(sandbox["id"])
            assert adopted["state"] == "running"
            assert adopted["expires_at"] == moved["expires_at"]


def test_a_shortened_ttl_destroys_it_then(engine: EngineClient):
    sandbox = engine.create(template="base", size="tiny", ttl_s=600)["id"]
    engine.call("update", id=sandbox, ttl_s=1)
    gone = wait_for(lambda: (record := engine.get(sandbox))["state"] == "destroyed" and record, "the TTL to end it")
    assert gone["reason"] == "ttl expired"


def test_an_idle_sandbox_is_destroyed_and_a_busy_one_is_not(engine: EngineClient):
    idle = engine.create(template="base", size="tiny", ttl_s=600, idle_timeout_s=2)["id"]
    busy = engine.create(template="base", size="tiny", ttl_s=600, idle_timeout_s=2)["id"]
    assert engine.get(idle)["idle_timeout_s"] == 2
    try:
        # The busy one gets a call every half second until the idle one is gone: no exec or file call
        # ever left it idle for 2 s, so it runs on.
        def idle_gone() -> bool:
            assert engine.exec(busy, "true").exit_code == 0
            engine.call("files.stat", id=busy, path="/")
            time.sleep(0.5)
            return engine.get(idle)["state"] == "destroyed"

        wait_for(idle_gone, "the idle sandbox to go")
        assert engine.get(idle)["reason"] == "idle timeout: no exec or file call for 2 s"
        assert engine.get(busy)["state"] == "running"
        # An exec that runs longer than the timeout is activity all along.
        assert engine.exec(busy, "sleep 3").exit_code == 0
        assert engine.get(busy)["state"] == "running"
        # Switched off, it stays; switched on again, it goes.
        engine.call("update", id=busy, idle_timeout_s=0)
        assert engine.get(busy)["idle_timeout_s"] == 0
        engine.call("update", id=busy, idle_timeout_s=1)
        wait_for(lambda: engine.get(busy)["state"] == "destroyed", "the idle timeout switched on to end it")
        assert engine.info()["counters"]["idle_expired"] >= 2
    finally:
        engine.destroy(idle)
        engine.destroy(busy)


def test_update_refuses_what_it_does_not_know(engine: EngineClient, sandbox: str):
    with pytest.raises(InvalidRequest) as unknown:
        engine.call("update", id=sandbox, ttl=5)
    assert unknown.value.details["field"] == "ttl"
    with pytest.raises(InvalidRequest):
        engine.call("update", id=sandbox, idle_timeout_s=-1)
    with pytest.raises(InvalidRequest):
        engine.call("update", id=sandbox, ttl_s=10, expires_at=time.time() + 10)


def test_stats_are_what_the_kernel_reports(engine: EngineClient, sandbox: str):
    before = engine.call("stats", id=sandbox)
    assert before["memory_limit_bytes"] > 0 and before["disk_limit_bytes"] > 0
    # 24 MiB written to its disk: its quota group (or, in memory, its tmpfs) counts them.
    assert engine.exec(sandbox, "dd if=/dev/zero of=/tmp/blob bs=1M count=24 2>/dev/null").exit_code == 0
    # A process started in the background is counted.
    assert engine.exec(sandbox, "sleep 300 >/dev/null 2>&1 &").exit_code == 0
    after = engine.call("stats", id=sandbox)
    assert after["disk_used_bytes"] >= before["disk_used_bytes"] + (24 << 20)
    if engine.info()["disks"]["backend"] == "btrfs":
        assert after["disk_files"] is None  # its quota group counts bytes (data and metadata), not files
    else:
        assert after["disk_files"] > before["disk_files"]
    assert after["pids"] >= before["pids"] + 1
    assert after["memory_peak_bytes"] >= after["memory_bytes"] >= 24 << 20
    assert after["cpu_usage_us"] > before["cpu_usage_us"]
    assert 0 < after["cpu_share"]
