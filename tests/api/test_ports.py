"""Exposed ports through the real stack: a busybox web server in a sandbox, reached at its preview URL.

The web server is reached at 127.0.0.1 with the preview's name in the Host
header (what a browser resolving ``*.localhost`` sends: tests/browser does
that for real).  What is checked is what the sandbox's server answered (its
page, its streamed CGI output, its websocket's replies), and the refusals'
codes.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import httpx
import pytest
from django.core import signing
from websockets.sync.client import connect

from tests.support.ports import HTTP_PORT, PAGE, WEBSOCKET_PORT, loopback_socket, serve_in, via_loopback, websocket_url

pytestmark = pytest.mark.root


def expose(api: httpx.Client, sandbox_id: str, port: int, auth: str, **options: Any) -> dict[str, Any]:
    answer = api.post(f"/api/v1/sandboxes/{sandbox_id}/ports", json={"port": port, "auth": auth, **options})
    assert answer.status_code == 201, answer.text
    return dict(answer.json())


def fetch(stack: Any, url: str, **options: Any) -> httpx.Response:
    address, headers = via_loopback(url, stack.url)
    return httpx.get(address, headers={**headers, **options.pop("headers", {})}, timeout=30, **options)


def test_a_public_port_serves_the_sandboxs_page_and_closes(stack, api, running):
    serve_in(api, running)
    port = expose(api, running, HTTP_PORT, "public")
    assert port["url"].startswith(f"http://{HTTP_PORT}-{running.replace('_', '-')}.localhost:")
    assert port["token_url"] is None
    page = fetch(stack, port["url"] + "index.html")
    assert page.status_code == 200 and page.text == PAGE
    listed = api.get(f"/api/v1/sandboxes/{running}/ports").json()
    assert [(item["port"], item["auth"]) for item in listed["ports"]] == [(HTTP_PORT, "public")]
    closed = api.delete(f"/api/v1/sandboxes/{running}/ports/{HTTP_PORT}")
    assert closed.status_code == 200 and closed.json() == {"id": port["id"], "deleted": True}
    gone = fetch(stack, port["url"] + "index.html")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "port_not_found"
    again = api.delete(f"/api/v1/sandboxes/{running}/ports/{HTTP_PORT}")
    assert again.status_code == 404 and again.json()["error"]["code"] == "port_not_found"


def test_a_key_port_needs_the_teams_key(stack, api, running, team_b):
    serve_in(api, running)
    port = expose(api, running, HTTP_PORT, "key")
    url = port["url"] + "index.html"
    assert fetch(stack, url).status_code == 401
    assert fetch(stack, url, headers={"X-Forkyard-Key": team_b.key}).status_code == 401  # another team's key
    assert fetch(stack, url, headers={"X-Forkyard-Key": "fy_not_a_key"}).status_code == 401
    allowed = fetch(stack, url, headers={"X-Forkyard-Key": stack.teams[0].key})
    assert allowed.status_code == 200 and allowed.text == PAGE


def test_a_token_port_takes_its_signed_url_then_its_cookie(stack, api, running):
    serve_in(api, running)
    port = expose(api, running, HTTP_PORT, "token", token_ttl_s=600)
    assert port["token_url"].startswith(port["url"] + "?forkyard_token=") and port["token_expires_at"]
    assert fetch(stack, port["url"]).status_code == 401
    forged = fetch(stack, port["url"] + "?forkyard_token=" + port["token_url"].rsplit("=", 1)[1][:-2] + "xx")
    assert forged.status_code == 401
    signed = fetch(stack, port["token_url"])
    assert signed.status_code == 200 and signed.text == PAGE
    cookie = signed.headers["set-cookie"]
    assert cookie.startswith("forkyard_token=") and "HttpOnly" in cookie
    by_cookie = fetch(stack, port["url"] + "index.html", headers={"Cookie": cookie.split(";")[0]})
    assert by_cookie.status_code == 200 and by_cookie.text == PAGE
    # Exposed again (as public, then as token): the old token is refused.
    expose(api, running, HTTP_PORT, "public")
    expose(api, running, HTTP_PORT, "token")
    assert fetch(stack, port["token_url"]).status_code == 401


def _preview_signer(stack: Any, now: float) -> signing.TimestampSigner:
    """A signer with the web server's key (kept in its data directory) whose clock says ``now``."""
    key = stack.environment().get("FORKYARD_SECRET_KEY") or (stack.base_dir / "web" / "secret_key").read_text().strip()

    class At(signing.TimestampSigner):
        def timestamp(self) -> str:
            return signing.b62_encode(int(now))

    return At(key=key, salt="forkyard.preview", fallback_keys=[])


def test_an_expired_token_is_refused_though_its_signature_is_good(stack, api, running):
    serve_in(api, running)
    port = expose(api, running, HTTP_PORT, "token", token_ttl_s=60)
    token = dict(parse_qsl(urlsplit(port["token_url"]).query))["forkyard_token"]
    claims = _preview_signer(stack, time.time()).unsign_object(token)  # the server's key: its signature holds
    # The same claims, signed two minutes ago, and again now: only the age differs.
    expired = _preview_signer(stack, time.time() - 120).sign_object(claims)
    fresh = _preview_signer(stack, time.time()).sign_object(claims)
    refused = fetch(stack, port["url"] + "?forkyard_token=" + expired)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
    assert "set-cookie" not in refused.headers
    assert fetch(stack, port["url"], headers={"Cookie": f"forkyard_token={expired}"}).status_code == 401
    signed = fetch(stack, port["url"] + "index.html?forkyard_token=" + fresh)
    assert signed.status_code == 200 and signed.text == PAGE


def test_a_port_nobody_listens_on_answers_502_and_wait_says_so(stack, api, running):
    port = expose(api, running, 7000, "public")
    answer = fetch(stack, port["url"])
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "port_not_listening"
    waited = api.post(f"/api/v1/sandboxes/{running}/ports/7000/wait", json={"timeout_s": 0})
    assert waited.status_code == 200 and waited.json()["listening"] is False
    bad = api.post(f"/api/v1/sandboxes/{running}/ports/70000/wait", json={"timeout_s": 0})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "port"


def test_a_streamed_answer_arrives_before_the_sandbox_finishes_it(stack, api, running):
    serve_in(api, running)
    port = expose(api, running, HTTP_PORT, "public")
    address, headers = via_loopback(port["url"] + "cgi-bin/stream", stack.url)
    with httpx.stream("GET", address, headers=headers, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines) == "first"
        # The script is still waiting for /tmp/go: what came so far was streamed, not buffered whole.
        api.post(f"/api/v1/sandboxes/{running}/exec", json={"cmd": "touch /tmp/go"})
        assert list(lines) == ["last"]


def test_a_websocket_is_proxied_both_ways(stack, api, running):
    serve_in(api, running)
    port = expose(api, running, WEBSOCKET_PORT, "public")
    with connect(websocket_url(port["url"]), sock=loopback_socket(stack.url), open_timeout=30) as websocket:
        assert websocket.recv(timeout=30) == "hello"
        websocket.send("ping")  # a masked frame of 10 bytes: the server counts what it read
        assert websocket.recv(timeout=30) == "got 10"


def test_a_port_closes_with_its_sandbox(stack, api):
    sandbox = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600}).json()["id"]
    serve_in(api, sandbox)
    port = expose(api, sandbox, HTTP_PORT, "public")
    assert fetch(stack, port["url"] + "index.html").status_code == 200
    assert api.delete(f"/api/v1/sandboxes/{sandbox}", params={"wait": "true"}).status_code in (200, 202)
    assert fetch(stack, port["url"] + "index.html").status_code == 404
    assert api.get(f"/api/v1/sandboxes/{sandbox}/ports").json()["ports"] == []


def test_bad_port_requests_are_refused_with_codes(api, running):
    for body, field in (({"port": 0}, "port"), ({"port": 8080, "auth": "open"}, "auth"), ({"port": 8080, "extra": 1}, "extra")):
        answer = api.post(f"/api/v1/sandboxes/{running}/ports", json=body)
        assert answer.status_code == 400, answer.text
        assert field in answer.text
