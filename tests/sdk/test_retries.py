"""The retry policy, with answers scripted by ``httpx.MockTransport``.

Why not the real stack here: the server cannot be made, on demand and on
time, to answer a 503 with a chosen Retry-After, to drop a connection after
reading a request, or to fail exactly the first N attempts.  These tests pin
down what the SDK does then: which calls it repeats, how long it waits, and
that a repeated create carries the same idempotency key.  The 429 path is also
exercised against the real server in test_errors.py (the sandbox quota).

How long the SDK waits is read from the waits it asks for (a fake clock in place
of the one ``forkyard._http`` sleeps and measures its budget with), not from a
wall clock that a loaded machine stretches.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

import forkyard._http
from forkyard import (
    AsyncClient,
    Client,
    ConfigurationError,
    Conflict,
    InvalidRequest,
    NoCapacity,
    RateLimited,
    RetryPolicy,
    ServerError,
    Unavailable,
)
from forkyard.errors import error_from_response, parse_retry_after

SANDBOX = {"id": "sb_1", "state": "running", "host": "h", "region": "r", "template": "base", "labels": {}}
EXEC = {"exit_code": 0, "stdout": "ok\n", "stderr": "", "duration_ms": 1.0, "timed_out": False}
FAST = RetryPolicy(max_retries=3, backoff_s=0.01, max_backoff_s=0.02, max_retry_after_s=0.5, budget_s=5)


def error(status: int, code: str, retry_after: str | None = None, **extra: object) -> httpx.Response:
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    return httpx.Response(status, json={"error": {"code": code, "message": f"{code} happened", **extra}}, headers=headers)


class Script:
    """Answers requests from a list, in order, and records what was asked."""

    def __init__(self, *answers: httpx.Response | Exception) -> None:
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def client(self, retry: RetryPolicy = FAST) -> Client:
        # Through the API only: a sandbox known by its id would first be looked up for its data path
        # (tests/sdk/test_direct.py), an answer these scripts do not hold.
        return Client("http://forkyard.test", "fy_key", retry=retry, transport=httpx.MockTransport(self), direct=False)

    def bodies(self) -> list[dict[str, object]]:
        return [json.loads(request.content) for request in self.requests]


class Clock:
    """Stands in for the ``time`` module of ``forkyard._http``: its sleeps are recorded and move the clock at once."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(forkyard._http, "time", fake)
    return fake


def test_503_on_a_get_waits_for_retry_after(clock: Clock) -> None:
    script = Script(error(503, "dependency_unavailable", retry_after="0.3"), httpx.Response(200, json=SANDBOX))
    assert script.client().sandboxes.get("sb_1").id == "sb_1"
    assert len(script.requests) == 2 and clock.sleeps == [0.3]


def test_retry_after_is_capped(clock: Clock) -> None:
    script = Script(error(429, "rate_limited", retry_after="3600"), httpx.Response(200, json=SANDBOX))
    script.client(RetryPolicy(max_retries=2, max_retry_after_s=0.2)).sandboxes.get("sb_1")
    assert len(script.requests) == 2 and clock.sleeps == [0.2]


def test_the_total_budget_bounds_the_waits(clock: Clock) -> None:
    script = Script(*[error(503, "unavailable", retry_after="0.2") for _ in range(10)])
    with pytest.raises(Unavailable) as raised:
        script.client(RetryPolicy(max_retries=10, max_retry_after_s=1, budget_s=0.5)).sandboxes.get("sb_1")
    # Waits of 0.2 s while they fit in 0.5 s: two (0.4 s), then the third failure is raised.
    assert clock.sleeps == [0.2, 0.2] and len(script.requests) == 3
    assert raised.value.retry_after == pytest.approx(0.2)


def test_backoff_without_retry_after_stays_within_its_bounds(clock: Clock) -> None:
    script = Script(*[httpx.ConnectError("refused") for _ in range(4)], httpx.Response(200, json=SANDBOX))
    policy = RetryPolicy(max_retries=5, backoff_s=0.1, max_backoff_s=0.3, budget_s=60)
    assert script.client(policy).sandboxes.get("sb_1").id == "sb_1"
    assert len(clock.sleeps) == 4 and len(script.requests) == 5
    # Full jitter: attempt n waits anywhere in [0, min(0.3, 0.1 * 2**n)].
    assert all(0 <= slept <= min(0.3, 0.1 * 2**attempt) for attempt, slept in enumerate(clock.sleeps)), clock.sleeps


def test_max_retries_zero_disables_retries() -> None:
    script = Script(error(503, "unavailable", retry_after="0"))
    with pytest.raises(Unavailable):
        script.client(RetryPolicy(max_retries=0)).sandboxes.get("sb_1")
    assert len(script.requests) == 1
    script = Script(error(429, "rate_limited", retry_after="0"))
    with pytest.raises(RateLimited):
        Client("http://forkyard.test", "fy_key", max_retries=0, transport=httpx.MockTransport(script)).me()
    assert len(script.requests) == 1


def test_create_is_retried_with_one_idempotency_key() -> None:
    script = Script(error(503, "no_capacity", retry_after="0"), httpx.ConnectError("refused"), httpx.Response(201, json=SANDBOX))
    sandbox = script.client().sandboxes.create(template="base", size="tiny")
    assert sandbox.id == "sb_1" and len(script.requests) == 3
    keys = {body["idempotency_key"] for body in script.bodies()}
    assert len(keys) == 1 and str(keys.pop()).startswith("sdk-sandbox-")


def test_a_given_idempotency_key_is_kept_and_launches_get_one_too() -> None:
    script = Script(httpx.Response(201, json=SANDBOX))
    script.client().sandboxes.create(template="base", idempotency_key="mine")
    assert script.bodies()[0]["idempotency_key"] == "mine"
    launch = {"id": "launch_1", "state": "creating", "count": 2, "progress": {"requested": 2, "queued": 2}}
    script = Script(httpx.ReadError("lost"), httpx.Response(201, json=launch))
    script.client().launches.create(template="base", count=2)
    first, second = script.bodies()
    assert first == second and str(first["idempotency_key"]).startswith("sdk-launch-") and first["count"] == 2


def test_no_capacity_is_typed_and_retried_for_creates() -> None:
    script = Script(*[error(503, "no_capacity", retry_after="0") for _ in range(4)])
    with pytest.raises(NoCapacity) as raised:
        script.client().sandboxes.create(template="base")
    assert isinstance(raised.value, Unavailable) and len(script.requests) == 4


def test_a_create_that_failed_on_its_host_is_not_retried() -> None:
    """The API recorded the sandbox as failed: a retry with the same key would only return it."""
    script = Script(error(503, "spawn_failed", retry_after="5", details={"sandbox": "sb_1"}))
    with pytest.raises(Unavailable) as raised:
        script.client().sandboxes.create(template="base")
    assert raised.value.code == "spawn_failed" and len(script.requests) == 1


def test_exec_is_not_repeated_after_a_503_or_a_lost_answer() -> None:
    """An exec is not idempotent: once the request may have run, the SDK does not run it again."""
    for failure in (error(503, "host_unavailable", retry_after="0"), httpx.ReadError("connection reset")):
        script = Script(failure, httpx.Response(200, json=EXEC))
        sandbox = script.client().sandboxes.ref("sb_1")
        with pytest.raises(Unavailable):
            sandbox.exec("touch /once")
        assert len(script.requests) == 1


def test_exec_is_retried_when_it_was_never_run() -> None:
    """A 429 is answered before anything runs, and a refused connection sent nothing: both are safe to repeat."""
    script = Script(error(429, "rate_limited", retry_after="0.05"), httpx.ConnectError("refused"), httpx.Response(200, json=EXEC))
    result = script.client().sandboxes.ref("sb_1").exec("echo ok")
    assert result.stdout == "ok\n" and len(script.requests) == 3


def test_a_streamed_upload_is_never_sent_twice() -> None:
    script = Script(error(503, "unavailable", retry_after="0"), httpx.Response(200, json={"path": "/x", "bytes": 3}))
    with pytest.raises(Unavailable):
        script.client().sandboxes.ref("sb_1").files.write("/x", iter([b"abc"]))
    assert len(script.requests) == 1


def test_errors_are_typed_without_json() -> None:
    script = Script(
        httpx.Response(502, text="<html>bad gateway</html>"),
        httpx.Response(500, text="oops"),
        httpx.Response(422, json={"error": {"code": "invalid_request", "message": "m", "field": "cmd"}}),
    )
    client = script.client(RetryPolicy(max_retries=0))
    with pytest.raises(Unavailable) as gateway:
        client.me()
    assert gateway.value.code == "http_502" and "bad gateway" in gateway.value.message
    with pytest.raises(ServerError):
        client.me()
    with pytest.raises(InvalidRequest) as invalid:
        client.me()
    assert invalid.value.field == "cmd"


def test_async_client_retries_the_same_way() -> None:
    async def scenario() -> tuple[str, int]:
        script = Script(
            error(503, "unavailable", retry_after="0.1"), httpx.ConnectError("refused"), httpx.Response(200, json=SANDBOX)
        )
        async with AsyncClient("http://forkyard.test", "fy_key", retry=FAST, transport=httpx.MockTransport(script)) as fy:
            sandbox = await fy.sandboxes.get("sb_1")
        return sandbox.id, len(script.requests)

    assert asyncio.run(scenario()) == ("sb_1", 3)


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"team": "t"})

    monkeypatch.setenv("FORKYARD_URL", "http://env.test/api/v1/")
    monkeypatch.setenv("FORKYARD_API_KEY", "fy_from_env")
    Client(transport=httpx.MockTransport(answer)).me()
    assert str(seen[0].url) == "http://env.test/api/v1/me" and seen[0].headers["Authorization"] == "Bearer fy_from_env"
    monkeypatch.delenv("FORKYARD_API_KEY")
    with pytest.raises(ConfigurationError):
        Client()


@pytest.mark.parametrize(("header", "seconds"), [("2", 2.0), ("0.5", 0.5), (None, None), ("soon", None)])
def test_parse_retry_after(header: str | None, seconds: float | None) -> None:
    assert parse_retry_after(header) == seconds


def test_parse_retry_after_http_date() -> None:
    later = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    value = parse_retry_after(later)
    assert value is not None and 25 <= value <= 31


def test_error_from_response_keeps_details() -> None:
    failure = error_from_response(
        409,
        {"X-Forkyard-Region": "eu-1", "Retry-After": "3"},
        b'{"error": {"code": "sandbox_not_running", "message": "m", "details": {"state": "paused"}}}',
    )
    assert isinstance(failure, Conflict)
    assert (failure.region, failure.retry_after, failure.details) == ("eu-1", 3.0, {"state": "paused"})
