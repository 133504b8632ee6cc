"""The console and the board in a real headless Chromium, against the whole stack.

Playwright (sync API) drives Debian's ``chromium`` (installed by
scripts/bootstrap): Playwright's own browser download is not used.  Every page
a test opens records the browser's console errors, uncaught exceptions and
5xx answers; any of them fails the test.  Screenshots go to
``artifacts/browser/`` at the repository root.

Playwright's sync API keeps an event loop running in the test thread, which
Django's ORM refuses to run beside: so these tests prepare data through the
stack (its API, ``stack.shell``), never the ORM in-process, and the browser
lives for this package only (the tests after it use the ORM freely).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, Response, sync_playwright

from tests.support.engine import PROJECT_ROOT
from tests.support.stack import Stack, Team

ARTIFACTS = PROJECT_ROOT / "artifacts" / "browser"
OVERVIEW_URL = re.compile(r"^http://127\.0\.0\.1:\d+/$")
# As root (the suite is), Chromium will not start its own sandbox; no GPU, a small
# /dev/shm and no background traffic in a container either.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking"]


@pytest.fixture(scope="package")
def chromium() -> Iterator[Browser]:
    executable = shutil.which("chromium")
    if executable is None:
        message = "Debian's chromium is not installed (scripts/bootstrap installs it)"
        if os.environ.get("FORKYARD_CI"):
            pytest.fail(message)
        pytest.skip(message)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="package")
def console_team(stack: Stack) -> Team:
    """A team of its own, so its pages and counts hold only what these tests made.

    Its quota is set for the board's small launch (480) plus a sandbox or two."""
    return stack.new_team("Browser team", max_sandboxes=600, max_launch_count=600)


@pytest.fixture(scope="package")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@dataclass
class BrowserErrors:
    """What went wrong in the page: console errors, uncaught exceptions, server errors."""

    seen: list[str] = field(default_factory=list)

    def console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.seen.append(f"console: {message.text} ({message.location.get('url')})")

    def exception(self, error: Exception) -> None:
        self.seen.append(f"uncaught: {error}")

    def response(self, response: Response) -> None:
        if response.status >= 500:
            self.seen.append(f"HTTP {response.status}: {response.request.method} {response.url}")


@pytest.fixture
def page(chromium: Browser, stack: Stack) -> Iterator[Page]:
    """A fresh browser context and page on the stack; fails the test on any error in the page."""
    context = chromium.new_context(base_url=stack.url, viewport={"width": 1280, "height": 800})
    context.set_default_timeout(30_000)
    opened = context.new_page()
    errors = BrowserErrors()
    opened.on("console", errors.console)
    opened.on("pageerror", errors.exception)
    opened.on("response", errors.response)
    yield opened
    context.close()
    assert not errors.seen, "the browser reported errors:\n" + "\n".join(errors.seen)


def sign_in(page: Page, team: Team) -> None:
    """Through the login form, as a person would: the console sends a visitor there first."""
    page.goto("/")
    page.wait_for_url("**/login/?next=/")
    page.get_by_label("Username").fill(team.username)
    page.get_by_label("Password").fill(team.password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(OVERVIEW_URL)


@pytest.fixture
def console(page: Page, console_team: Team) -> Page:
    """A page signed in to the console as the browser team's owner."""
    sign_in(page, console_team)
    return page


def screenshot(page: Page, artifacts: Path, name: str) -> None:
    page.screenshot(path=str(artifacts / f"{name}.png"), full_page=True)
