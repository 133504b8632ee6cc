"""The console in headless Chromium: a terminal in the browser runs a command; the API's docs render
from the project's own files with nothing fetched from elsewhere; pages work at 390 px wide, with a
visible focus."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, Route, expect

from tests.browser.conftest import BrowserErrors, screenshot, sign_in
from tests.support.stack import Stack, Team

pytestmark = pytest.mark.root  # the stack's engine makes real sandboxes


def until(page: Page, script: str, what: str, timeout_s: float = 30) -> None:
    """Until ``script`` (a function, evaluated by the driver: the page's CSP allows no eval) is true."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(script):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.1)


def test_the_terminal_runs_a_command(console: Page, stack: Stack, console_team: Team, artifacts: Path) -> None:
    with stack.client(console_team) as api:
        created = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600})
        assert created.status_code == 201, created.text
        sandbox_id = created.json()["id"]
        try:
            console.goto(f"/sandboxes/{sandbox_id}/")
            console.get_by_role("button", name="Open a terminal").click()
            until(console, "() => Boolean(window.forkyardTerminal && window.forkyardTerminal.connected())", "the terminal connected")
            console.locator("#terminal").click()
            console.keyboard.type("echo answer=$((6*7))\n")
            until(console, "() => window.forkyardTerminal.text().includes('answer=42')", "the command's answer")
            assert "answer=42" in console.evaluate("window.forkyardTerminal.text()").split("echo answer=$((6*7))", 1)[1]
            shells = [p for p in api.get(f"/api/v1/sandboxes/{sandbox_id}/processes").json()["processes"] if p["state"] == "running"]
            assert len(shells) == 1, shells
            screenshot(console, artifacts, "console-terminal")
            # The files the shell can see, in the page's browser.
            console.keyboard.type("echo hi > /tmp/from-terminal; echo wrote-it\n")
            until(console, "() => window.forkyardTerminal.text().split('wrote-it').length > 2", "the second command ran")
            console.locator("#files").get_by_role("link", name="tmp/").click()
            expect(console.locator("#files")).to_contain_text("from-terminal")
            # Leaving the page ends its shell.
            console.goto("/")
            deadline = time.monotonic() + 30
            while [p for p in api.get(f"/api/v1/sandboxes/{sandbox_id}/processes").json()["processes"] if p["state"] == "running"]:
                assert time.monotonic() < deadline, "the terminal's shell outlived its page"
                time.sleep(0.2)
        finally:
            api.delete(f"/api/v1/sandboxes/{sandbox_id}")


def test_the_api_docs_render_offline(chromium: Browser, stack: Stack, artifacts: Path) -> None:
    context = chromium.new_context(base_url=stack.url, viewport={"width": 1280, "height": 900})
    elsewhere: list[str] = []

    def only_here(route: Route) -> None:
        if route.request.url.startswith(stack.url):
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort()

    context.route("**/*", only_here)
    page = context.new_page()
    errors = BrowserErrors()
    page.on("console", errors.console)
    page.on("pageerror", errors.exception)
    try:
        page.goto("/api/v1/docs")
        expect(page.locator(".swagger-ui .info .title")).to_contain_text("forkyard", timeout=30_000)
        expect(page.locator(".opblock").first).to_be_visible()
        assert page.locator(".opblock").count() >= 60, "every operation of the document is listed"
        expect(page.locator(".opblock-summary-path").filter(has_text="/api/v1/sandboxes/{sandbox_id}/exec").first).to_be_visible()
        screenshot(page, artifacts, "api-docs")
    finally:
        context.close()
    assert elsewhere == [], f"the docs page reached off the site: {elsewhere}"
    assert errors.seen == [], errors.seen


PAGES = ["/", "/sandboxes/", "/launches/", "/board/", "/keys/", "/members/", "/usage/", "/usage/statement/", "/budgets/", "/limits/", "/audit/"]


def test_pages_fit_390_pixels_and_show_their_focus(chromium: Browser, stack: Stack, console_team: Team, artifacts: Path) -> None:
    context = chromium.new_context(base_url=stack.url, viewport={"width": 390, "height": 844}, device_scale_factor=2)
    page = context.new_page()
    errors = BrowserErrors()
    page.on("console", errors.console)
    page.on("pageerror", errors.exception)
    try:
        sign_in(page, console_team)
        for path in PAGES:
            page.goto(path)
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= 390, f"{path} is {width} px wide at 390: it scrolls sideways"
        screenshot(page, artifacts, "console-390-audit")
        page.goto("/keys/")
        page.keyboard.press("Tab")
        outline: dict[str, Any] = page.evaluate(
            "() => { const s = getComputedStyle(document.activeElement); return {style: s.outlineStyle, width: s.outlineWidth, tag: document.activeElement.tagName}; }"
        )
        assert outline["tag"] in ("A", "BUTTON", "SELECT", "INPUT") and outline["style"] != "none" and outline["width"] != "0px", outline
        page.goto("/sandboxes/")
        assert page.evaluate("document.querySelectorAll('#sandbox-table [aria-live]').length") >= 1, "the live counts are announced"
    finally:
        context.close()
    assert errors.seen == [], errors.seen
