"""Interactive work never waits behind bulk work: a host's snapshots and single creates travel on its
interactive lane (``host.<name>.interactive``), taken by a worker process of its own, while its teardowns and
launches take the bulk lane (``host.<name>``). Shown with the bulk worker gone: its lane fills with destroys,
and the snapshot and the create are done all the same, by the interactive worker, with the destroys still
queued. No timing: states, the broker's own queue lengths, and who logged what."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.stack import RABBITMQ_TEST_URL, REDIS_TEST_URL, Stack

pytestmark = pytest.mark.root
DESTROYS = 24


def _queued(stack: Stack, queue: str) -> int:
    """Messages waiting on a queue, as the broker holds them."""
    if stack.backend == "embedded":  # console.broker: a file per message, <time>_<uuid>.<queue>.msg
        folder = stack.base_dir / "web" / "broker" / "queue"
        return sum(1 for entry in folder.iterdir() if entry.name.partition(".")[2] == f"{queue}.msg")
    if stack.backend == "rabbitmq":
        import kombu

        with kombu.Connection(RABBITMQ_TEST_URL, connect_timeout=5) as connection:
            return int(connection.default_channel.queue_declare(queue, passive=True).message_count)
    import redis

    return int(redis.Redis.from_url(REDIS_TEST_URL).llen(queue))  # kombu's Redis transport: a list per queue


def _until(api: httpx.Client, path: str, done: set[str], timeout_s: float = 90) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s  # a guard against a hang, not a measure
    while True:
        found = api.get(path).json()
        if found["state"] in done or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _log(stack: Stack, name: str) -> str:
    path: Path = stack.base_dir / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def test_a_snapshot_and_a_create_are_taken_from_their_own_lane_while_the_bulk_lane_is_full(api, stack):
    source = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600}).json()["id"]
    doomed = [
        api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600, "labels": {"lane": "bulk"}}).json()[
            "id"
        ]
        for _ in range(DESTROYS)
    ]
    bulk, interactive = f"host.{stack.host_name}", f"host.{stack.host_name}.interactive"
    created = None
    stack.kill(stack.worker_pid)  # the bulk worker (and its host agent): nothing takes the bulk lane now
    try:
        # A single create that takes the queued path (wait: false), first: the host's last heartbeat is fresh.
        created = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600, "wait": False})
        assert created.status_code == 202, created.text
        for sandbox_id in doomed:  # many destroys, one command each, on the bulk lane
            assert api.delete(f"/api/v1/sandboxes/{sandbox_id}", params={"wait": "false"}).json()["state"] == "stopping"
        assert _queued(stack, bulk) >= DESTROYS
        taken = api.post(f"/api/v1/sandboxes/{source}/snapshot", json={"name": "lanes"})
        assert taken.status_code == 202, taken.text
        snapshot = _until(api, f"/api/v1/snapshots/{taken.json()['id']}", {"ready", "failed"})
        assert snapshot["state"] == "ready", snapshot
        started = _until(api, f"/api/v1/sandboxes/{created.json()['id']}", {"running", "failed"})
        assert started["state"] == "running", started
        # Done while every destroy still waits on the bulk lane, untouched.
        assert _queued(stack, bulk) >= DESTROYS
        assert _queued(stack, interactive) == 0
        states = {api.get(f"/api/v1/sandboxes/{sandbox_id}").json()["state"] for sandbox_id in doomed}
        assert states == {"stopping"}
        assert stack.engine is not None
        with stack.engine.client() as engine:
            alive = {record["key"] for record in engine.list()}
        assert set(doomed) <= alive, "a destroy ran while the bulk lane had no worker"
        # The interactive worker received both commands (Celery logs "Task <name>[<id>] received"); the bulk
        # worker never receives a snapshot's.
        taken_by_interactive = _log(stack, "interactive")
        assert "Task sandboxes.tasks.ensure_snapshot_saved[" in taken_by_interactive
        assert "Task sandboxes.tasks.ensure_running[" in taken_by_interactive
        assert "Task sandboxes.tasks.ensure_snapshot_saved[" not in _log(stack, "worker")
    finally:
        stack.start_worker()
        stack.wait_for_host()
    # The bulk worker, back, takes what waited for it.
    for sandbox_id in doomed:
        assert _until(api, f"/api/v1/sandboxes/{sandbox_id}", {"destroyed"})["state"] == "destroyed"
    # The lane drains: a row's command can land on it just as its destroy is recorded (the returning
    # worker's host agent requeues what it finds stopping), and is taken a moment later.
    deadline = time.monotonic() + 30
    while _queued(stack, bulk) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _queued(stack, bulk) == 0
    for sandbox_id in (source, created.json()["id"] if created is not None else None):
        if sandbox_id:
            api.delete(f"/api/v1/sandboxes/{sandbox_id}")
    api.delete(f"/api/v1/snapshots/{snapshot['id']}")
