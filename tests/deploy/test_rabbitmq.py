"""RabbitMQ as the broker: the product on PostgreSQL, Redis and RabbitMQ.

The suite's two phases run the embedded broker and Redis; a deployment may
set ``CELERY_BROKER_URL=amqp://...`` instead (console/settings.py). This runs
that deployment once, end to end, against the RabbitMQ on 127.0.0.1:5672
(guest/guest), which the development and CI machines run. It needs that
service, PostgreSQL and Redis: under CI a missing one fails the test.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import kombu
import pytest

from tests.support.stack import RABBITMQ_TEST_URL, Stack, launch_members, wait_for_launch

pytestmark = [pytest.mark.root, pytest.mark.slow]
SERVICES = {"RabbitMQ": 5672, "PostgreSQL": 5432, "Redis": 6379}


def _missing_services() -> list[str]:
    missing = []
    for name, port in SERVICES.items():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        except OSError:
            missing.append(f"{name} (127.0.0.1:{port})")
    return missing


@pytest.fixture(scope="module")
def rabbit_stack(work_dir: Path) -> Iterator[Stack]:
    missing = _missing_services()
    if missing:
        message = "needs " + ", ".join(missing)
        if os.environ.get("FORKYARD_CI"):
            pytest.fail(message)
        pytest.skip(message)
    running = Stack(work_dir / "rabbit", backend="rabbitmq")
    try:
        running.start()
        yield running
    finally:
        running.stop()


def _consumers(queue: str) -> int:
    """How many consumers RabbitMQ itself counts on a queue (raises if there is no such queue)."""
    with kombu.Connection(RABBITMQ_TEST_URL, connect_timeout=5) as connection:
        declared = connection.default_channel.queue_declare(queue, passive=True)
        return int(declared.consumer_count)


def test_the_worker_consumes_its_host_queue_from_rabbitmq(rabbit_stack: Stack) -> None:
    for queue in rabbit_stack.queues:
        assert _consumers(queue) >= 1, f"nobody consumes {queue} on RabbitMQ"


def test_a_create_through_the_broker_runs(rabbit_stack: Stack) -> None:
    # wait: false takes the queued path (a task on the host's queue), not the direct one.
    with rabbit_stack.client() as api:
        created = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 300, "wait": False})
        assert created.status_code == 202, created.text
        sandbox_id = created.json()["id"]
        deadline = time.monotonic() + 30
        state = created.json()["state"]
        while state in ("queued", "creating") and time.monotonic() < deadline:
            time.sleep(0.1)
            state = api.get(f"/api/v1/sandboxes/{sandbox_id}").json()["state"]
        assert state == "running"
        result = api.post(f"/api/v1/sandboxes/{sandbox_id}/exec", json={"cmd": "echo through rabbitmq"})
        assert result.json()["stdout"] == "through rabbitmq\n"
        assert api.delete(f"/api/v1/sandboxes/{sandbox_id}").status_code == 200


def test_a_launch_runs_and_tears_down_leaving_nothing(rabbit_stack: Stack) -> None:
    with rabbit_stack.client() as api:
        created = api.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": 40, "ttl_s": 300})
        assert created.status_code == 201, created.text
        launch = wait_for_launch(api, created.json()["id"], {"ready", "failed"})
        assert launch["state"] == "ready", launch
        members = launch_members(api, launch["id"])
        hostnames = {api.post(f"/api/v1/sandboxes/{m['id']}/exec", json={"cmd": "hostname"}).json()["stdout"] for m in members}
        assert len(hostnames) == 40
        assert api.delete(f"/api/v1/launches/{launch['id']}").status_code == 200
        final = wait_for_launch(api, launch["id"], {"stopped"})
        assert final["progress"]["ended"] == 40
    assert rabbit_stack.engine is not None
    with rabbit_stack.engine.client() as engine:
        assert [s for s in engine.list() if s["labels"].get("launch") == launch["id"]] == []
