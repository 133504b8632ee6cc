"""Snapshots through the SDK: take one (waiting until it is ready), fork it with a launch, delete it."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from forkyard import AsyncClient, Client, Conflict, NotFound, Sandbox, Service, SnapshotFailed, WaitTimeout
from tests.support.stack import Stack

PAGE = "hello from the snapshot"


@pytest.mark.root
def test_snapshot_fork_and_delete(fy: Client, sb: Sandbox) -> None:
    assert sb.exec(f"mkdir -p /srv /work && echo '{PAGE}' > /srv/index.html && echo built > /work/deps").ok
    snap = sb.snapshot(
        name="deps-installed",
        labels={"case": "sdk-snapshot"},
        services=[Service.tcp("web", "httpd -f -p 8080 -h /srv", 8080, timeout_s=20)],
    )
    assert snap.id.startswith("snap_") and snap.ready and snap.name == "deps-installed"
    assert snap.size_bytes > 0 and snap.layer_id and snap.template == "base" and snap.parent is None
    assert snap.services == [Service("web", "httpd -f -p 8080 -h /srv", {"tcp": 8080}, 20.0)]
    assert snap.source_sandbox == sb.id and snap.paused_ms is not None and snap.error is None
    assert sb.refresh().state == "running"
    assert [item.id for item in fy.snapshots.list(label="case=sdk-snapshot")] == [snap.id]
    assert snap.id in {item.id for item in fy.snapshots.list_all(state="ready", page_size=1)}

    launch = fy.launches.create(snapshot=snap.id, count=3, size="tiny", ttl_s=300)
    try:
        children = list(launch.wait(timeout_s=120))
        assert [child.state for child in children] == ["running"] * 3 and launch.snapshot_id == snap.id
        for child in children:
            assert child.snapshot_id == snap.id
            assert child.exec("cat /work/deps; wget -qO- http://127.0.0.1:8080/").stdout == f"built\n{PAGE}\n"
        assert fy.snapshots.get(snap.id).forks_alive == 3
        with pytest.raises(Conflict) as refused:
            snap.delete()
        assert refused.value.code == "snapshot_in_use" and refused.value.details["forks_alive"] == 3
    finally:
        launch.kill()
    deadline = time.monotonic() + 60
    while fy.snapshots.get(snap.id).forks_alive and time.monotonic() < deadline:
        time.sleep(0.2)
    assert fy.snapshots.delete(snap.id).state == "deleted"
    with pytest.raises(NotFound):
        snap.refresh()


@pytest.mark.root
def test_snapshot_without_waiting_then_wait(sb: Sandbox, fy: Client) -> None:
    pending = sb.snapshot(name="later", wait=False)
    assert pending.state in ("creating", "ready")
    assert pending.wait(timeout_s=120).ready
    assert pending.delete().state == "deleted"


@pytest.mark.root
def test_async_snapshot_and_fork(stack: Stack) -> None:
    async def scenario() -> None:
        async with AsyncClient(stack.url, stack.teams[0].key) as fy:
            sandbox = await fy.sandboxes.create(template="base", size="tiny", ttl_s=120)
            try:
                await sandbox.exec("echo async > /made")
                assert (await sandbox.pause()).state == "paused"
                snap = await sandbox.snapshot(
                    name="async", services=[Service.exec("ticker", "while :; do date > /tmp/t; sleep 1; done", "test -s /tmp/t")]
                )
                assert snap.ready and snap.paused_ms == 0 and (await sandbox.refresh()).state == "paused"
                assert snap.id in [item.id async for item in fy.snapshots.list_all()]
                fork = await fy.sandboxes.create(snapshot=snap.id, size="tiny", ttl_s=60)
                assert (await fork.exec("cat /made; test -s /tmp/t && echo ticking")).stdout == "async\nticking\n"
                await fork.kill()
                assert (await fy.snapshots.delete(snap.id)).state == "deleted"
                with pytest.raises(NotFound):
                    await fy.snapshots.get(snap.id)
            finally:
                await sandbox.kill(wait=False)

    asyncio.run(scenario())


# --- waiting, with answers scripted by httpx.MockTransport ---------------------------------


def scripted(states: list[dict[str, object]]) -> httpx.MockTransport:
    """A snapshot that answers ``states`` to its GETs, one after the other (the last one for ever)."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            body = json.loads(request.content)
            assert body["name"] == "s" and body["idempotency_key"].startswith("sdk-snapshot-")
            assert body["services"] == [
                {"name": "db", "command": "pg", "ready": {"http": {"port": 5, "path": "/up"}}, "timeout_s": 30.0}
            ]
            return httpx.Response(202, json={"id": "snap_1", "state": "creating"})
        state = states.pop(0) if len(states) > 1 else states[0]
        return httpx.Response(200, json={"id": "snap_1", **state})

    return httpx.MockTransport(answer)


def test_a_failed_snapshot_raises_snapshot_failed() -> None:
    failed = {"state": "failed", "error": {"code": "too_large", "message": "the layer is over the limit"}}
    with Client("http://forkyard.test", "fy_key", transport=scripted([{"state": "creating"}, failed])) as fy:
        with pytest.raises(SnapshotFailed) as raised:
            fy.sandboxes.ref("sb_1").snapshot(name="s", services=[Service.http("db", "pg", 5, "/up")])
    assert raised.value.code == "too_large" and raised.value.details == {"snapshot": "snap_1"}


def test_waiting_for_a_snapshot_times_out() -> None:
    with Client("http://forkyard.test", "fy_key", transport=scripted([{"state": "creating"}])) as fy:
        with pytest.raises(WaitTimeout):
            fy.sandboxes.ref("sb_1").snapshot(
                name="s",
                services=[{"name": "db", "command": "pg", "ready": {"http": {"port": 5, "path": "/up"}}, "timeout_s": 30.0}],
                timeout_s=0.3,
            )
