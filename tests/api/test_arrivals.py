"""A launch's arrivals stream (``GET /launches/{id}/arrivals``), which ``launch.wait()`` reads: each
member once, pushed as it becomes ready, through a web server that restarts under it."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from forkyard import Client
from tests.support.stack import wait_for_launch as wait_for

pytestmark = [pytest.mark.root, pytest.mark.slow]


def _read(api: httpx.Client, launch_id: str, lines: list[dict[str, Any]]) -> None:
    with api.stream("GET", f"/api/v1/launches/{launch_id}/arrivals", timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"] == "application/x-ndjson"
        for line in response.iter_lines():
            if line:
                lines.append(json.loads(line))


def _until(condition: Any, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _follow_queued(api: httpx.Client, count: int) -> tuple[dict[str, Any], list[dict[str, Any]], threading.Thread]:
    """A launch made while the bulk worker is stopped (it stays queued), and its stream read into a list by a
    thread, once the first line came: the stream is open before any member is ready."""
    created = api.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": count, "ttl_s": 600}).json()
    lines: list[dict[str, Any]] = []
    reader = threading.Thread(target=_read, args=(api, created["id"], lines))
    reader.start()
    _until(lambda: lines)
    return created, lines, reader


def test_the_stream_follows_a_launch_and_sends_each_member_once(api, stack):
    stack.kill(stack.worker_pid)
    try:
        created, lines, reader = _follow_queued(api, 12)
        assert lines[0]["type"] == "progress" and lines[0]["launch"]["progress"]["running"] == 0
    finally:
        stack.start_worker()
    reader.join(timeout=180)
    assert not reader.is_alive()
    kinds = [line["type"] for line in lines]
    assert kinds[-1] == "end" and kinds.count("end") == 1
    members = [line["sandbox"] for line in lines if line["type"] == "sandbox"]
    assert len(members) == 12 and len({member["id"] for member in members}) == 12
    assert all(member["state"] == "running" and member["data_path"] and member["launch"] == created["id"] for member in members)
    ready = [member["ready_at"] for member in members]
    assert ready == sorted(ready)  # in the order they became ready
    end = lines[-1]["launch"]
    assert end["progress"]["running"] == 12 and end["progress"]["queued"] == end["progress"]["creating"] == 0
    got = api.get(f"/api/v1/sandboxes/{members[0]['id']}").json()
    assert {key: got[key] for key in ("id", "state", "template", "ready_at")} == {
        key: members[0][key] for key in ("id", "state", "template", "ready_at")
    }  # as GET /sandboxes/{id} shows it
    api.delete(f"/api/v1/launches/{created['id']}")
    wait_for(api, created["id"], {"stopped"})


def test_a_launch_torn_down_before_it_started_ends_its_stream(api, stack):
    stack.kill(stack.worker_pid)
    try:
        created, lines, reader = _follow_queued(api, 5)
        assert api.delete(f"/api/v1/launches/{created['id']}").status_code == 200
        reader.join(timeout=60)
        assert not reader.is_alive()
    finally:
        stack.start_worker()
    assert lines[-1]["type"] == "end" and lines[-1]["launch"]["progress"]["ended"] == 5
    assert [line for line in lines if line["type"] == "sandbox"] == []


def test_an_unknown_launch_is_404(api):
    answer = api.get("/api/v1/launches/launch_nope/arrivals")
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "launch_not_found"


def test_launch_wait_goes_on_through_a_web_server_restart(stack):
    """The SDK asks again when its stream is cut off, and hands out nobody twice."""
    fy = Client(stack.url, stack.teams[0].key)
    stack.kill(stack.worker_pid)
    handed: list[str] = []
    failure: list[BaseException] = []
    progress: list[int] = []
    launch = fy.launches.create(template="base", size="tiny", count=10, ttl_s=600)

    def follow() -> None:
        try:
            for child in launch.wait(timeout_s=240, poll_s=0.2, on_progress=lambda now: progress.append(now.progress.running)):
                handed.append(child.id)
        except BaseException as error:  # noqa: BLE001 - reported by the test below
            failure.append(error)

    waiter = threading.Thread(target=follow)
    try:
        waiter.start()
        _until(lambda: progress)
        stack.restart_web()
    finally:
        stack.start_worker()
    waiter.join(timeout=240)
    assert not waiter.is_alive() and not failure, failure
    assert len(handed) == 10 and len(set(handed)) == 10
    assert launch.settled and launch.progress.running == 10
    launch.kill()
    fy.close()
