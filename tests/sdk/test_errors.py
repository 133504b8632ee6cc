"""Typed errors and tenant isolation, from the real API."""

from __future__ import annotations

import time

import pytest

from forkyard import (
    Client,
    Conflict,
    Forbidden,
    ForkyardError,
    InvalidRequest,
    NotFound,
    RateLimited,
    RetryPolicy,
    Sandbox,
    Unauthorized,
    Unavailable,
)
from tests.support.stack import Stack

pytestmark = pytest.mark.root


def test_not_found_names_the_object_and_the_region(fy: Client) -> None:
    with pytest.raises(NotFound) as raised:
        fy.sandboxes.get("sb_does_not_exist")
    error = raised.value
    assert (error.status, error.code) == (404, "sandbox_not_found")
    assert "sb_does_not_exist" in error.message and error.region == "test-region-1"
    with pytest.raises(NotFound, match="template"):
        fy.sandboxes.create(template="no-such-template", size="tiny")
    with pytest.raises(NotFound):
        fy.launches.get("launch_nope")
    with pytest.raises(NotFound):
        fy.templates.get("no-such-template")


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"size": "enormous"}, "size"),
        ({"size": "tiny", "ttl_s": 0}, "ttl_s"),
        ({"size": "tiny", "cpu": 1.0}, "size"),
        ({"size": "tiny", "labels": {"bad key!": "x"}}, "labels"),
    ],
)
def test_invalid_requests_name_the_field(fy: Client, options: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest) as raised:
        fy.sandboxes.create(template="base", **options)  # type: ignore[arg-type]
    assert raised.value.status == 400 and raised.value.field == field, raised.value


def test_invalid_launch_and_exec(fy: Client, sb: Sandbox) -> None:
    with pytest.raises(InvalidRequest) as raised:
        fy.launches.create(template="base", size="tiny", count=0)
    assert raised.value.field == "count"
    with pytest.raises(InvalidRequest) as raised:
        sb.exec("true", timeout_s=-1)
    assert raised.value.field == "timeout_s"


def test_conflict_on_a_sandbox_that_is_not_running(fy: Client) -> None:
    sandbox = fy.sandboxes.create(template="base", size="tiny", ttl_s=60)
    sandbox.kill()
    for action in (lambda: sandbox.exec("true"), lambda: sandbox.files.read("/etc/hostname"), sandbox.pause):
        with pytest.raises(Conflict) as raised:
            action()
        assert (raised.value.status, raised.value.code) == (409, "sandbox_not_running")


def test_unauthorized_and_forbidden(stack: Stack, fy: Client) -> None:
    with Client(stack.url, "fy_not_a_real_key") as stranger, pytest.raises(Unauthorized) as raised:
        stranger.me()
    assert raised.value.status == 401 and raised.value.code == "unauthorized"

    member = fy.keys.create("sdk-member", role="member")
    assert member.secret and member.key.role == "member"
    assert member.key.id in [key.id for key in fy.keys.list()]
    with Client(stack.url, member.secret) as as_member:
        assert as_member.me().role == "member"
        with pytest.raises(Forbidden) as forbidden:
            as_member.keys.create("escalate", role="admin")
        assert forbidden.value.status == 403
        assert fy.keys.revoke(member.key.id).revoked_at is not None
        with pytest.raises(Unauthorized):
            as_member.me()


def test_team_b_cannot_see_or_touch_team_a(fy: Client, fy_b: Client, sb: Sandbox) -> None:
    launch = fy.launches.create(template="base", size="tiny", count=2, ttl_s=60)
    try:
        foreign = fy_b.sandboxes.ref(sb.id)
        for action in (
            lambda: fy_b.sandboxes.get(sb.id),
            lambda: foreign.exec("id"),
            lambda: foreign.files.read("/etc/hostname"),
            lambda: foreign.files.write("/tmp/x", b"x"),
            foreign.pause,
            lambda: foreign.snapshot(name="stolen"),
            lambda: fy_b.sandboxes.kill(sb.id),
            lambda: fy_b.launches.get(launch.id),
            lambda: fy_b.launches.kill(launch.id),
        ):
            with pytest.raises(NotFound):
                action()
        assert sb.id not in {sandbox.id for sandbox in fy_b.sandboxes.list_all()}
        assert launch.id not in {item.id for item in fy_b.launches.list()}
        assert sb.refresh().state == "running" and sb.exec("echo mine").stdout == "mine\n"
    finally:
        launch.kill()


def test_quota_is_rate_limited_with_retry_after(fy: Client, stack: Stack) -> None:
    """Over the team's sandbox quota the API answers 429 with Retry-After: the SDK waits that long before its retry."""
    too_many = fy.me().limits.max_sandboxes + 1
    with Client(stack.url, stack.teams[0].key, max_retries=0) as impatient, pytest.raises(RateLimited) as raised:
        impatient.launches.create(template="base", size="tiny", count=too_many)
    error = raised.value
    assert (
        error.code == "sandbox_quota_exceeded" and error.status == 429 and error.retry_after is not None and error.retry_after > 0
    )

    with Client(stack.url, stack.teams[0].key, retry=RetryPolicy(max_retries=1, budget_s=30)) as patient:
        started = time.monotonic()
        with pytest.raises(RateLimited):
            patient.launches.create(template="base", size="tiny", count=too_many)
        assert time.monotonic() - started >= error.retry_after * 0.9


def test_unreachable_server_is_unavailable() -> None:
    with Client("http://127.0.0.1:9", "fy_key", retry=RetryPolicy(max_retries=1, backoff_s=0.01)) as nowhere:
        with pytest.raises(Unavailable) as raised:
            nowhere.me()
    assert raised.value.code == "connection_failed" and raised.value.status is None
    assert isinstance(raised.value, ForkyardError)
