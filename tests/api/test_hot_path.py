"""The API's hot path (``sandboxes.api.hot_path``) answers exactly as the views would.

A well-formed exec, file read or small file write is answered without
Django's request machinery; everything else goes on to the view. Each test
asks the stack's web server (hot path on) and a second web server on the same
stack with it off (``FORKYARD_HOT_PATH=0``: every request through its view)
the same thing, and the answers must match: status, body, and the API's
headers. A key and a sandbox's place are remembered for a moment, so the
tests also change them under the hot path: a sandbox paused or destroyed, a
key revoked.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.root

API_HEADERS = {"content-type", "x-forkyard-region", "x-request-id", "x-content-type-options", "x-ratelimit-limit"}


@pytest.fixture(scope="module")
def view_only(stack: Any) -> Iterator[httpx.Client]:
    """Team A's client on a web server whose hot path is off."""
    url = stack.start_view_only_web()
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {stack.teams[0].key}"}, timeout=60) as client:
        yield client


def ask_both(
    api: httpx.Client, view_only: httpx.Client, method: str, url: str, **request: Any
) -> tuple[httpx.Response, httpx.Response]:
    request_id = f"same-{uuid.uuid4().hex[:8]}"
    headers = {**request.pop("headers", {}), "X-Request-Id": request_id}
    hot = api.request(method, url, headers=headers, **request)
    view = view_only.request(method, url, headers=headers, **request)
    for answer in (hot, view):
        assert API_HEADERS <= set(answer.headers), (answer.request.url, dict(answer.headers))
        assert answer.headers["x-request-id"] == request_id
    assert hot.status_code == view.status_code, (hot.text, view.text)
    assert hot.headers["content-type"] == view.headers["content-type"]
    return hot, view


def same(api: httpx.Client, view_only: httpx.Client, method: str, url: str, **request: Any) -> httpx.Response:
    """Both servers' answer, which must be the same; the hot path's is returned."""
    hot, view = ask_both(api, view_only, method, url, **request)
    if hot.headers["content-type"].startswith("application/json"):
        assert hot.json() == view.json()
    else:
        assert hot.content == view.content
    return hot


def test_a_command_is_answered_the_same(api: httpx.Client, view_only: httpx.Client, running: str) -> None:
    hot, view = ask_both(
        api, view_only, "POST", f"/api/v1/sandboxes/{running}/exec", json={"cmd": "echo out; echo err >&2; exit 3"}
    )
    assert hot.status_code == 200
    ran = [{key: value for key, value in answer.json().items() if key != "duration_ms"} for answer in (hot, view)]
    assert ran[0] == ran[1] and ran[0]["stdout"] == "out\n" and ran[0]["stderr"] == "err\n" and ran[0]["exit_code"] == 3


@pytest.mark.parametrize(
    "body",
    [
        {"cmd": ""},
        {"cmd": ["true"], "bogus": 1},
        {"cmd": ["true"], "timeout_s": -1},
        {"cmd": ["a\x00b"]},
        b'{"cmd": "\\ud800"}',
        b'{"cmd": ',
        b"[]",
    ],
    ids=["empty", "unknown-field", "bad-timeout", "nul", "lone-surrogate", "truncated", "not-an-object"],
)
def test_a_bad_command_is_refused_the_same(api: httpx.Client, view_only: httpx.Client, running: str, body: bytes | dict) -> None:
    request: dict[str, Any] = (
        {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    )
    answer = same(api, view_only, "POST", f"/api/v1/sandboxes/{running}/exec", **request)
    assert answer.status_code >= 400 and answer.json()["error"]["code"]


def test_files_are_read_and_written_the_same(api: httpx.Client, view_only: httpx.Client, running: str) -> None:
    files = f"/api/v1/sandboxes/{running}/files"
    written = same(api, view_only, "PUT", files, params={"path": "/tmp/hot/a.txt", "mode": "493"}, content=b"some bytes\x00\xff")
    assert written.status_code == 200 and written.json() == {"path": "/tmp/hot/a.txt", "bytes": 12}
    read = same(api, view_only, "GET", files, params={"path": "/tmp/hot/a.txt"})
    assert read.status_code == 200 and read.content == b"some bytes\x00\xff"
    listed = {entry["name"]: entry for entry in api.get(f"{files}/list", params={"path": "/tmp/hot"}).json()["entries"]}
    assert listed["a.txt"]["mode"] & 0o7777 == 0o755
    big = bytes(range(256)) * 4096  # 1 MiB: the largest write the hot path takes
    assert same(api, view_only, "PUT", files, params={"path": "/tmp/hot/big"}, content=big).status_code == 200
    assert same(api, view_only, "GET", files, params={"path": "/tmp/hot/big"}).content == big


@pytest.mark.parametrize(
    ("method", "params", "content"),
    [
        ("GET", {"path": "/tmp/hot-missing"}, None),
        ("GET", {"path": "/tmp"}, None),
        ("GET", {"path": "relative"}, None),
        ("GET", {"path": "/tmp/a\x00b"}, None),
        ("GET", {}, None),
        ("PUT", {"path": "/tmp"}, b"x"),
        ("PUT", {"path": "/tmp/hot-none/deeper/f", "make_parents": "false"}, b"x"),
        ("PUT", {"path": "/tmp/f", "mode": "99999"}, b"x"),
        ("PUT", {"path": "/tmp/f", "make_parents": "maybe"}, b"x"),
    ],
    ids=["missing", "a-directory", "relative", "nul", "no-path", "onto-a-directory", "no-parents", "bad-mode", "bad-flag"],
)
def test_a_bad_file_request_is_refused_the_same(
    api: httpx.Client, view_only: httpx.Client, running: str, method: str, params: dict, content: bytes | None
) -> None:
    answer = same(api, view_only, method, f"/api/v1/sandboxes/{running}/files", params=params, content=content)
    assert answer.status_code >= 400 and answer.json()["error"]["code"]


def test_a_sandbox_nobody_holds_is_the_same_404(api: httpx.Client, view_only: httpx.Client) -> None:
    for method, path, request in [
        ("POST", "exec", {"json": {"cmd": ["true"]}}),
        ("GET", "files", {"params": {"path": "/etc/hostname"}}),
        ("PUT", "files", {"params": {"path": "/tmp/x"}, "content": b"x"}),
    ]:
        answer = same(api, view_only, method, f"/api/v1/sandboxes/sb_0000000000000000/{path}", **request)
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "sandbox_not_found"


def test_a_paused_sandbox_is_refused_the_same(api: httpx.Client, view_only: httpx.Client, running: str) -> None:
    assert api.post(f"/api/v1/sandboxes/{running}/exec", json={"cmd": ["true"]}).status_code == 200  # its place remembered
    assert api.post(f"/api/v1/sandboxes/{running}/pause").json()["state"] == "paused"
    refused = same(api, view_only, "POST", f"/api/v1/sandboxes/{running}/exec", json={"cmd": ["true"]})
    error = refused.json()["error"]
    assert refused.status_code == 409 and error["code"] == "sandbox_not_running" and error["details"] == {"state": "paused"}
    assert running in error["message"] and "sb-" not in error["message"], "named by its public id, not the engine's"
    assert api.post(f"/api/v1/sandboxes/{running}/resume").json()["state"] == "running"
    assert api.post(f"/api/v1/sandboxes/{running}/exec", json={"cmd": ["true"]}).status_code == 200


def test_a_sandbox_destroyed_under_a_remembered_place_is_refused_the_same(api: httpx.Client, view_only: httpx.Client) -> None:
    sandbox = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600}).json()["id"]
    assert api.post(f"/api/v1/sandboxes/{sandbox}/exec", json={"cmd": ["true"]}).status_code == 200  # its place remembered
    assert api.delete(f"/api/v1/sandboxes/{sandbox}").json()["state"] == "destroyed"
    for method, path, request in [
        ("POST", "exec", {"json": {"cmd": ["true"]}}),
        ("GET", "files", {"params": {"path": "/etc/hostname"}}),
        ("PUT", "files", {"params": {"path": "/tmp/x"}, "content": b"x"}),
    ]:
        error = same(api, view_only, method, f"/api/v1/sandboxes/{sandbox}/{path}", **request).json()["error"]
        assert error["code"] == "sandbox_not_running" and sandbox in error["message"]


def test_a_revoked_key_is_refused_at_once(stack: Any, api: httpx.Client, running: str) -> None:
    made = api.post("/api/v1/keys", json={"name": f"hot-{uuid.uuid4().hex[:6]}", "role": "member"}).json()
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {made['secret']}"}, timeout=30) as client:
        assert client.post(f"/api/v1/sandboxes/{running}/exec", json={"cmd": ["true"]}).status_code == 200  # remembered
        revoked_at = time.monotonic()
        assert api.delete(f"/api/v1/keys/{made['id']}").status_code == 200
        refused = client.post(f"/api/v1/sandboxes/{running}/exec", json={"cmd": ["true"]})
        assert refused.status_code == 401, refused.text
        assert time.monotonic() - revoked_at < 5, "the guard: this must not have waited out the key's few seconds"
