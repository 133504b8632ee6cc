"""Lifetimes through the API: an expiry moved while a sandbox runs (the engine's own timer moves with it), an idle
timeout, metrics read from the kernel, a launch's metrics summed, and a create from a template that was deleted."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from tests.support.stack import Stack, launch_members, wait_for_launch

pytestmark = pytest.mark.root


def _engine_record(stack: Stack, sandbox_id: str) -> dict[str, Any]:
    assert stack.engine is not None
    with stack.engine.client() as engine:
        [record] = [record for record in engine.list() if record.get("key") == sandbox_id]
        return engine.get(record["id"])


def _until(api: httpx.Client, sandbox_id: str, states: set[str], timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s  # a guard against a hang, not a measure
    while True:
        sandbox = api.get(f"/api/v1/sandboxes/{sandbox_id}").json()
        if sandbox["state"] in states or time.monotonic() > deadline:
            return sandbox
        time.sleep(0.2)


def test_patch_ttl_moves_the_engines_expiry(api, stack, running):
    before = _engine_record(stack, running)
    moved = api.patch(f"/api/v1/sandboxes/{running}", json={"ttl_s": 7200})
    assert moved.status_code == 200, moved.text
    record = _engine_record(stack, running)
    assert record["expires_at"] >= before["expires_at"] + 6000
    # The row says what the engine says.
    assert datetime.fromisoformat(moved.json()["expires_at"]).timestamp() == pytest.approx(record["expires_at"], abs=0.01)
    assert api.get(f"/api/v1/sandboxes/{running}").json()["expires_at"] == moved.json()["expires_at"]
    # An absolute time, earlier this time.
    wanted = datetime.now(UTC) + timedelta(seconds=900)
    moved = api.patch(f"/api/v1/sandboxes/{running}", json={"expires_at": wanted.isoformat()})
    assert moved.status_code == 200, moved.text
    assert _engine_record(stack, running)["expires_at"] == pytest.approx(wanted.timestamp(), abs=0.01)


def test_an_extension_past_the_teams_maximum_is_refused(api, stack, running):
    before = _engine_record(stack, running)["expires_at"]
    refused = api.patch(f"/api/v1/sandboxes/{running}", json={"ttl_s": 25 * 3600})  # the team's maximum is 24 h
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "ttl_over_maximum"
    assert refused.json()["error"]["details"]["max_ttl_s"] == 24 * 3600
    later = (datetime.now(UTC) + timedelta(days=2)).isoformat()
    refused = api.patch(f"/api/v1/sandboxes/{running}", json={"expires_at": later})
    assert (refused.status_code, refused.json()["error"]["code"]) == (400, "ttl_over_maximum")
    for body in ({"ttl_s": 10, "expires_at": later}, {"expires_at": "2030-01-01T00:00:00"}, {"ttl": 10}):
        assert api.patch(f"/api/v1/sandboxes/{running}", json=body).status_code == 400, body
    assert _engine_record(stack, running)["expires_at"] == before, "a refused change moved the engine's expiry"


def test_a_shortened_ttl_ends_it_with_its_reason(api, stack, running):
    engine_id = _engine_record(stack, running)["id"]
    assert api.patch(f"/api/v1/sandboxes/{running}", json={"ttl_s": 1}).status_code == 200
    final = _until(api, running, {"destroyed", "stopped"})
    assert final["state"] == "destroyed", final
    assert final["end_reason"]["code"] == "ttl_expired"
    assert final["error"] is None
    assert stack.engine is not None
    with stack.engine.client() as engine:
        assert engine.get(engine_id)["reason"] == "ttl expired"


def test_an_idle_sandbox_is_destroyed_a_used_one_is_not(api, stack):
    created = [
        api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600, "idle_timeout_s": 3})
        for _ in range(2)
    ]
    idle, used = (response.json()["id"] for response in created)
    idle_engine_id = _engine_record(stack, idle)["id"]
    try:
        assert all(response.status_code == 201 for response in created), [response.text for response in created]
        assert api.get(f"/api/v1/sandboxes/{idle}").json()["idle_timeout_s"] == 3
        assert _engine_record(stack, idle)["idle_timeout_s"] == 3
        deadline = time.monotonic() + 60  # a guard against a hang, not a measure
        while api.get(f"/api/v1/sandboxes/{idle}").json()["state"] != "destroyed" and time.monotonic() < deadline:
            # Calls, one kind then the other, never 3 s apart.
            assert api.post(f"/api/v1/sandboxes/{used}/exec", json={"cmd": "true"}).json()["exit_code"] == 0
            assert api.put(f"/api/v1/sandboxes/{used}/files", params={"path": "/tmp/ping"}, content=b"ping").status_code == 200
            assert api.get(f"/api/v1/sandboxes/{used}/files", params={"path": "/tmp/ping"}).content == b"ping"
            time.sleep(0.5)
        gone = api.get(f"/api/v1/sandboxes/{idle}").json()
        assert gone["state"] == "destroyed", gone
        assert gone["end_reason"]["code"] == "idle_timeout"
        assert "no exec or file call for 3 s" in gone["end_reason"]["message"]
        assert stack.engine is not None
        with stack.engine.client() as engine:
            assert engine.get(idle_engine_id)["reason"] == "idle timeout: no exec or file call for 3 s"
        assert api.get(f"/api/v1/sandboxes/{used}").json()["state"] == "running"
        assert _engine_record(stack, used)["state"] == "running"
        # Switched off by a PATCH: the engine's record says so.
        patched = api.patch(f"/api/v1/sandboxes/{used}", json={"idle_timeout_s": 0})
        assert patched.json()["idle_timeout_s"] == 0
        assert _engine_record(stack, used)["idle_timeout_s"] == 0
    finally:
        for sandbox_id in (idle, used):
            api.delete(f"/api/v1/sandboxes/{sandbox_id}")


def test_metrics_are_the_kernels(api, running):
    url = f"/api/v1/sandboxes/{running}/metrics"
    before = api.get(url).json()
    assert before["sandbox"] == running and before["memory_limit_bytes"] > 0
    # 32 MiB held in memory by the shell, then let go: the peak keeps it.
    allocate = "a=$(head -c 33554432 /dev/zero | tr '\\0' a); echo ${#a}"
    held = api.post(f"/api/v1/sandboxes/{running}/exec", json={"cmd": allocate}).json()
    assert held["stdout"] == "33554432\n", held
    # A process left running is counted.
    assert api.post(f"/api/v1/sandboxes/{running}/exec", json={"cmd": "sleep 600 >/dev/null 2>&1 &"}).json()["exit_code"] == 0
    after = api.get(url).json()
    assert after["memory_peak_bytes"] >= before["memory_bytes"] + (30 << 20), (before, after)
    assert after["pids"] >= before["pids"] + 1
    assert after["cpu_s"] > before["cpu_s"]
    # A file written through the API is on its disk.
    assert (
        api.put(f"/api/v1/sandboxes/{running}/files", params={"path": "/tmp/blob"}, content=b"x" * (4 << 20)).status_code == 200
    )
    assert api.get(url).json()["disk_used_bytes"] >= after["disk_used_bytes"] + (4 << 20)
    # The OOM killer, provoked: a process asking for more than the sandbox's memory.
    hog = "a=$(head -c 1000000000 /dev/zero | tr '\\0' a)"
    assert api.post(f"/api/v1/sandboxes/{running}/exec", json={"cmd": hog, "timeout_s": 60}).json()["oom_killed"]
    assert api.get(url).json()["oom_kills"] > before["oom_kills"]


def test_metrics_of_a_sandbox_that_ended_and_of_another_team(api, team_b, stack, running):
    with stack.client(team_b) as other:
        assert other.get(f"/api/v1/sandboxes/{running}/metrics").status_code == 404
    api.delete(f"/api/v1/sandboxes/{running}")
    refused = api.get(f"/api/v1/sandboxes/{running}/metrics")
    assert (refused.status_code, refused.json()["error"]["code"]) == (409, "sandbox_not_running")


def test_a_launchs_metrics_are_its_members_summed(api):
    created = api.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": 3, "ttl_s": 600}).json()
    try:
        wait_for_launch(api, created["id"], {"ready"})
        members = [member["id"] for member in launch_members(api, created["id"])]
        api.post(f"/api/v1/sandboxes/{members[0]}/exec", json={"cmd": "sleep 600 >/dev/null 2>&1 &"})
        each = [api.get(f"/api/v1/sandboxes/{member}/metrics").json() for member in members]
        summed = api.get(f"/api/v1/launches/{created['id']}/metrics").json()
        assert (summed["launch"], summed["sandboxes"], summed["unreachable"]) == (created["id"], 3, 0)
        assert summed["pids"] == sum(item["pids"] for item in each)
        assert summed["memory_limit_bytes"] == sum(item["memory_limit_bytes"] for item in each)
        assert summed["cpu_limit"] == pytest.approx(sum(item["cpu_limit"] for item in each))
        # In microseconds, the kernel's unit (as floats, two sums of the same times may differ in the last digit).
        assert round(summed["cpu_s"] * 1e6) >= sum(round(item["cpu_s"] * 1e6) for item in each)
    finally:
        api.delete(f"/api/v1/launches/{created['id']}")


def test_a_create_from_a_deleted_template_is_not_found(api, stack):
    assert stack.engine is not None
    with stack.engine.client() as engine:
        engine.call("templates.build_base", name="doomed", replace=True)
    deadline = time.monotonic() + 30  # the host's heartbeat reports it
    while api.get("/api/v1/templates/doomed").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    with stack.engine.client() as engine:
        engine.call("templates.delete", name="doomed")
    # At once (the heartbeat has not said so yet: the host refuses it) and after the heartbeat (the
    # template is gone from the control plane): 404, never 503.
    refused = api.post("/api/v1/sandboxes", json={"template": "doomed", "size": "tiny"})
    assert (refused.status_code, refused.json()["error"]["code"]) == (404, "template_not_found"), refused.text
    deadline = time.monotonic() + 30
    while api.get("/api/v1/templates/doomed").status_code != 404 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert api.get("/api/v1/templates/doomed").status_code == 404
    refused = api.post("/api/v1/sandboxes", json={"template": "doomed", "size": "tiny"})
    assert (refused.status_code, refused.json()["error"]["code"]) == (404, "template_not_found"), refused.text
    launched = api.post("/api/v1/launches", json={"template": "doomed", "size": "tiny", "count": 2})
    assert (launched.status_code, launched.json()["error"]["code"]) == (404, "template_not_found"), launched.text
