"""The fast path for one create: the web server asks the engine itself, and whatever goes wrong on the way is finished by the host's queue."""

from __future__ import annotations

import json
import time

import pytest

pytestmark = pytest.mark.root


def _state(api, sandbox_id: str) -> dict:
    return api.get(f"/api/v1/sandboxes/{sandbox_id}").json()


def test_a_create_whose_caller_died_half_way_is_finished_by_reconciliation(stack, api) -> None:
    """The row is recorded "creating" for the caller, who dies before asking the engine:
    the host agent queues it again once it is stuck, and it runs."""
    team = stack.teams[0]
    out = stack.shell(
        "from console.models import ApiKey; from sandboxes.schemas import SandboxCreate;"
        " from sandboxes.services.sandboxes import sandbox_create;"
        f" key = ApiKey.objects.filter(team_id='{team.team_id}').first();"
        " spec = SandboxCreate.model_validate({'template': 'base', 'size': 'tiny', 'ttl_s': 120});"
        " sandbox, _ = sandbox_create(team=key.team, key=key, spec=spec, direct=True);"
        " print('ID', sandbox.id, sandbox.state)"
    )
    sandbox_id, state = out.split("ID ", 1)[1].split()
    assert state == "creating", "claimed for the direct path: nothing queued"
    deadline = time.monotonic() + 30
    while _state(api, sandbox_id)["state"] != "running" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _state(api, sandbox_id)["state"] == "running"
    assert api.post(f"/api/v1/sandboxes/{sandbox_id}/exec", json={"cmd": "echo finished"}).json()["stdout"] == "finished\n"
    api.delete(f"/api/v1/sandboxes/{sandbox_id}")


def test_a_create_that_does_not_wait_is_queued(stack, api) -> None:
    created = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 120, "wait": False})
    assert created.status_code == 202 and created.json()["state"] == "queued", created.text
    deadline = time.monotonic() + 30
    while _state(api, created.json()["id"])["state"] != "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _state(api, created.json()["id"])["state"] == "running"
    api.delete(f"/api/v1/sandboxes/{created.json()['id']}")


def test_a_direct_create_is_billed_from_the_engine_ready_time(stack, api) -> None:
    created = api.post(
        "/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 120, "labels": {"direct": "billed"}}
    )
    assert created.status_code == 201 and created.json()["state"] == "running"
    api.delete(f"/api/v1/sandboxes/{created.json()['id']}")
    usage = api.get("/api/v1/usage", params={"group_by": "label:direct"}).json()
    line = next(line for line in usage["lines"] if line["group"] == "billed")
    assert line["periods"] == 1 and 0 < line["seconds"] < 30, json.dumps(usage)
