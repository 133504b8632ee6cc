"""A web server in a sandbox opened at its preview URL in headless Chromium, with each auth mode
(public, token, key): the page, a streamed answer read as it comes, and a websocket both ways.

Chromium resolves ``*.localhost`` to loopback by itself, so the preview URLs the
API hands out are opened as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, BrowserContext, Page

from tests.browser.conftest import BrowserErrors, screenshot
from tests.support.ports import HTTP_PORT, WEBSOCKET_PORT, serve_in
from tests.support.stack import Stack

pytestmark = pytest.mark.root

READ_FIRST = """async () => {
    const response = await fetch('/cgi-bin/stream');
    window.streamReader = response.body.getReader();
    const { value } = await window.streamReader.read();
    return new TextDecoder().decode(value);
}"""
READ_REST = """async () => {
    let text = '';
    for (;;) {
        const { value, done } = await window.streamReader.read();
        if (done) return text;
        text += new TextDecoder().decode(value);
    }
}"""
WEBSOCKET_ROUND = """(url) => new Promise((resolve, reject) => {
    const socket = new WebSocket(url);
    const seen = [];
    socket.onerror = () => reject(new Error('websocket error'));
    socket.onmessage = (event) => {
        seen.push(event.data);
        if (seen.length === 1) socket.send('ping');
        if (seen.length === 2) { socket.close(); resolve(seen); }
    };
})"""


@pytest.fixture
def sandbox(stack: Stack) -> Iterator[str]:
    with stack.client() as api:
        made = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600})
        assert made.status_code == 201, made.text
        sandbox_id = str(made.json()["id"])
        serve_in(api, sandbox_id)
        yield sandbox_id
        api.delete(f"/api/v1/sandboxes/{sandbox_id}")


def expose(stack: Stack, sandbox_id: str, port: int, auth: str) -> dict[str, Any]:
    with stack.client() as api:
        answer = api.post(f"/api/v1/sandboxes/{sandbox_id}/ports", json={"port": port, "auth": auth})
        assert answer.status_code == 201, answer.text
        return dict(answer.json())


def context_of(chromium: Browser, errors: BrowserErrors, **options: Any) -> tuple[BrowserContext, Page]:
    context = chromium.new_context(**options)
    context.set_default_timeout(30_000)
    opened = context.new_page()
    opened.on("pageerror", errors.exception)
    opened.on("response", errors.response)
    return context, opened


def streamed(page: Page, stack: Stack, sandbox: str) -> None:
    """The sandbox's CGI script read as it comes: its first line arrives while it still waits for /tmp/go."""
    assert page.evaluate(READ_FIRST) == "first\n"
    with stack.client() as api:  # only now may the script finish: what came so far was streamed
        api.post(f"/api/v1/sandboxes/{sandbox}/exec", json={"cmd": "touch /tmp/go"})
    assert page.evaluate(READ_REST) == "last\n"


def test_public_page_stream_and_websocket(chromium: Browser, stack: Stack, sandbox: str, artifacts: Path) -> None:
    site = expose(stack, sandbox, HTTP_PORT, "public")
    socket_port = expose(stack, sandbox, WEBSOCKET_PORT, "public")
    errors = BrowserErrors()
    context, page = context_of(chromium, errors)
    try:
        page.goto(site["url"] + "index.html")
        assert page.locator("#hello").inner_text() == "hello from the sandbox"
        streamed(page, stack, sandbox)
        websocket_url = "ws" + socket_port["url"][len("http") :]
        assert page.evaluate(WEBSOCKET_ROUND, websocket_url) == ["hello", "got 10"]
        screenshot(page, artifacts, "preview-public")
    finally:
        context.close()
    assert not errors.seen, errors.seen


def test_token_page_then_its_cookie_and_a_token_websocket(chromium: Browser, stack: Stack, sandbox: str) -> None:
    site = expose(stack, sandbox, HTTP_PORT, "token")
    socket_port = expose(stack, sandbox, WEBSOCKET_PORT, "token")
    errors = BrowserErrors()
    context, page = context_of(chromium, errors)
    try:
        assert page.goto(site["url"] + "index.html").status == 401  # type: ignore[union-attr]
        assert page.goto(site["token_url"]).status == 200  # type: ignore[union-attr]
        assert page.locator("#hello").inner_text() == "hello from the sandbox"
        again = page.goto(site["url"] + "index.html")  # no token in the URL: the cookie carries it
        assert again is not None and again.status == 200
        streamed(page, stack, sandbox)  # by the cookie too
        assert page.evaluate(WEBSOCKET_ROUND, "ws" + socket_port["token_url"][len("http") :]) == ["hello", "got 10"]
    finally:
        context.close()
    assert not errors.seen, errors.seen


def test_key_page_needs_the_key_header(chromium: Browser, stack: Stack, sandbox: str) -> None:
    site = expose(stack, sandbox, HTTP_PORT, "key")
    socket_port = expose(stack, sandbox, WEBSOCKET_PORT, "key")
    errors = BrowserErrors()
    keyless, page = context_of(chromium, errors)
    try:
        refused = page.goto(site["url"] + "index.html")
        assert refused is not None and refused.status == 401
    finally:
        keyless.close()
    keyed, page = context_of(chromium, errors, extra_http_headers={"X-Forkyard-Key": stack.teams[0].key})
    try:
        allowed = page.goto(site["url"] + "index.html")
        assert allowed is not None and allowed.status == 200
        assert page.locator("#hello").inner_text() == "hello from the sandbox"
        streamed(page, stack, sandbox)
        # The context's headers go with the websocket's handshake too (a page's own script cannot add one).
        assert page.evaluate(WEBSOCKET_ROUND, "ws" + socket_port["url"][len("http") :]) == ["hello", "got 10"]
    finally:
        keyed.close()
    assert not errors.seen, errors.seen
