"""Leases through the real API: sandboxes that live only while their client heartbeats, and labels that change.

The stack's host agent reconciles every second (``tests/support/stack.py``,
``FORKYARD_RECONCILE_S``), so a lease of a few seconds' grace expires within
a few passes; the tests wait for states with a generous guard, never for a time.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import httpx
import pytest

from tests.support.stack import wait_for_launch, wait_for_sandboxes

pytestmark = pytest.mark.root


def take(api: httpx.Client, grace_s: int) -> dict[str, Any]:
    lease = api.post("/api/v1/leases", json={"grace_s": grace_s})
    assert lease.status_code == 201, lease.text
    return lease.json()


def create(api: httpx.Client, lease: str | None = None, **extra: Any) -> httpx.Response:
    body = {"template": "base", "size": "tiny", "ttl_s": 300, **({"lease": lease} if lease else {}), **extra}
    return api.post("/api/v1/sandboxes", json=body)


def states(api: httpx.Client, sandbox_ids: list[str]) -> dict[str, str]:
    return {sandbox_id: api.get(f"/api/v1/sandboxes/{sandbox_id}").json()["state"] for sandbox_id in sandbox_ids}


def test_a_lease_is_taken_read_listed_and_heartbeaten(api: httpx.Client) -> None:
    lease = take(api, 30)
    assert lease["id"].startswith("ls_") and lease["state"] == "active" and lease["grace_s"] == 30
    assert lease["sandboxes_alive"] == 0 and lease["ended_at"] is None
    assert api.get(f"/api/v1/leases/{lease['id']}").json() == lease
    assert lease["id"] in [item["id"] for item in api.get("/api/v1/leases", params={"state": "active"}).json()["leases"]]
    time.sleep(0.05)
    beaten = api.post(f"/api/v1/leases/{lease['id']}/heartbeat")
    assert beaten.status_code == 200, beaten.text
    assert datetime.fromisoformat(beaten.json()["expires_at"]) > datetime.fromisoformat(lease["expires_at"])
    assert beaten.json()["heartbeat_at"] > lease["heartbeat_at"]
    assert api.post("/api/v1/leases", json={"grace_s": 60}).json()["grace_s"] == 60
    assert api.post("/api/v1/leases", json={}).json()["grace_s"] == 60, "60 s unless asked"
    for grace_s in (0, 3601, "soon"):
        refused = api.post("/api/v1/leases", json={"grace_s": grace_s})
        assert refused.status_code == 400 and refused.json()["error"]["field"] == "grace_s", refused.text
    unknown = api.post("/api/v1/leases", json={"grace": 5})
    assert unknown.status_code == 400 and unknown.json()["error"]["field"] == "grace"
    ended = api.delete(f"/api/v1/leases/{lease['id']}")
    assert ended.status_code == 200 and ended.json()["state"] == "ended" and ended.json()["ended_at"]
    assert api.delete(f"/api/v1/leases/{lease['id']}").json()["state"] == "ended", "ending twice is harmless"
    refused = api.post(f"/api/v1/leases/{lease['id']}/heartbeat")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "lease_ended"


def test_sandboxes_of_a_lease_whose_heartbeats_stop_are_destroyed(api: httpx.Client, stack: Any) -> None:
    lease = take(api, 4)
    made = [create(api, lease["id"], labels={"leased": lease["id"]}) for _ in range(2)]
    assert all(answer.status_code == 201 for answer in made), [answer.text for answer in made]
    ids = [answer.json()["id"] for answer in made]
    assert {answer.json()["lease"] for answer in made} == {lease["id"]}
    launched = api.post(
        "/api/v1/launches", json={"template": "base", "size": "tiny", "count": 3, "ttl_s": 300, "lease": lease["id"]}
    )
    assert launched.status_code == 201 and launched.json()["lease"] == lease["id"], launched.text
    unleased = create(api).json()["id"]
    try:
        # Heartbeats, each well within the grace, keep everything alive past the grace period.
        until = time.monotonic() + 6
        while time.monotonic() < until:
            assert api.post(f"/api/v1/leases/{lease['id']}/heartbeat").status_code == 200
            time.sleep(0.5)
        assert set(states(api, ids).values()) == {"running"}, "a heartbeaten lease lost its sandboxes"
        assert api.get(f"/api/v1/leases/{lease['id']}").json()["sandboxes_alive"] == 5
        # Then none: the lease expires and takes them all, the launch's too.
        assert set(wait_for_sandboxes(api, ids).values()) == {"destroyed"}
        expired = api.get(f"/api/v1/leases/{lease['id']}").json()
        assert expired["state"] == "expired" and expired["ended_at"] == expired["expires_at"], expired
        launch = wait_for_launch(api, launched.json()["id"], {"stopped"})
        assert launch["progress"]["ended"] == 3
        assert states(api, [unleased]) == {unleased: "running"}, "a sandbox of no lease went with it"
        with stack.engine.client() as engine:
            assert not [record for record in engine.list() if record.get("key") in ids]
        beat = api.post(f"/api/v1/leases/{lease['id']}/heartbeat")
        assert beat.status_code == 409 and beat.json()["error"]["code"] == "lease_expired", "an expired lease came back"
        before = api.get("/api/v1/sandboxes", params={"label": f"leased={lease['id']}"}).json()["sandboxes"]
        late = create(api, lease["id"], labels={"leased": lease["id"]})
        assert late.status_code == 409 and late.json()["error"]["code"] == "lease_expired", late.text
        assert late.json()["error"]["field"] == "lease"
        after = api.get("/api/v1/sandboxes", params={"label": f"leased={lease['id']}"}).json()["sandboxes"]
        assert len(after) == len(before), "a refused create made a sandbox"
    finally:
        api.delete(f"/api/v1/sandboxes/{unleased}")
        api.delete(f"/api/v1/launches/{launched.json()['id']}")


def test_ending_a_lease_destroys_its_sandboxes_at_once(api: httpx.Client) -> None:
    lease = take(api, 600)
    sandbox = create(api, lease["id"]).json()
    queued = create(api, lease["id"], wait=False).json()
    ended = api.delete(f"/api/v1/leases/{lease['id']}")
    assert ended.status_code == 200 and ended.json()["state"] == "ended"
    assert set(wait_for_sandboxes(api, [sandbox["id"], queued["id"]]).values()) == {"destroyed"}
    assert api.get(f"/api/v1/leases/{lease['id']}").json()["sandboxes_alive"] == 0
    refused = create(api, lease["id"])
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "lease_ended"


def test_another_teams_lease_is_not_found(api: httpx.Client, stack: Any, team_b: Any) -> None:
    lease = take(api, 600)
    try:
        with stack.client(team_b) as intruder:
            for method, path in (("GET", ""), ("POST", "/heartbeat"), ("DELETE", "")):
                answer = intruder.request(method, f"/api/v1/leases/{lease['id']}{path}")
                assert answer.status_code == 404 and answer.json()["error"]["code"] == "lease_not_found", answer.text
            named = create(intruder, lease["id"])
            assert named.status_code == 404 and named.json()["error"]["code"] == "lease_not_found"
            assert named.json()["error"]["field"] == "lease"
            assert lease["id"] not in [item["id"] for item in intruder.get("/api/v1/leases").json()["leases"]]
        assert api.get(f"/api/v1/leases/{lease['id']}").json()["state"] == "active"
    finally:
        api.delete(f"/api/v1/leases/{lease['id']}")


def test_a_sandboxs_labels_are_replaced_and_checked_like_a_creates(api: httpx.Client) -> None:
    sandbox = create(api, labels={"phase": "warmup", "run": "7"}).json()
    try:
        changed = api.patch(f"/api/v1/sandboxes/{sandbox['id']}", json={"labels": {"phase": "train"}})
        assert changed.status_code == 200 and changed.json()["labels"] == {"phase": "train"}, changed.text
        assert api.get(f"/api/v1/sandboxes/{sandbox['id']}").json()["labels"] == {"phase": "train"}
        listed = api.get("/api/v1/sandboxes", params={"label": "phase:train"}).json()["sandboxes"]
        assert sandbox["id"] in [item["id"] for item in listed]
        assert api.patch(f"/api/v1/sandboxes/{sandbox['id']}", json={}).json()["labels"] == {"phase": "train"}
        for body, field in (
            ({"labels": {"bad key!": "x"}}, "labels"),
            ({"labels": {"k": "v" * 256}}, "labels"),
            ({"labels": {f"k{index}": "v" for index in range(65)}}, "labels"),
            ({"ttl_s": 0}, "ttl_s"),
            ({"idle_timeout_s": -1}, "idle_timeout_s"),
            ({"ttl": 600}, "ttl"),
        ):
            refused = api.patch(f"/api/v1/sandboxes/{sandbox['id']}", json=body)
            assert refused.status_code == 400 and refused.json()["error"]["field"] == field, refused.text
        assert api.patch("/api/v1/sandboxes/sb_0000000000000000", json={"labels": {}}).status_code == 404
    finally:
        api.delete(f"/api/v1/sandboxes/{sandbox['id']}")


def test_a_launch_member_keeps_its_launch_label(api: httpx.Client) -> None:
    launched = api.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": 1, "ttl_s": 120})
    launch = wait_for_launch(api, launched.json()["id"], {"ready"})
    member = api.get(f"/api/v1/launches/{launch['id']}/sandboxes").json()["sandboxes"][0]
    try:
        changed = api.patch(f"/api/v1/sandboxes/{member['id']}", json={"labels": {"launch": "mine", "x": "y"}})
        assert changed.json()["labels"] == {"launch": launch["id"], "x": "y"}
    finally:
        api.delete(f"/api/v1/launches/{launch['id']}")


def test_a_label_with_a_nul_is_refused_and_wildcards_match_only_themselves(api: httpx.Client) -> None:
    """A label filter is taken literally (``%`` and ``_`` are no LIKE wildcards), and a NUL, which no
    database column holds (PostgreSQL refuses it in text and jsonb), is a 400 naming the field, never a 500."""
    sandbox = create(api, labels={"pct": "a%", "under": "b_c"}).json()
    try:
        for label in ("pct:%", "pct:a_", "under:b%", "under:b__"):
            listed = api.get("/api/v1/sandboxes", params={"label": label})
            assert listed.status_code == 200 and listed.json()["sandboxes"] == [], (label, listed.text)
        for label in ("pct:a%", "under:b_c"):
            assert [item["id"] for item in api.get("/api/v1/sandboxes", params={"label": label}).json()["sandboxes"]] == [
                sandbox["id"]
            ]
        for label in ("a\x00b:x", "pct:a%\x00", "pct\x00"):
            for answer in (
                api.get("/api/v1/sandboxes", params={"label": label}),
                api.delete("/api/v1/sandboxes", params={"label": label}),
                api.post("/api/v1/exec", json={"label": label, "cmd": "true"}),
            ):
                assert answer.status_code == 400, (label, answer.request.method, answer.text)
                assert answer.json()["error"]["field"] == "label", answer.text
        refused = create(api, labels={"k": "v\x00"})
        assert refused.status_code == 400 and refused.json()["error"]["field"] == "labels", refused.text
        refused = api.patch(f"/api/v1/sandboxes/{sandbox['id']}", json={"labels": {"k": "v\x00"}})
        assert refused.status_code == 400 and refused.json()["error"]["field"] == "labels", refused.text
        assert api.get(f"/api/v1/sandboxes/{sandbox['id']}").json()["state"] == "running"
    finally:
        api.delete(f"/api/v1/sandboxes/{sandbox['id']}")
