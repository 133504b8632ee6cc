"""A host's gateway (``sandboxes.engine.gateway``) answers a sandbox's commands and files as the API does.

The API's answer about a running sandbox carries its ``data_path``: its host's
gateway and a data token for it. Each test asks the API and the gateway the
same thing and compares the answers (status, body, the API's headers), or
checks what the gateway refuses and what the engine counted: a token from
nowhere, of another sandbox, expired, of a revoked key; a body over its
limit, before it is read; the team's rate.
"""

from __future__ import annotations

import base64
import re
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sandboxes.engine import data_tokens
from tests.engine.engines import wait_for

pytestmark = pytest.mark.root

SHARED_HEADERS = {"content-type", "x-forkyard-region", "x-request-id", "x-ratelimit-limit", "x-ratelimit-remaining"}


def data_path(api: httpx.Client, sandbox: str) -> dict[str, Any]:
    found = api.get(f"/api/v1/sandboxes/{sandbox}").json()["data_path"]
    assert found is not None, "a running sandbox's answer names its data path"
    return found


@pytest.fixture
def gateway(api: httpx.Client, running: str) -> Iterator[httpx.Client]:
    """A client of the running sandbox's host's gateway, with the sandbox's data token."""
    route = data_path(api, running)
    with httpx.Client(base_url=route["url"], headers={"Authorization": f"Bearer {route['token']}"}, timeout=60) as client:
        yield client


def gateway_counters(stack: Any) -> dict[str, int]:
    with stack.engine.client() as engine:
        return dict(engine.info()["gateway"])


def same(api: httpx.Client, gateway: httpx.Client, method: str, url: str, **request: Any) -> httpx.Response:
    """The API's and the gateway's answers, which must be the same; the gateway's is returned."""
    request_id = f"same-{uuid.uuid4().hex[:8]}"
    headers = {**request.pop("headers", {}), "X-Request-Id": request_id}
    through_api = api.request(method, url, headers=headers, **request)
    direct = gateway.request(method, url, headers=headers, **request)
    # The API refuses an unknown parameter before it counts the request: then it has no rate headers.
    shared = SHARED_HEADERS & set(through_api.headers) | {"content-type", "x-forkyard-region", "x-request-id"}
    for answer in (through_api, direct):
        assert shared <= set(answer.headers), (answer.request.url, dict(answer.headers))
        assert answer.headers["x-request-id"] == request_id
    assert direct.status_code == through_api.status_code, (direct.text, through_api.text)
    assert direct.headers["x-forkyard-region"] == through_api.headers["x-forkyard-region"]
    if through_api.headers["content-type"].startswith("application/json"):
        assert direct.headers["content-type"].startswith("application/json")
        expected, got = through_api.json(), direct.json()
        for answer in (expected, got):
            answer.pop("duration_ms", None)
        assert got == expected
    else:
        assert direct.content == through_api.content
    return direct


def test_a_running_sandbox_names_its_data_path(api: httpx.Client, running: str) -> None:
    route = data_path(api, running)
    assert route["url"].startswith("http://127.0.0.1:") and route["token"].startswith("fyd1.")
    listed = [
        row for row in api.get("/api/v1/sandboxes", params={"state": "running"}).json()["sandboxes"] if row["id"] == running
    ]
    assert listed and listed[0]["data_path"]["url"] == route["url"]


def test_a_command_is_answered_as_the_api_answers_it(stack: Any, api: httpx.Client, gateway: httpx.Client, running: str) -> None:
    before = gateway_counters(stack)
    answer = same(api, gateway, "POST", f"/api/v1/sandboxes/{running}/exec", json={"cmd": "echo out; echo err >&2; exit 3"})
    assert answer.status_code == 200 and answer.json()["stdout"] == "out\n" and answer.json()["exit_code"] == 3
    exact = same(
        api, gateway, "POST", f"/api/v1/sandboxes/{running}/exec", json={"cmd": ["printf", "\\377\\000ok"], "output": "base64"}
    )
    assert base64.b64decode(exact.json()["stdout"]) == b"\xff\x00ok"
    assert gateway_counters(stack)["execs"] - before["execs"] == 2, "the engine's gateway ran them"


@pytest.mark.parametrize(
    "body",
    [
        {"cmd": ""},
        {"cmd": ["true"], "bogus": 1},
        {"cmd": ["true"], "timeout_s": -1},
        {"cmd": ["true"], "timeout_s": True},
        {"cmd": ["a\x00b"]},
        {"cmd": ["true"], "timeout": 5, "timeout_s": 5},
        b'{"cmd": "\\ud800"}',
        b"[]",
    ],
    ids=["empty", "unknown-field", "bad-timeout", "bool-timeout", "nul", "both-spellings", "lone-surrogate", "not-an-object"],
)
def test_a_bad_command_is_refused_as_the_api_refuses_it(
    api: httpx.Client, gateway: httpx.Client, running: str, body: bytes | dict
) -> None:
    request: dict[str, Any] = (
        {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    )
    answer = same(api, gateway, "POST", f"/api/v1/sandboxes/{running}/exec", **request)
    assert answer.status_code == 400 and answer.json()["error"]["code"]


def test_files_are_read_and_written_as_through_the_api(api: httpx.Client, gateway: httpx.Client, running: str) -> None:
    files = f"/api/v1/sandboxes/{running}/files"
    written = same(api, gateway, "PUT", files, params={"path": "/tmp/gw/a.txt", "mode": "493"}, content=b"some bytes\x00\xff")
    assert written.json() == {"path": "/tmp/gw/a.txt", "bytes": 12}
    assert same(api, gateway, "GET", files, params={"path": "/tmp/gw/a.txt"}).content == b"some bytes\x00\xff"
    big = bytes(range(256)) * 16384  # 4 MiB: read in chunks
    assert same(api, gateway, "PUT", files, params={"path": "/tmp/gw/big"}, content=big).json()["bytes"] == len(big)
    assert same(api, gateway, "GET", files, params={"path": "/tmp/gw/big"}).content == big


@pytest.mark.parametrize(
    ("method", "params", "content"),
    [
        ("GET", {"path": "/tmp/gw-missing"}, None),
        ("GET", {"path": "/tmp"}, None),
        ("GET", {"path": "relative"}, None),
        ("GET", {}, None),
        ("GET", {"path": "/etc/hostname", "bogus": "1"}, None),
        ("PUT", {"path": "/tmp"}, b"x"),
        ("PUT", {"path": "/tmp/gw-none/deeper/f", "make_parents": "false"}, b"x"),
        ("PUT", {"path": "/tmp/f", "mode": "99999"}, b"x"),
        ("PUT", {"path": "/tmp/f", "make_parents": "maybe"}, b"x"),
    ],
    ids=[
        "missing",
        "a-directory",
        "relative",
        "no-path",
        "unknown-parameter",
        "onto-a-directory",
        "no-parents",
        "bad-mode",
        "bad-flag",
    ],
)
def test_a_bad_file_request_is_refused_as_through_the_api(
    api: httpx.Client, gateway: httpx.Client, running: str, method: str, params: dict, content: bytes | None
) -> None:
    answer = same(api, gateway, method, f"/api/v1/sandboxes/{running}/files", params=params, content=content)
    assert answer.status_code >= 400 and answer.json()["error"]["code"]


def test_a_paused_sandbox_is_refused_by_its_public_id(api: httpx.Client, gateway: httpx.Client, running: str) -> None:
    assert api.post(f"/api/v1/sandboxes/{running}/pause").json()["state"] == "paused"
    refused = same(api, gateway, "POST", f"/api/v1/sandboxes/{running}/exec", json={"cmd": ["true"]})
    error = refused.json()["error"]
    assert refused.status_code == 409 and error["code"] == "sandbox_not_running"
    assert running in error["message"] and "sb-" not in error["message"], "named by its public id, not the engine's"
    assert api.post(f"/api/v1/sandboxes/{running}/resume").json()["state"] == "running"
    assert gateway.post(f"/api/v1/sandboxes/{running}/exec", json={"cmd": ["true"]}).status_code == 200


def refusal(answer: httpx.Response) -> tuple[int, str]:
    return answer.status_code, answer.json()["error"]["code"]


def test_a_token_that_is_not_the_hosts_is_refused(api: httpx.Client, running: str) -> None:
    route = data_path(api, running)
    url = f"{route['url']}/api/v1/sandboxes/{running}/exec"
    version, payload, signature = route["token"].split(".")
    forged = f"{version}.{payload}.{signature[:-2]}{'AA' if not signature.endswith('AA') else 'BB'}"
    for headers in ({}, {"Authorization": "Bearer not-a-token"}, {"Authorization": f"Bearer {forged}"}):
        assert refusal(httpx.post(url, json={"cmd": ["true"]}, headers=headers)) == (401, "data_token_invalid")
    with pytest.raises(httpx.HTTPStatusError):  # an API key is no data token
        httpx.post(url, json={"cmd": ["true"]}, headers={"Authorization": api.headers["Authorization"]}).raise_for_status()


def test_a_token_opens_its_own_sandbox_only(api: httpx.Client, running: str) -> None:
    other = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600}).json()["id"]
    try:
        route = data_path(api, running)
        answer = httpx.post(
            f"{route['url']}/api/v1/sandboxes/{other}/exec",
            json={"cmd": ["touch", "/tmp/reached"]},
            headers={"Authorization": f"Bearer {route['token']}"},
        )
        assert refusal(answer) == (401, "data_token_invalid")
        assert api.get(f"/api/v1/sandboxes/{other}/files/stat", params={"path": "/tmp/reached"}).status_code == 404
    finally:
        api.delete(f"/api/v1/sandboxes/{other}")


def test_an_expired_token_is_refused(stack: Any, api: httpx.Client, running: str) -> None:
    route = data_path(api, running)
    with stack.engine.client() as engine:
        secret = base64.b64decode(engine.call("gateway.info")["secret_b64"])
        engine_id = next(row["id"] for row in engine.list() if row.get("key") == running)
    grant = data_tokens.Grant(
        sandbox=running, engine_id=engine_id, team="t", key="k", expires_at=int(time.time()) - 1, rate=100, region="r"
    )
    answer = httpx.post(
        f"{route['url']}/api/v1/sandboxes/{running}/exec",
        json={"cmd": ["true"]},
        headers={"Authorization": f"Bearer {data_tokens.mint(secret, grant)}"},
    )
    assert refusal(answer) == (401, "data_token_expired")


def test_a_revoked_keys_tokens_are_refused_by_the_host(api: httpx.Client, running: str) -> None:
    made = api.post("/api/v1/keys", json={"name": f"gw-{uuid.uuid4().hex[:6]}", "role": "member"}).json()
    with httpx.Client(base_url=str(api.base_url), headers={"Authorization": f"Bearer {made['secret']}"}) as member:
        route = member.get(f"/api/v1/sandboxes/{running}").json()["data_path"]
    url = f"{route['url']}/api/v1/sandboxes/{running}/exec"
    headers = {"Authorization": f"Bearer {route['token']}"}
    assert httpx.post(url, json={"cmd": ["true"]}, headers=headers).status_code == 200
    assert api.delete(f"/api/v1/keys/{made['id']}").status_code == 200
    wait_for(lambda: httpx.post(url, json={"cmd": ["true"]}, headers=headers).status_code == 401, "the host to refuse the token")
    assert refusal(httpx.post(url, json={"cmd": ["true"]}, headers=headers)) == (401, "data_token_invalid")


def raw_request(url: str, head: str) -> bytes:
    """Send only a request's head (no body) and read the answer: a refusal must come before the body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(head.encode())
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer) < answer.index(b"\r\n\r\n") + 4 + int(
            next(line.split(b":")[1] for line in answer.split(b"\r\n") if line.lower().startswith(b"content-length"))
        ):
            chunk = connection.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def test_a_body_is_refused_before_it_is_read(api: httpx.Client, running: str) -> None:
    route = data_path(api, running)
    exec_path = f"/api/v1/sandboxes/{running}/exec"
    unauthenticated = raw_request(route["url"], f"POST {exec_path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1073741824\r\n\r\n")
    assert unauthenticated.startswith(b"HTTP/1.1 401") and b"data_token_invalid" in unauthenticated
    too_large = raw_request(
        route["url"],
        f"POST {exec_path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {route['token']}\r\nContent-Length: 1073741824\r\n\r\n",
    )
    assert too_large.startswith(b"HTTP/1.1 413") and b"too_large" in too_large


def test_the_teams_rate_is_counted_by_the_host(stack: Any) -> None:
    team = stack.new_team("Gateway rate", requests_per_second=5)
    with stack.client(team) as api:
        sandbox = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600}).json()["id"]
        try:
            route = data_path(api, sandbox)
            with httpx.Client(base_url=route["url"], headers={"Authorization": f"Bearer {route['token']}"}) as gateway:
                answers = [gateway.get(f"/api/v1/sandboxes/{sandbox}/files", params={"path": "/etc/hostname"}) for _ in range(30)]
            refused = [answer for answer in answers if answer.status_code == 429]
            assert refused, "30 requests in a few seconds at 5 a second"
            assert refused[0].json()["error"]["code"] == "rate_limited" and int(refused[0].headers["retry-after"]) >= 1
            assert refused[0].headers["x-ratelimit-limit"] == "5"
        finally:
            api.delete(f"/api/v1/sandboxes/{sandbox}")


def test_a_large_output_is_answered_whole_without_holding_it(
    stack: Any, api: httpx.Client, gateway: httpx.Client, running: str
) -> None:
    before = gateway_counters(stack)
    size = 12 * 1024 * 1024
    answer = gateway.post(
        f"/api/v1/sandboxes/{running}/exec",
        json={
            "cmd": f"head -c {size} /dev/urandom | tee /tmp/big.out | head -c {size}",
            "max_output_bytes": 16 << 20,
            "output": "base64",
        },
    )
    assert answer.status_code == 200, answer.text[:300]
    stdout = base64.b64decode(answer.json()["stdout"])
    assert (
        len(stdout) == size and stdout == api.get(f"/api/v1/sandboxes/{running}/files", params={"path": "/tmp/big.out"}).content
    )
    assert gateway_counters(stack)["spilled"] == before["spilled"] + 1, "past its first 64 KiB, it waited on disk"


def test_a_caller_that_leaves_ends_its_command(api: httpx.Client, running: str) -> None:
    route = data_path(api, running)
    body = b'{"cmd": "sleep 30; touch /tmp/finished", "timeout_s": 60}'
    head = (
        f"POST /api/v1/sandboxes/{running}/exec HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {route['token']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    host, port = route["url"].removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)))
    connection.sendall(head.encode() + body)
    wait_for(lambda: "sleep 30" in sandbox_processes_of(api, running), "the command to start")
    connection.close()
    wait_for(lambda: "sleep 30" not in sandbox_processes_of(api, running), "the command to end with its caller")
    assert api.get(f"/api/v1/sandboxes/{running}/files/stat", params={"path": "/tmp/finished"}).status_code == 404


def sandbox_processes_of(api: httpx.Client, sandbox: str) -> str:
    return str(api.post(f"/api/v1/sandboxes/{sandbox}/exec", json={"cmd": "ps -o args"}).json()["stdout"])


def test_another_route_is_not_found(api: httpx.Client, gateway: httpx.Client, running: str) -> None:
    for method, path in (("GET", f"/api/v1/sandboxes/{running}"), ("DELETE", f"/api/v1/sandboxes/{running}"), ("GET", "/")):
        assert refusal(gateway.request(method, path)) == (404, "not_found")
    assert api.get(f"/api/v1/sandboxes/{running}").json()["state"] == "running"


def test_a_request_without_an_id_is_given_one_of_its_own(gateway: httpx.Client, running: str) -> None:
    files = f"/api/v1/sandboxes/{running}/files"
    given = [gateway.get(files, params={"path": "/etc/hostname"}).headers["x-request-id"] for _ in range(3)]
    given.append(gateway.get("/").headers["x-request-id"])  # a refusal carries one too
    assert len(set(given)) == len(given), given
    assert all(re.fullmatch(r"[0-9a-f]{32}", each) for each in given), given


def test_a_small_write_into_a_symlinked_directory_is_judged_by_the_writer(
    api: httpx.Client, gateway: httpx.Client, running: str
) -> None:
    """Every parent there already is a directory, so no mkdir -p is asked of the sandbox's writer; a parent
    reached through a symlink still is, and lands where the writer's own resolution puts it."""
    files = f"/api/v1/sandboxes/{running}/files"
    made = api.post(f"/api/v1/sandboxes/{running}/exec", json={"cmd": "mkdir -p /tmp/gw-real && ln -sfn /tmp/gw-real /tmp/gw-link"})
    assert made.json()["exit_code"] == 0, made.text
    for path in ("/tmp/gw-real/direct", "/tmp/gw-link/through-a-link"):
        assert gateway.put(files, params={"path": path}, content=b"small").json() == {"path": path, "bytes": 5}
    listed = api.post(f"/api/v1/sandboxes/{running}/exec", json={"cmd": "ls /tmp/gw-real"}).json()["stdout"]
    assert listed.split() == ["direct", "through-a-link"]
