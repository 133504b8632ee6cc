"""Dedicated endpoints: a model server on the host, supervised by the engine (restarted when it dies),
billed per second while it runs, and gone (process, route, billing) once deleted."""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest

from tests.support.grading import TINY, deploy, wait_endpoint

pytestmark = pytest.mark.root


def _server_pid(stack, endpoint_id: str) -> int:
    with stack.engine.client() as engine:
        servers = {server["id"]: server for server in engine.call("model_servers.list")["servers"]}
    return int(servers[endpoint_id]["pid"]) if endpoint_id in servers else 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split(") ", 1)[1].startswith("Z")


def test_an_endpoint_is_restarted_when_its_server_dies_and_gone_once_deleted(stack, tiny_model):
    team = stack.new_team("Endpoint owner")
    with stack.client(team) as api:
        endpoint = deploy(api, "supervised")
        assert endpoint["server"] == "llama_cpp" and endpoint["host"] == stack.host_name
        pid = _server_pid(stack, endpoint["id"])
        assert pid and _alive(pid)
        assert open(f"/proc/{pid}/status").read().split("Uid:")[1].split()[0] != "0", "the server does not serve as root"
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60  # a guard against a hang, not a measure
        while True:
            current = api.get(f"/api/v1/endpoints/{endpoint['id']}").json()
            new_pid = _server_pid(stack, endpoint["id"])
            if current["restarts"] >= 1 and current["state"] == "ready" and new_pid not in (0, pid):
                break
            assert time.monotonic() < deadline, current
            time.sleep(0.3)
        client = openai.OpenAI(base_url=f"{stack.url}/api/v1/inference", api_key=team.key, max_retries=0)
        answer = client.chat.completions.create(model="supervised", messages=[{"role": "user", "content": "back?"}], max_tokens=4)
        assert answer.usage is not None and answer.usage.completion_tokens > 0
        # Billed while it runs: an open period of the endpoint's kind, named by its model.
        usage = api.get("/api/v1/usage").json()
        line = next(line for line in usage["lines"] if line["group"] == f"endpoint:{TINY}")
        assert line["seconds"] > 0 and line["periods"] == 1

        deleted = api.delete(f"/api/v1/endpoints/{endpoint['id']}")
        assert deleted.status_code == 200 and deleted.json()["state"] in ("stopping", "deleted")
        wait_endpoint(api, endpoint["id"], ("deleted",))
        assert not _alive(new_pid), "its server is gone from the host"
        assert _server_pid(stack, endpoint["id"]) == 0, "and from the engine's record"
        deadline = time.monotonic() + 10
        while "supervised" in [model.id for model in client.models.list()]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        closed = stack.shell(
            "from billing.models import UsagePeriod; "
            f"print(UsagePeriod.objects.filter(endpoint_id={endpoint['id']!r}, ended_at__isnull=True).count(), "
            f"UsagePeriod.objects.filter(endpoint_id={endpoint['id']!r}).count())"
        ).strip().splitlines()[-1]
        assert closed == "0 1", "one period, closed at the delete"
        again = api.delete(f"/api/v1/endpoints/{endpoint['id']}")
        assert again.status_code == 200 and again.json()["state"] == "deleted", "deleting twice is done"


def test_an_endpoint_of_a_model_nobody_offers_is_refused(api):
    refused = api.post("/api/v1/endpoints", json={"model": "no-such-model"})
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
    offered = api.get("/api/v1/endpoint-models").json()["models"]
    assert all(set(model) == {"name", "server", "context_length", "description"} for model in offered), "no host path shown"
