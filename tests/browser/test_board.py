"""The live launch board in a browser: start a small launch, watch every pixel run, tear it down.

What the page shows is read from board.js's read-only hook (``window.forkyardBoard``)
and the counters' text, and compared with the API, which counts in the database.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from playwright.sync_api import Page, expect

from sandboxes.board.protocol import REQUESTED, RUNNING, STARTING, STOPPED
from tests.browser.conftest import screenshot
from tests.support.stack import Stack, Team, launch_members, wait_for_launch

pytestmark = [pytest.mark.root, pytest.mark.slow]

SMALL = 480  # the "small" wordmark: one sandbox per lit pixel
PROGRESS = ("requested", "queued", "creating", "running", "failed", "ended")
LIVE = {"queued", "creating", "running", "paused", "stopping"}

# The pixels the page holds, tallied by state (the board protocol's numbering), and its counters.
READ_BOARD = """() => {
  const board = window.forkyardBoard, states = board && board.states();
  if (!states) return null;
  const tally = [0, 0, 0, 0, 0];
  for (const state of states) tally[state] += 1;
  return { pixels: states.length, tally: tally, counters: board.counters() };
}"""


def settled(*, running: int = 0, ended: int = 0) -> dict[str, int]:
    """A settled launch's progress: nothing queued, creating or failed."""
    return {"requested": SMALL, "queued": 0, "creating": 0, "running": running, "failed": 0, "ended": ended}


def read_board(page: Page) -> dict[str, Any] | None:
    board: dict[str, Any] | None = page.evaluate(READ_BOARD)
    return board


def wait_for_board(page: Page, done: Any, timeout_s: float, what: str) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        board = read_board(page)
        if board is not None and done(board):
            return board
        assert time.monotonic() < deadline, f"the board never showed {what}: {board}"
        time.sleep(0.1)


def wait_until_the_page_agrees(page: Page, progress: dict[str, int]) -> dict[str, Any]:
    """The board's counters become the API's (the ticker may be a tick behind), and the page prints them."""
    board = wait_for_board(
        page, lambda board: {name: board["counters"][name] for name in PROGRESS} == progress, 10, f"the API's counters {progress}"
    )
    printed = {name: int(page.locator(f"#c-{name}").inner_text().replace(",", "")) for name in ("requested", "running", "failed")}
    assert printed == {name: progress[name] for name in printed}
    return board


@pytest.mark.timeout(600)
def test_a_small_launch_runs_every_pixel_and_tears_down(console: Page, stack: Stack, console_team: Team, artifacts: Path) -> None:
    console.goto("/board/")
    console.get_by_label("Wordmark").fill("forkyard")
    console.get_by_label("Size").select_option("small")
    console.get_by_role("button", name="Start launch").click()
    console.wait_for_url("**/board/?launch=*")
    launch_id = parse_qs(urlparse(console.url).query)["launch"][0]
    expect(console.get_by_role("status")).to_contain_text(f"launching {SMALL} sandboxes")

    with stack.client(console_team) as api:
        try:
            # Starting: the canvas has one pixel per sandbox; catch it part-way for the screenshot.
            board = wait_for_board(console, lambda board: board["pixels"] > 0, 30, "its layout")
            assert board["pixels"] == SMALL
            caught_midway = False
            deadline = time.monotonic() + 300
            while board["tally"][REQUESTED] or board["tally"][STARTING]:
                if not caught_midway and (board["tally"][STARTING] or board["tally"][RUNNING]):
                    screenshot(console, artifacts, "board-mid-launch")
                    caught_midway = True
                assert time.monotonic() < deadline, f"the board's pixels never all settled: {board}"
                time.sleep(0.1)
                board = read_board(console) or board
            assert board["tally"][RUNNING] == SMALL, f"not every pixel reached running: {board}"
            if not caught_midway:
                warnings.warn("the launch ran before the board could be caught part-way: no mid-launch screenshot", stacklevel=1)

            # Running: the page's counters, its pixels and the API agree.
            launch = wait_for_launch(api, launch_id, {"ready", "failed"}, timeout_s=60)
            assert launch["state"] == "ready" and launch["labels"]["board"] == "small"
            assert launch["progress"] == settled(running=SMALL)
            board = wait_until_the_page_agrees(console, launch["progress"])
            assert board["tally"] == [0, 0, SMALL, 0, 0]
            expect(console.locator("#connection")).to_have_text("live")
            expect(console.locator("#launch-state")).to_have_text("ready")
            screenshot(console, artifacts, "board-all-running")

            console.goto("/")
            running_now = console.locator(".stat").filter(has_text="Running now").locator(".value")
            expect(running_now).to_have_text(str(SMALL))
            screenshot(console, artifacts, "console-overview")
            console.goto(f"/board/?launch={launch_id}")

            # Tearing down (asked first, in place): every pixel goes off, and nothing is left on the API or on the engine.
            console.once("dialog", lambda dialog: dialog.accept())
            console.get_by_role("button", name="Tear down").click()
            board = wait_for_board(console, lambda board: board["tally"][STOPPED] == SMALL, 120, "every pixel stopped")
            final = wait_for_launch(api, launch_id, {"stopped"}, timeout_s=60)
            assert final["progress"] == settled(ended=SMALL)
            wait_until_the_page_agrees(console, final["progress"])
            members = launch_members(api, launch_id)
            assert len(members) == SMALL
            assert [member["id"] for member in members if member["state"] in LIVE] == []
            assert stack.engine is not None
            deadline = time.monotonic() + 15
            while True:
                with stack.engine.client() as engine:
                    left = [sandbox["id"] for sandbox in engine.list() if sandbox["labels"].get("launch") == launch_id]
                if not left:
                    break
                assert time.monotonic() < deadline, f"the engine still runs {len(left)} of the launch's sandboxes"
                time.sleep(0.2)
            console.reload()
            expect(console.locator("#teardown")).to_have_count(0)
            expect(console.locator("#launch-state")).to_have_text("stopped")
            screenshot(console, artifacts, "board-torn-down")
        finally:
            api.delete(f"/api/v1/launches/{launch_id}")
