"""Launches: many sandboxes in one call, progress, teardown, and a worker killed mid-way."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import pytest

from tests.support.stack import launch_members
from tests.support.stack import wait_for_launch as wait_for

pytestmark = [pytest.mark.root, pytest.mark.slow]


def _children(pid: int) -> list[int]:
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir() for child in (task / "children").read_text().split()]


def test_launch_of_200_runs_a_command_in_each_and_tears_down(api, stack):
    created = api.post(
        "/api/v1/launches", json={"template": "base", "size": "tiny", "count": 200, "ttl_s": 600, "labels": {"run": "l200"}}
    )
    assert created.status_code == 201, created.text
    launch = wait_for(api, created.json()["id"], {"ready", "failed"})
    assert launch["state"] == "ready"
    assert launch["progress"] == {"requested": 200, "queued": 0, "creating": 0, "running": 200, "failed": 0, "ended": 0}
    members = launch_members(api, launch["id"])
    assert len(members) == 200 and len({member["id"] for member in members}) == 200
    assert all(member["labels"]["launch"] == launch["id"] and member["labels"]["run"] == "l200" for member in members)

    def run(member: dict) -> str:
        result = api.post(f"/api/v1/sandboxes/{member['id']}/exec", json={"cmd": "hostname"})
        assert result.status_code == 200, result.text
        return result.json()["stdout"].strip()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        hostnames = list(pool.map(run, members))
    assert len(set(hostnames)) == 200, "two sandboxes answered with one hostname"

    torn = api.delete(f"/api/v1/launches/{launch['id']}")
    assert torn.status_code == 200 and torn.json()["state"] in ("stopping", "stopped")
    final = wait_for(api, launch["id"], {"stopped"})
    assert final["progress"]["ended"] == 200
    with stack.engine.client() as engine:
        assert [s for s in engine.list() if s["labels"].get("launch") == launch["id"]] == []


def test_launch_idempotency_key(api):
    body = {"template": "base", "size": "tiny", "count": 3, "idempotency_key": f"launch-{time.time()}"}
    first, second = api.post("/api/v1/launches", json=body), api.post("/api/v1/launches", json=body)
    assert (first.status_code, second.status_code) == (201, 200)
    assert first.json()["id"] == second.json()["id"]
    wait_for(api, first.json()["id"], {"ready"})
    assert len(launch_members(api, first.json()["id"])) == 3
    api.delete(f"/api/v1/launches/{first.json()['id']}")


def test_worker_killed_mid_launch_leaves_no_orphan_and_no_double(api, stack):
    created = api.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": 120, "ttl_s": 600}).json()
    deadline = time.monotonic() + 30
    while api.get(f"/api/v1/launches/{created['id']}").json()["progress"]["running"] < 10:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    worker = stack.worker_pid
    assert worker is not None
    beats = _children(worker)
    assert beats, "the worker runs beat (-B) in a child process"
    stack.kill(worker)
    deadline = time.monotonic() + 5
    while any(Path(f"/proc/{pid}").exists() for pid in beats) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in beats if Path(f"/proc/{pid}").exists()], "the killed worker's beat kept running"
    stack.start_worker()
    launch = wait_for(api, created["id"], {"ready"}, timeout_s=180)
    assert launch["progress"]["running"] == 120 and launch["progress"]["failed"] == 0
    members = launch_members(api, created["id"])
    with stack.engine.client() as engine:
        on_host = [s for s in engine.list() if s["labels"].get("launch") == created["id"]]
    # Exactly one engine sandbox per launch member: none made twice, none orphaned.
    recorded = {member["id"] for member in members}
    keys = [s["key"] for s in on_host]
    assert len(on_host) == 120, (
        f"engine: {len(on_host)}, duplicates: {len(keys) - len(set(keys))}, recorded but not on the engine: {recorded - set(keys)}, "
        + stack.shell(
            f"from sandboxes.models import Sandbox; print(list(Sandbox.objects.filter(id__in={sorted(recorded - set(keys))!r}).values('id','state','engine_id','error_code')))"
        )
    )
    assert len(members) == 120
    api.delete(f"/api/v1/launches/{created['id']}")
    wait_for(api, created["id"], {"stopped"})
    time.sleep(2)  # one reconcile round
    with stack.engine.client() as engine:
        assert [s for s in engine.list() if s["labels"].get("launch") == created["id"]] == []


@pytest.mark.parametrize("wait_running", [0, 20], ids=["while-queued", "mid-launch"])
def test_a_launch_torn_down_early_leaves_nothing_running_or_billed(api, stack, wait_running):
    """Issue: DELETE right after POST answered "stopping", then every sandbox was created and kept running
    (and billed) for as long as anyone watched. A teardown wins over any create still in flight."""
    created = api.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": 300, "ttl_s": 600}).json()
    deadline = time.monotonic() + 60
    while api.get(f"/api/v1/launches/{created['id']}").json()["progress"]["running"] < wait_running:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    torn = api.delete(f"/api/v1/launches/{created['id']}")
    assert torn.status_code == 200 and torn.json()["state"] in ("stopping", "stopped"), torn.text
    final = wait_for(api, created["id"], {"stopped"}, timeout_s=120)
    members = launch_members(api, created["id"])
    assert final["progress"]["running"] == final["progress"]["creating"] == final["progress"]["queued"] == 0
    assert {member["state"] for member in members} <= {"destroyed", "failed"}, {member["state"] for member in members}
    time.sleep(2)  # a reconciliation round: a create that returned late is destroyed by now
    with stack.engine.client() as engine:
        assert [s for s in engine.list() if s["labels"].get("launch") == created["id"]] == []
    usage = api.get("/api/v1/usage", params={"group_by": "label:launch"}).json()
    line = next((line for line in usage["lines"] if line["group"] == created["id"]), None)
    if line is not None:  # the members that ran were billed until they were destroyed, not after
        later = api.get("/api/v1/usage", params={"group_by": "label:launch"}).json()
        again = next(line for line in later["lines"] if line["group"] == created["id"])
        assert again["seconds"] == line["seconds"], "a torn-down launch is still being billed"


def test_a_teardown_is_done_by_the_web_server_while_the_hosts_worker_is_stopped(api, stack):
    """The teardown's fast path: the web server asks the engine itself. With the host's worker gone (killed:
    a worker frozen mid-write on SQLite would hold the database's one write lock, which is another test),
    every member still ends; the command queued meanwhile, once a worker is back, changes nothing."""
    created = api.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": 20, "ttl_s": 600}).json()
    wait_for(api, created["id"], {"ready"}, timeout_s=120)
    stack.kill(stack.worker_pid)
    try:
        assert api.delete(f"/api/v1/launches/{created['id']}").status_code == 200
        final = wait_for(api, created["id"], {"stopped"}, timeout_s=60)
        assert final["progress"]["ended"] == 20
        ended = {member["id"]: member["ended_at"] for member in launch_members(api, created["id"])}
        assert {member["state"] for member in launch_members(api, created["id"])} == {"destroyed"}
    finally:
        stack.start_worker()
    with stack.engine.client() as engine:
        assert [s for s in engine.list() if s["labels"].get("launch") == created["id"]] == []
    after = api.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": 2, "ttl_s": 600}).json()
    wait_for(api, after["id"], {"ready"}, timeout_s=120)  # the new worker has worked through the queue
    assert {member["id"]: member["ended_at"] for member in launch_members(api, created["id"])} == ended
    assert api.delete("/api/v1/sandboxes", params={"launch": after["id"]}).json()["count"] == 2
    wait_for(api, after["id"], {"stopped"}, timeout_s=60)
