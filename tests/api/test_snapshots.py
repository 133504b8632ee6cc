"""Snapshots through the real HTTP API: take one, fork it, its services, deleting, billing, bad input, isolation.

Heavier cases (forking 100, thousands of files, engine restarts) are the engine's, in tests/engine.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.api.test_schema import check
from tests.support.ports import via_loopback

pytestmark = pytest.mark.root

WEB = {"name": "web", "command": "httpd -f -p 8080 -h /srv", "ready": {"tcp": 8080}}
PAGE = "served from the snapshot"


def wait_snapshot(api: httpx.Client, snapshot_id: str, timeout_s: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        snapshot = api.get(f"/api/v1/snapshots/{snapshot_id}").json()
        if snapshot["state"] != "creating" or time.monotonic() > deadline:
            return snapshot
        time.sleep(0.1)


def take(api: httpx.Client, sandbox_id: str, **body: Any) -> dict[str, Any]:
    response = api.post(f"/api/v1/sandboxes/{sandbox_id}/snapshot", json={"name": "snap", **body})
    assert response.status_code == 202, response.text
    assert response.json()["state"] == "creating"
    snapshot = wait_snapshot(api, response.json()["id"])
    assert snapshot["state"] == "ready", snapshot
    return snapshot


def launch_forks(api: httpx.Client, snapshot_id: str, count: int) -> tuple[str, list[dict[str, Any]]]:
    launch = api.post("/api/v1/launches", json={"snapshot": snapshot_id, "count": count, "size": "tiny", "ttl_s": 300})
    assert launch.status_code == 201, launch.text
    launch_id = launch.json()["id"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        progress = api.get(f"/api/v1/launches/{launch_id}").json()["progress"]
        if progress["queued"] + progress["creating"] == 0:
            break
        time.sleep(0.1)
    sandboxes = api.get(f"/api/v1/launches/{launch_id}/sandboxes").json()["sandboxes"]
    assert [sandbox["state"] for sandbox in sandboxes] == ["running"] * count, sandboxes
    return launch_id, sandboxes


def run(api: httpx.Client, sandbox_id: str, cmd: str) -> dict[str, Any]:
    response = api.post(f"/api/v1/sandboxes/{sandbox_id}/exec", json={"cmd": cmd})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def new_sandbox(api: httpx.Client, **body: Any) -> dict[str, Any]:
    response = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600, **body})
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


def billed_seconds(api: httpx.Client, case: str) -> float:
    """Seconds billed to objects labelled ``case=<case>`` (a snapshot's saved state carries its labels)."""
    lines = api.get("/api/v1/usage", params={"group_by": "label:case"}).json()["lines"]
    return sum(line["seconds"] for line in lines if line["group"] == case)


@pytest.fixture(scope="module")
def web_snapshot(stack):
    """A sandbox with a file tree and a web root, and a ready snapshot of it whose forks start httpd."""
    with stack.client() as api:
        source = new_sandbox(api, labels={"suite": "snapshots"})
        prepared = run(
            api,
            source["id"],
            f"mkdir -p /srv /work/tree && echo '{PAGE}' > /srv/index.html"
            " && for i in $(seq 1 300); do echo $i > /work/tree/f$i; done",
        )
        assert prepared["exit_code"] == 0, prepared
        snapshot = take(api, source["id"], name="web-ready", labels={"suite": "snapshots"}, services=[WEB])
        yield source, snapshot
        api.delete(f"/api/v1/sandboxes/{source['id']}")


def test_a_snapshot_records_its_layer_services_and_source(api, web_snapshot):
    source, snapshot = web_snapshot
    assert snapshot["id"].startswith("snap_") and snapshot["name"] == "web-ready"
    assert snapshot["layer_id"] and snapshot["size_bytes"] > 0 and snapshot["total_bytes"] >= snapshot["size_bytes"]
    assert snapshot["template"] == "base" and snapshot["parent"] is None
    assert snapshot["source_sandbox"] == source["id"] and snapshot["host"] == source["host"]
    assert snapshot["paused_ms"] is not None and snapshot["paused_ms"] >= 0
    assert [(service["name"], service["ready"]["tcp"]) for service in snapshot["services"]] == [("web", 8080)]
    assert snapshot["labels"] == {"suite": "snapshots"} and snapshot["forks_alive"] == 0 and snapshot["error"] is None
    # The source keeps running, its files untouched.
    assert api.get(f"/api/v1/sandboxes/{source['id']}").json()["state"] == "running"
    assert run(api, source["id"], "cat /work/tree/f300")["stdout"] == "300\n"
    listed = api.get("/api/v1/snapshots", params={"label": "suite=snapshots"}).json()
    assert snapshot["id"] in [row["id"] for row in listed["snapshots"]]
    assert api.get("/api/v1/snapshots", params={"label": "suite=other"}).json() == {"snapshots": [], "next_cursor": None}


def test_forks_have_the_tree_and_the_service_and_keep_their_writes(api, web_snapshot):
    _, snapshot = web_snapshot
    launch_id, forks = launch_forks(api, snapshot["id"], 5)
    try:
        assert {fork["snapshot"] for fork in forks} == {snapshot["id"]}
        assert api.get(f"/api/v1/snapshots/{snapshot['id']}").json()["forks_alive"] == 5
        for fork in forks:
            result = run(api, fork["id"], "cat /work/tree/f1 /work/tree/f300; wget -qO- http://127.0.0.1:8080/")
            assert result["stdout"] == f"1\n300\n{PAGE}\n", (fork["id"], result)
        run(api, forks[0]["id"], "echo mine > /work/tree/private && rm /work/tree/f1")
        assert run(api, forks[0]["id"], "cat /work/tree/private")["stdout"] == "mine\n"
        later = new_sandbox(api, template=None, snapshot=snapshot["id"])
        try:
            for other in (forks[1]["id"], later["id"]):
                seen = run(api, other, "cat /work/tree/private; cat /work/tree/f1")
                assert seen["stdout"] == "1\n" and "No such file" in seen["stderr"], seen
        finally:
            api.delete(f"/api/v1/sandboxes/{later['id']}")
    finally:
        api.delete(f"/api/v1/launches/{launch_id}")


def test_a_snapshot_of_a_fork_stacks_on_its_parent(api, web_snapshot):
    _, parent = web_snapshot
    fork = new_sandbox(api, template=None, snapshot=parent["id"])
    try:
        run(api, fork["id"], "echo second > /work/second")
        child = take(api, fork["id"], name="second")
        assert child["parent"] == parent["id"] and child["template"] == "base"
        assert [service["name"] for service in child["services"]] == ["web"]  # inherited: its forks start httpd too
        grandchild = new_sandbox(api, template=None, snapshot=child["id"])
        try:
            seen = run(api, grandchild["id"], "cat /work/second /work/tree/f7; wget -qO- http://127.0.0.1:8080/")
            assert seen["stdout"] == f"second\n7\n{PAGE}\n", seen
        finally:
            api.delete(f"/api/v1/sandboxes/{grandchild['id']}")
        assert api.delete(f"/api/v1/snapshots/{child['id']}").status_code == 200
    finally:
        api.delete(f"/api/v1/sandboxes/{fork['id']}")


def test_delete_is_refused_while_forks_live_and_closes_billing(api):
    source = new_sandbox(api)
    run(api, source["id"], "echo kept > /kept")
    case = f"delete-{time.monotonic_ns()}"
    snapshot = take(api, source["id"], name="to-delete", labels={"case": case})
    api.delete(f"/api/v1/sandboxes/{source['id']}")
    assert snapshot["source_sandbox"] == source["id"]
    fork = new_sandbox(api, template=None, snapshot=snapshot["id"])
    assert run(api, fork["id"], "cat /kept")["stdout"] == "kept\n"  # the source is gone, the snapshot is not

    refused = api.delete(f"/api/v1/snapshots/{snapshot['id']}")
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "snapshot_in_use" and error["details"]["forks_alive"] == 1

    usage = api.get("/api/v1/usage", params={"group_by": "size"}).json()
    assert any(line["group"] == "saved_state" and line["periods"] >= 1 for line in usage["lines"]), usage

    api.delete(f"/api/v1/sandboxes/{fork['id']}")
    deleted = api.delete(f"/api/v1/snapshots/{snapshot['id']}")
    assert deleted.status_code == 200, deleted.text
    assert deleted.json()["state"] == "deleted" and deleted.json()["deleted_at"]
    assert api.get(f"/api/v1/snapshots/{snapshot['id']}").status_code == 404
    assert snapshot["id"] not in [row["id"] for row in api.get("/api/v1/snapshots").json()["snapshots"]]
    again = api.post("/api/v1/sandboxes", json={"snapshot": snapshot["id"], "size": "tiny"})
    assert again.status_code == 404 and again.json()["error"]["code"] == "snapshot_not_found"

    # Saved-state billing stopped at the delete: its seconds no longer grow.
    billed = billed_seconds(api, case)
    assert billed > 0
    time.sleep(1.2)
    assert billed_seconds(api, case) == billed


def test_a_paused_sandbox_is_snapshotted_and_stays_paused(api):
    source = new_sandbox(api)
    try:
        run(api, source["id"], "echo frozen > /state")
        assert api.post(f"/api/v1/sandboxes/{source['id']}/pause").json()["state"] == "paused"
        snapshot = take(api, source["id"], name="from-paused")
        assert snapshot["paused_ms"] == 0  # it was paused already: the snapshot froze nothing
        assert api.get(f"/api/v1/sandboxes/{source['id']}").json()["state"] == "paused"
        assert api.post(f"/api/v1/sandboxes/{source['id']}/resume").json()["state"] == "running"
        fork = new_sandbox(api, template=None, snapshot=snapshot["id"])
        assert run(api, fork["id"], "cat /state")["stdout"] == "frozen\n"
        api.delete(f"/api/v1/sandboxes/{fork['id']}")
        assert api.delete(f"/api/v1/snapshots/{snapshot['id']}").status_code == 200
        lines = {line["group"] for line in api.get("/api/v1/usage").json()["lines"]}
        assert {"running:tiny", "paused:tiny", "saved_state"} <= lines
    finally:
        api.delete(f"/api/v1/sandboxes/{source['id']}")


def test_a_fork_whose_service_never_answers_fails_with_service_not_ready(api):
    source = new_sandbox(api)
    try:
        never = {"name": "never", "command": "sleep 600", "ready": {"tcp": 9999}, "timeout_s": 1}
        snapshot = take(api, source["id"], name="broken-service", services=[never])
    finally:
        api.delete(f"/api/v1/sandboxes/{source['id']}")
    response = api.post("/api/v1/sandboxes", json={"snapshot": snapshot["id"], "size": "tiny"})
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "service_not_ready"
    failed = api.get(f"/api/v1/sandboxes/{error['details']['sandbox']}").json()
    assert failed["state"] == "failed" and failed["error"]["code"] == "service_not_ready"
    assert api.delete(f"/api/v1/snapshots/{snapshot['id']}").status_code == 200


def test_a_service_not_waited_for_does_not_hold_a_fork_back(api):
    source = new_sandbox(api)
    try:
        never = {"name": "never", "command": "sleep 600", "ready": {"tcp": 9999}, "timeout_s": 1, "wait": False}
        snapshot = take(api, source["id"], name="unwaited-service", services=[never])
    finally:
        api.delete(f"/api/v1/sandboxes/{source['id']}")
    assert snapshot["services"][0]["wait"] is False
    response = api.post("/api/v1/sandboxes", json={"snapshot": snapshot["id"], "size": "tiny", "wait": True})
    assert response.status_code == 201 and response.json()["state"] == "running", response.text
    fork = response.json()["id"]
    waited = api.post(f"/api/v1/sandboxes/{fork}/ports/9999/wait", json={"timeout_s": 0})
    assert waited.status_code == 200 and waited.json()["listening"] is False, waited.text
    api.delete(f"/api/v1/sandboxes/{fork}")
    assert api.delete(f"/api/v1/snapshots/{snapshot['id']}").status_code == 200


def test_a_retry_with_the_same_key_takes_one_snapshot(api, web_snapshot):
    source, _ = web_snapshot
    body = {"name": "once", "idempotency_key": f"snap-key-{time.monotonic_ns()}"}
    first = api.post(f"/api/v1/sandboxes/{source['id']}/snapshot", json=body)
    second = api.post(f"/api/v1/sandboxes/{source['id']}/snapshot", json=body)
    assert (first.status_code, second.status_code) == (202, 200)
    assert first.json()["id"] == second.json()["id"]
    assert wait_snapshot(api, first.json()["id"])["state"] == "ready"
    assert api.delete(f"/api/v1/snapshots/{first.json()['id']}").status_code == 200


def test_responses_match_the_document(api, web_snapshot):
    document = httpx.get(f"{api.base_url}/api/v1/openapi.json").json()
    source, snapshot = web_snapshot
    check(document, "GET", "/api/v1/snapshots", api.get("/api/v1/snapshots"))
    check(document, "GET", "/api/v1/snapshots/{snapshot_id}", api.get(f"/api/v1/snapshots/{snapshot['id']}"))
    check(document, "GET", "/api/v1/snapshots/{snapshot_id}", api.get("/api/v1/snapshots/snap_missing"))
    taken = api.post(f"/api/v1/sandboxes/{source['id']}/snapshot", json={"name": "schema"})
    check(document, "POST", "/api/v1/sandboxes/{sandbox_id}/snapshot", taken)
    wait_snapshot(api, taken.json()["id"])
    check(document, "DELETE", "/api/v1/snapshots/{snapshot_id}", api.delete(f"/api/v1/snapshots/{taken.json()['id']}"))
    bad = api.post(f"/api/v1/sandboxes/{source['id']}/snapshot", json={"name": ""})
    check(document, "POST", "/api/v1/sandboxes/{sandbox_id}/snapshot", bad)


# --- bad input ---------------------------------------------------------------------------

SERVICE_CASES = [
    ({"name": ""}, "name"),
    ({"name": "x" * 101}, "name"),
    ({"labels": {"bad key!": "x"}}, "labels"),
    ({"services": [{**WEB, "name": "Web Server"}]}, "services.0.name"),
    ({"services": [{**WEB, "command": ""}]}, "services.0.command"),
    ({"services": [{**WEB, "ready": {}}]}, "services.0.ready"),
    ({"services": [{**WEB, "ready": {"tcp": 8080, "exec": "true"}}]}, "services.0.ready"),
    ({"services": [{**WEB, "ready": {"tcp": 0}}]}, "services.0.ready.tcp"),
    ({"services": [{**WEB, "ready": {"http": {"port": 80, "path": "no-slash"}}}]}, "services.0.ready.http.path"),
    ({"services": [{**WEB, "timeout_s": 301}]}, "services.0.timeout_s"),
    ({"services": [{"name": "web", "command": "true"}]}, "services.0.ready"),
    ({"services": [WEB, WEB]}, "services"),
    ({"services": [{**WEB, "name": f"s{index}"} for index in range(9)]}, "services"),
    ({"services": "httpd"}, "services"),
    ({"services": [{**WEB, "wait": "later"}]}, "services.0.wait"),
]


@pytest.mark.parametrize("body,field", SERVICE_CASES)
def test_bad_snapshot_requests_name_their_field(api, web_snapshot, body, field):
    source, _ = web_snapshot
    response = api.post(f"/api/v1/sandboxes/{source['id']}/snapshot", json={"name": "bad", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and error["field"] == field, error


def test_bad_references_and_counts(api, web_snapshot):
    _, snapshot = web_snapshot
    cases = [
        (api.post("/api/v1/sandboxes", json={"snapshot": "snap_nope"}), 404, "snapshot_not_found"),
        (api.post("/api/v1/launches", json={"snapshot": "snap_nope", "count": 2}), 404, "snapshot_not_found"),
        (api.post("/api/v1/launches", json={"snapshot": snapshot["id"], "count": 0}), 400, "invalid_request"),
        (api.post("/api/v1/launches", json={"snapshot": snapshot["id"], "count": 1001}), 429, "sandbox_quota_exceeded"),
        (api.post("/api/v1/launches", json={"snapshot": snapshot["id"], "count": 40001}), 400, "launch_too_large"),
        (api.get("/api/v1/snapshots/snap_nope"), 404, "snapshot_not_found"),
        (api.delete("/api/v1/snapshots/snap_nope"), 404, "snapshot_not_found"),
        (api.get("/api/v1/snapshots", params={"state": "sideways"}), 400, "invalid_request"),
        (api.get("/api/v1/snapshots", params={"before": "snap_nope"}), 404, "snapshot_not_found"),
        (api.post("/api/v1/sandboxes/sb_nope/snapshot", json={"name": "x"}), 404, "sandbox_not_found"),
    ]
    for response, status, code in cases:
        assert response.status_code == status, (response.request.url, response.text)
        assert response.json()["error"]["code"] == code, response.text


def test_a_destroyed_sandbox_cannot_be_snapshotted(api):
    sandbox = new_sandbox(api)
    api.delete(f"/api/v1/sandboxes/{sandbox['id']}")
    response = api.post(f"/api/v1/sandboxes/{sandbox['id']}/snapshot", json={"name": "late"})
    assert response.status_code == 409
    assert (
        response.json()["error"]["code"] == "sandbox_not_running" and response.json()["error"]["details"]["state"] == "destroyed"
    )


def test_another_team_never_sees_or_uses_a_snapshot(stack, team_b, web_snapshot):
    source, snapshot = web_snapshot
    with stack.client(team_b) as intruder:
        assert snapshot["id"] not in intruder.get("/api/v1/snapshots").text
        for response in (
            intruder.get(f"/api/v1/snapshots/{snapshot['id']}"),
            intruder.delete(f"/api/v1/snapshots/{snapshot['id']}"),
            intruder.post("/api/v1/sandboxes", json={"snapshot": snapshot["id"], "size": "tiny"}),
            intruder.post("/api/v1/launches", json={"snapshot": snapshot["id"], "count": 2}),
            intruder.post(f"/api/v1/sandboxes/{source['id']}/snapshot", json={"name": "stolen"}),
        ):
            assert response.status_code == 404, (response.request.url, response.text)
            assert response.json()["error"]["code"].endswith("_not_found")
    with stack.client() as owner:
        assert owner.get(f"/api/v1/snapshots/{snapshot['id']}").json()["state"] == "ready"


def test_forks_services_are_exposed_at_their_own_preview_urls(stack, api, web_snapshot):
    """Issue 12: a fork whose snapshot's service listens is exposed like any sandbox, each at its own URL."""
    _, snapshot = web_snapshot
    launch_id, forks = launch_forks(api, snapshot["id"], 2)
    try:
        urls = []
        for fork in forks:
            exposed = api.post(f"/api/v1/sandboxes/{fork['id']}/ports", json={"port": 8080, "auth": "public"})
            assert exposed.status_code == 201, exposed.text
            urls.append(exposed.json()["url"])
            address, headers = via_loopback(exposed.json()["url"] + "index.html", stack.url)
            page = httpx.get(address, headers=headers, timeout=30)
            assert page.status_code == 200 and page.text == PAGE + "\n"
        assert len(set(urls)) == 2
    finally:
        api.delete(f"/api/v1/launches/{launch_id}")
