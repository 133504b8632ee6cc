"""Warm pools: a create becomes a claim, and the pool refills behind it."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes.engine import errors
from tests.support.engine import EngineProcess

pytestmark = pytest.mark.root


@pytest.fixture
def pooled_engine(work_dir: Path) -> Iterator[EngineProcess]:
    engine = EngineProcess(work_dir / f"pool-{os.urandom(3).hex()}", warm_pools="base:tiny=3")
    engine.start()
    with engine.client() as client:
        client.call("templates.build_base", name="base", replace=True)
        client.call("pools.set", template="base", size="tiny", count=3)  # fill now that base exists
    yield engine
    engine.reclaim()
    engine.remove_files()


def wait_ready(client, count: int, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = client.call("pools")["pools"]["base/tiny"]
        if status["ready"] >= count:
            return status
        time.sleep(0.05)
    raise AssertionError(f"pool did not fill: {status}")


def test_create_claims_a_ready_sandbox_and_the_pool_refills(pooled_engine: EngineProcess):
    with pooled_engine.client() as client:
        wait_ready(client, 3)
        assert client.list() == [], "pooled sandboxes must not show in listings"
        sandbox = client.create(template="base", size="tiny", ttl_s=30, labels={"run": "7"}, env={"SEED": "11"})
        info = client.info()
        assert info["pool_claims"] == 1
        assert sandbox["labels"] == {"run": "7"}
        assert sandbox["expires_at"] - sandbox["created_at"] == pytest.approx(30, abs=0.5)
        result = client.exec(sandbox["id"], "hostname; echo $SEED")
        assert result.stdout.decode().split() == [sandbox["id"], "11"]
        assert [s["id"] for s in client.list()] == [sandbox["id"]]
        wait_ready(client, 3)  # refilled behind the claim
        client.destroy(sandbox["id"])


def test_explicit_size_or_id_bypasses_the_pool(pooled_engine: EngineProcess):
    with pooled_engine.client() as client:
        wait_ready(client, 3)
        custom = client.create(template="base", cpu=0.5, memory_mib=64)
        named = client.create(template="base", size="tiny", id="chosen-by-caller")
        assert named["id"] == "chosen-by-caller"
        assert client.info()["pool_claims"] == 0
        for sandbox in (custom, named):
            client.destroy(sandbox["id"])


def test_pooled_sandboxes_are_adopted_back_after_a_crash(pooled_engine: EngineProcess):
    with pooled_engine.client() as client:
        wait_ready(client, 3)
    pooled_engine.kill()
    pooled_engine.start()
    with pooled_engine.client() as client:
        assert len(client.info()["recovery"]["adopted_ids"]) == 3
        assert client.call("pools")["pools"]["base/tiny"]["ready"] == 3
        sandbox = client.create(template="base", size="tiny")
        assert client.exec(sandbox["id"], "echo from the pool").stdout == b"from the pool\n"
        client.destroy(sandbox["id"])


def test_shrinking_a_pool_destroys_its_surplus(pooled_engine: EngineProcess):
    with pooled_engine.client() as client:
        wait_ready(client, 3)
        assert client.call("pools.set", template="base", size="tiny", count=1)["target"] == 1
        deadline = time.monotonic() + 10
        while client.info()["pooled"] > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.info()["pooled"] == 1
        with pytest.raises(errors.InvalidRequest):
            client.call("pools.set", template="base", size="tiny", count=-1)
        with pytest.raises(errors.TemplateNotFound):
            client.call("pools.set", template="nope", size="tiny", count=1)


def test_idempotency_key_creates_once(engine):
    first = engine.create(template="base", size="tiny", key="launch-9/env-0")
    again = engine.create(template="base", size="tiny", key="launch-9/env-0")
    other = engine.create(template="base", size="tiny", key="launch-9/env-1")
    assert first["id"] == again["id"] != other["id"]
    engine.destroy(first["id"])
    assert engine.create(template="base", size="tiny", key="launch-9/env-0")["state"] == "destroyed"
    engine.destroy(other["id"])
