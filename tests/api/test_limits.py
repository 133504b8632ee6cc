"""429 over the rate limit or the sandbox quota, 503 without capacity or with a dependency down."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import time

import pytest

pytestmark = pytest.mark.root


def test_over_the_rate_limit_is_429_with_retry_after(stack):
    team = stack.new_team("Rate limited", requests_per_second=5)
    with stack.client(team) as client:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(lambda _: client.get("/api/v1/sandboxes"), range(40)))
        limited = [response for response in responses if response.status_code == 429]
        assert limited, "40 requests at once never hit a limit of 5 per second"
        assert all(response.status_code in (200, 429) for response in responses)
        sample = limited[0]
        assert sample.json()["error"]["code"] == "rate_limited"
        assert int(sample.headers["Retry-After"]) >= 1
        assert sample.headers["X-RateLimit-Limit"] == "5" and sample.headers["X-RateLimit-Remaining"] == "0"
        time.sleep(int(sample.headers["Retry-After"]) + 0.1)
        assert client.get("/api/v1/sandboxes").status_code == 200


def test_over_the_sandbox_quota_is_429(stack):
    team = stack.new_team("Small quota", max_sandboxes=1)
    with stack.client(team) as client:
        first = client.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny"})
        assert first.status_code == 201
        refused = client.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny"})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "sandbox_quota_exceeded"
        assert refused.headers["Retry-After"]
        too_big = client.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": 5})
        assert too_big.status_code == 429
        client.delete(f"/api/v1/sandboxes/{first.json()['id']}")
        assert client.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "wait": False}).status_code in (
            201,
            202,
        )


def test_launch_over_the_teams_maximum_is_refused(stack):
    team = stack.new_team("Launch cap", max_launch_count=10)
    with stack.client(team) as client:
        refused = client.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": 11})
        assert refused.status_code == 400 and refused.json()["error"] == {
            "code": "launch_too_large",
            "message": "count is over the team's maximum of 10 per launch",
            "field": "count",
            "details": {"limit": 10},
        }
        zero = client.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": 0})
        assert zero.status_code == 400 and zero.json()["error"]["field"] == "count"


def test_no_capacity_is_503_with_retry_after(stack, api):
    stack.shell(f"from sandboxes.models import Host; Host.objects.filter(name={stack.host_name!r}).update(state='draining')")
    try:
        refused = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_capacity"
        assert int(refused.headers["Retry-After"]) > 0
        assert api.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": 2}).status_code == 503
    finally:
        stack.shell(f"from sandboxes.models import Host; Host.objects.filter(name={stack.host_name!r}).update(state='online')")
    assert api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "wait": False}).status_code in (201, 202)


def test_a_dependency_down_is_503_and_the_api_recovers(stack, api):
    """The broker's directory (embedded) or the database (postgres) taken away, then given back."""
    if stack.backend == "postgres":
        stack._postgres(f'ALTER DATABASE "{stack.database}" ALLOW_CONNECTIONS false')
        stack._postgres(
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{stack.database}' AND pid <> pg_backend_pid()"
        )
        try:
            down = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny"})
        finally:
            stack._postgres(f'ALTER DATABASE "{stack.database}" ALLOW_CONNECTIONS true')
    else:
        queue = stack.base_dir / "web" / "broker" / "queue"
        aside = queue.with_name("queue-aside")
        os.rename(queue, aside)
        queue.write_text("not a directory")
        try:
            # A create that waits goes to the engine directly and needs no broker
            # (checked below); one that does not wait is queued, and is refused.
            direct = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny"})
            assert direct.status_code == 201, direct.text
            api.delete(f"/api/v1/sandboxes/{direct.json()['id']}", params={"wait": False})
            down = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "wait": False})
        finally:
            queue.unlink()
            os.rename(aside, queue)
    assert down.status_code == 503, down.text
    assert down.json()["error"]["code"] in ("dependency_unavailable", "broker_unavailable")
    assert int(down.headers["Retry-After"]) > 0
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        back = api.get("/api/v1/me")
        if back.status_code == 200:
            break
        time.sleep(0.3)
    assert back.status_code == 200
    created = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny"})
    assert created.status_code == 201, created.text
    api.delete(f"/api/v1/sandboxes/{created.json()['id']}")
    shutil.rmtree(stack.base_dir / "nothing", ignore_errors=True)
