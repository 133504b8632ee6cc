"""Warm pools: a create becomes a claim, and the pool refills behind it."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes.engine import errors
from sandboxes.engine.cgroups import detect
from sandboxes.engine.sizes import DEFAULT_SIZES, MEBIBYTE
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


def _cgroup_value(engine: EngineProcess, sandbox_id: str, *names: str) -> int:
    """The first of ``names`` found in the sandbox's cgroup directories (v1 and v2 name limits differently)."""
    for directory in detect(engine.config).directories(f"fy-{sandbox_id}"):
        for name in names:
            if (directory / name).exists():
                return int((directory / name).read_text().split()[0])
    raise AssertionError(f"no {' or '.join(names)} in the cgroup of {sandbox_id}")


def test_a_size_given_with_its_own_shape_is_that_size_and_claims_from_its_pool(pooled_engine: EngineProcess):
    tiny = DEFAULT_SIZES["tiny"]
    with pooled_engine.client() as client:
        wait_ready(client, 3)
        # What the control plane sends for every create: the name and the shape.
        sandbox = client.create(template="base", size="tiny", cpu=float(tiny.cpu), memory_mib=tiny.memory_mib)
        assert client.info()["pool_claims"] == 1
        assert (sandbox["size"], sandbox["cpu"], sandbox["memory_mib"]) == ("tiny", tiny.cpu, tiny.memory_mib)
        assert _cgroup_value(pooled_engine, sandbox["id"], "pids.max") == tiny.pids
        client.destroy(sandbox["id"])


def test_a_size_given_with_another_shape_gets_that_shape_and_never_a_pooled_sandbox(pooled_engine: EngineProcess):
    with pooled_engine.client() as client:
        wait_ready(client, 3)
        sandbox = client.create(template="base", size="tiny", cpu=0.5, memory_mib=96)
        try:
            assert client.info()["pool_claims"] == 0
            assert client.call("pools")["pools"]["base/tiny"]["ready"] == 3
            assert (sandbox["size"], sandbox["cpu"], sandbox["memory_mib"]) == ("tiny", 0.5, 96)
            assert _cgroup_value(pooled_engine, sandbox["id"], "memory.max", "memory.limit_in_bytes") == 96 * MEBIBYTE
            assert _cgroup_value(pooled_engine, sandbox["id"], "pids.max") == 192  # an explicit shape's: 2 per MiB
            assert client.exec(sandbox["id"], "true").exit_code == 0
        finally:
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
