"""No ghosts: a create whose caller saw an error is either completed and visible, or never started.

* An error the server answers (a 503) means nothing was started, and nothing
  starts later: the row is failed (and a retry with its key answers the same),
  its host's engine never holds it, and reconciliation leaves it so.
* A create whose answer was lost (the web server killed, the caller hanging
  up) is finished at once, not abandoned to start a minute later: the retry
  with its idempotency key finds it running, the only one for that key.

The forks here start a service that answers only after a few seconds, so that
each create is still in the engine when the test pulls the rug.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.root

SLOW = {"name": "slow", "command": "sleep 3; httpd -f -p 8080 -h /srv", "ready": {"tcp": 8080}, "timeout_s": 60}


@pytest.fixture(scope="module")
def slow_snapshot(stack: Any) -> Any:
    """A snapshot whose forks take a few seconds to start (their service answers late)."""
    with stack.client() as api:
        source = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 300}).json()
        api.post(f"/api/v1/sandboxes/{source['id']}/exec", json={"cmd": "mkdir -p /srv && echo up > /srv/index.html"})
        taken = api.post(f"/api/v1/sandboxes/{source['id']}/snapshot", json={"name": "slow", "services": [SLOW]})
        assert taken.status_code == 202, taken.text
        deadline = time.monotonic() + 120
        while (snapshot := api.get(f"/api/v1/snapshots/{taken.json()['id']}").json())["state"] == "creating":
            assert time.monotonic() < deadline, snapshot
            time.sleep(0.1)
        assert snapshot["state"] == "ready", snapshot
        api.delete(f"/api/v1/sandboxes/{source['id']}")
        yield snapshot["id"]
        for sandbox in api.get("/api/v1/sandboxes", params={"state": "running", "limit": 1000}).json()["sandboxes"]:
            if sandbox["snapshot"] == snapshot["id"]:
                api.delete(f"/api/v1/sandboxes/{sandbox['id']}")
        api.delete(f"/api/v1/snapshots/{snapshot['id']}")


def labelled(api: httpx.Client, tag: str) -> list[dict[str, Any]]:
    return list(api.get("/api/v1/sandboxes", params={"label": f"ghost:{tag}"}).json()["sandboxes"])


def engine_keys(stack: Any) -> set[str]:
    with stack.engine.client() as engine:
        return {record["key"] for record in engine.list() if record.get("key")}


def wait_for_row(api: httpx.Client, tag: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while not (rows := labelled(api, tag)):
        assert time.monotonic() < deadline, "the create never recorded its row"
        time.sleep(0.02)
    return rows[0]


def finished(api: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    """The retry with the create's key, followed until the sandbox settles."""
    retry = api.post("/api/v1/sandboxes", json=body)
    assert retry.status_code in (200, 202), retry.text
    sandbox: dict[str, Any] = retry.json()
    deadline = time.monotonic() + 60
    while sandbox["state"] in ("queued", "creating") and time.monotonic() < deadline:
        time.sleep(0.1)
        sandbox = api.get(f"/api/v1/sandboxes/{sandbox['id']}").json()
    return sandbox


def test_a_create_whose_web_server_died_is_finished_and_found_under_its_key(
    stack: Any, api: httpx.Client, slow_snapshot: str
) -> None:
    tag = uuid.uuid4().hex[:8]
    body = {"snapshot": slow_snapshot, "size": "tiny", "ttl_s": 120, "labels": {"ghost": tag}, "idempotency_key": f"ghost-{tag}"}
    outcome: list[Any] = []

    def caller() -> None:
        with httpx.Client(base_url=stack.url, headers=api.headers, timeout=60) as client:
            try:
                outcome.append(client.post("/api/v1/sandboxes", json=body))
            except httpx.TransportError as error:
                outcome.append(error)

    thread = threading.Thread(target=caller)
    thread.start()
    assert wait_for_row(api, tag)["state"] in ("queued", "creating")
    stack.restart_web()
    thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], httpx.TransportError), outcome
    sandbox = finished(api, body)
    assert sandbox["state"] == "running", sandbox
    assert [row["id"] for row in labelled(api, tag)] == [sandbox["id"]], "one sandbox for one key"
    ran = api.post(f"/api/v1/sandboxes/{sandbox['id']}/exec", json={"cmd": "wget -qO- http://127.0.0.1:8080/"})
    assert ran.json()["stdout"] == "up\n", ran.text
    api.delete(f"/api/v1/sandboxes/{sandbox['id']}")


def test_a_caller_that_hangs_up_mid_create_finds_it_finished_under_its_key(
    stack: Any, api: httpx.Client, slow_snapshot: str
) -> None:
    tag = uuid.uuid4().hex[:8]
    body = {"snapshot": slow_snapshot, "size": "tiny", "ttl_s": 120, "labels": {"ghost": tag}, "idempotency_key": f"ghost-{tag}"}
    with httpx.Client(base_url=stack.url, headers=api.headers, timeout=httpx.Timeout(60, read=0.5)) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/api/v1/sandboxes", json=body)
    sandbox = finished(api, body)
    assert sandbox["state"] == "running", sandbox
    assert [row["id"] for row in labelled(api, tag)] == [sandbox["id"]]
    api.delete(f"/api/v1/sandboxes/{sandbox['id']}")


def test_a_create_answered_with_an_error_never_starts(stack: Any, api: httpx.Client) -> None:
    """The web server can reach neither its host's engine nor the broker: the create is a 503, and the
    sandbox is failed for good (before, it sat "creating" until reconciliation started it behind the caller's back)."""
    unreachable = {
        "FORKYARD_ENGINE_ADDRESS": str(stack.engine.config.socket_path),  # the host's address, as its worker registered it
        "FORKYARD_ENGINE_SOCKET": str(stack.base_dir / "no-engine-here.sock"),  # ... routed by this web server to nowhere
        "CELERY_BROKER_URL": "redis://127.0.0.1:9/0",  # a broker that refuses every connection
    }
    tag = uuid.uuid4().hex[:8]
    body = {"template": "base", "size": "tiny", "ttl_s": 120, "labels": {"ghost": tag}, "idempotency_key": f"ghost-{tag}"}
    stack.restart_web(unreachable)
    try:
        refused = api.post("/api/v1/sandboxes", json=body)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "broker_unavailable"
        again = api.post("/api/v1/sandboxes", json=body)
        assert (again.status_code, again.json()["error"]["code"]) == (503, "broker_unavailable"), "a retry started it"
    finally:
        stack.restart_web()
    [row] = labelled(api, tag)
    assert row["state"] == "failed" and row["error"]["code"] == "broker_unavailable", row
    # Long enough for reconciliation to requeue a row it took for stuck, several passes over.
    stuck_after_s = float(stack.timing["FORKYARD_STUCK_AFTER_S"]) + 3 * float(stack.timing["FORKYARD_RECONCILE_S"])
    time.sleep(stuck_after_s)
    assert api.get(f"/api/v1/sandboxes/{row['id']}").json()["state"] == "failed"
    assert row["id"] not in engine_keys(stack), "its host's engine made it after all"


def test_a_launch_answered_with_an_error_never_starts(stack: Any, api: httpx.Client) -> None:
    """The broker refuses the launch's dispatch: a 503, the launch failed for good (a retry with its key answers
    the same), and none of its sandboxes is ever made, whatever reconciliation passes over it."""
    tag = uuid.uuid4().hex[:8]
    body = {
        "template": "base",
        "size": "tiny",
        "count": 3,
        "ttl_s": 120,
        "labels": {"ghost": tag},
        "idempotency_key": f"ghost-l-{tag}",
    }
    stack.restart_web({"CELERY_BROKER_URL": "redis://127.0.0.1:9/0"})  # a broker that refuses every connection
    try:
        refused = api.post("/api/v1/launches", json=body)
        assert (refused.status_code, refused.json()["error"]["code"]) == (503, "broker_unavailable"), refused.text
    finally:
        stack.restart_web()
    again = api.post("/api/v1/launches", json=body)
    assert again.status_code == 200 and again.json()["state"] == "failed", again.text
    launch = again.json()["id"]
    stuck_after_s = float(stack.timing["FORKYARD_STUCK_AFTER_S"]) + 3 * float(stack.timing["FORKYARD_RECONCILE_S"])
    time.sleep(stuck_after_s)  # several reconciliation passes: none of them starts it
    assert api.get(f"/api/v1/launches/{launch}").json()["state"] == "failed"
    members = api.get(f"/api/v1/launches/{launch}/sandboxes").json()["sandboxes"]
    assert all(member["state"] in ("failed", "destroyed", "stopped") for member in members), members
    assert not labelled(api, tag) or all(row["state"] != "running" for row in labelled(api, tag))
    assert not {member["id"] for member in members} & engine_keys(stack), "its host's engine made one after all"
