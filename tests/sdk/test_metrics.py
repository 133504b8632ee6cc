"""The SDK's lifetimes and metrics, sync and async: ``update(ttl_s=..., expires_at=..., idle_timeout_s=...)``,
``idle_timeout_s=`` on create and launch, ``sandbox.metrics()`` and ``launch.metrics()``."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime, timedelta

import pytest

from forkyard import AsyncClient, Client, Conflict, InvalidRequest, Metrics, Sandbox
from tests.support.stack import Stack

pytestmark = pytest.mark.root


def _engine_expiry(stack: Stack, sandbox_id: str) -> float:
    assert stack.engine is not None
    with stack.engine.client() as engine:
        [record] = [record for record in engine.list() if record.get("key") == sandbox_id]
        return float(record["expires_at"])


def test_update_moves_the_expiry_and_sets_the_idle_timeout(fy: Client, sb: Sandbox, stack: Stack) -> None:
    sb.update(ttl_s=5000)
    assert sb.expires_at is not None
    assert _engine_expiry(stack, sb.id) == pytest.approx(sb.expires_at.timestamp(), abs=0.01)
    wanted = datetime.now(UTC) + timedelta(seconds=1200)
    sb.update(expires_at=wanted, idle_timeout_s=900, labels={"suite": "sdk", "moved": "yes"})
    assert _engine_expiry(stack, sb.id) == pytest.approx(wanted.timestamp(), abs=0.01)
    assert (sb.idle_timeout_s, sb.labels["moved"]) == (900, "yes")
    with pytest.raises(InvalidRequest) as refused:
        sb.update(ttl_s=30 * 3600)
    assert refused.value.code == "ttl_over_maximum"
    with pytest.raises(TypeError):
        sb.update(ttl=5)  # type: ignore[call-arg]


def test_an_idle_sandbox_goes_with_its_reason(fy: Client) -> None:
    sandbox = fy.sandboxes.create(template="base", size="tiny", ttl_s=300, idle_timeout_s=1)
    try:
        assert sandbox.idle_timeout_s == 1
        deadline = time.monotonic() + 60  # a guard against a hang, not a measure
        while sandbox.refresh().state != "destroyed" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sandbox.state == "destroyed"
        assert sandbox.end_reason is not None and sandbox.end_reason.code == "idle_timeout"
    finally:
        sandbox.kill(wait=False)


def test_metrics_and_a_launchs_sum(fy: Client) -> None:
    launch = fy.launches.create(template="base", size="tiny", count=2, ttl_s=300, idle_timeout_s=600)
    try:
        members = list(launch.wait(timeout_s=120))
        assert len(members) == 2 and all(member.idle_timeout_s == 600 for member in members)
        assert launch.refresh().idle_timeout_s == 600
        members[0].exec("sleep 300 >/dev/null 2>&1 &")
        each = [member.metrics() for member in members]
        assert all(isinstance(item, Metrics) and item.sandbox == member.id for item, member in zip(each, members, strict=True))
        assert each[0].pids >= 2 and each[0].memory_limit_bytes == 128 << 20
        summed = launch.metrics()
        assert (summed.launch, summed.sandboxes) == (launch.id, 2)
        assert summed.pids == sum(item.pids for item in each)
        assert summed.memory_limit_bytes == 2 * (128 << 20)
        members[1].kill()
        with pytest.raises(Conflict):
            members[1].metrics()
        assert launch.metrics().sandboxes == 1
    finally:
        launch.kill()


def test_async_update_and_metrics(stack: Stack) -> None:
    async def scenario() -> None:
        async with AsyncClient(stack.url, stack.teams[0].key) as fy:
            sandbox = await fy.sandboxes.create(template="base", size="tiny", ttl_s=120, idle_timeout_s=600)
            try:
                assert sandbox.idle_timeout_s == 600
                await sandbox.update(ttl_s=4000, idle_timeout_s=0)
                assert sandbox.idle_timeout_s == 0
                assert sandbox.expires_at is not None
                assert _engine_expiry(stack, sandbox.id) == pytest.approx(sandbox.expires_at.timestamp(), abs=0.01)
                metrics = await sandbox.metrics()
                assert metrics.sandbox == sandbox.id and metrics.pids >= 1 and metrics.disk_limit_bytes > 0
                launch = await fy.launches.create(template="base", size="tiny", count=1, ttl_s=120)
                try:
                    [member] = [member async for member in launch.wait(timeout_s=120)]
                    assert member.running
                    assert (await launch.metrics()).sandboxes == 1
                finally:
                    await launch.kill()
            finally:
                await sandbox.kill(wait=False)

    asyncio.run(scenario())


def test_cli_update_and_metrics(cli, sb: Sandbox, stack: Stack) -> None:
    moved = cli("update", sb.id, "--ttl", "4000", "--idle-timeout", "1200")
    assert moved.returncode == 0, moved.stderr
    assert _engine_expiry(stack, sb.id) == pytest.approx(sb.refresh().expires_at.timestamp(), abs=0.01)  # type: ignore[union-attr]
    assert sb.idle_timeout_s == 1200
    refused = cli("update", sb.id, "--ttl", str(30 * 3600))
    assert refused.returncode != 0 and "ttl_over_maximum" in refused.stderr
    shown = cli("metrics", sb.id, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["sandbox"] == sb.id
    assert cli("metrics").returncode != 0  # a sandbox or --launch
