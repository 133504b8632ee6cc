"""The board on stage, in headless Chromium: its first frame is the launch's before any websocket
message; presenter mode scales each sandbox to whole pixels with a gap and shows no navigation;
Tear down asks first (naming whose launch), works in place, and every pixel's colour follows the
engine's real state (a pixel is off only once the engine no longer has its sandbox).

Screenshots land in artifacts/browser/ (committed to nothing); what is asserted is read from the
page (``window.forkyardBoard``, the canvas's own pixels) and from the engine.
"""

from __future__ import annotations

import re
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect

from sandboxes.board.protocol import PAUSED, RUNNING, STOPPED, STOPPING
from tests.browser.conftest import screenshot
from tests.support.stack import Stack, Team, launch_members, wait_for_launch

pytestmark = [pytest.mark.root, pytest.mark.slow]

COUNT = 480
RUNNING_RGBA = [0x35, 0xD0, 0x7F, 0xFF]
BACKGROUND_RGBA = [0x0C, 0x0E, 0x12, 0xFF]
# Sockets that never open: whatever the page shows, it did not learn from a websocket.
NO_SOCKETS = """
window.__socketsMade = 0;
window.WebSocket = class { constructor() { window.__socketsMade += 1; this.readyState = 0; } send() {} close() {} };
"""
PIXEL = """([x, y]) => Array.from(document.getElementById('board-canvas').getContext('2d').getImageData(x, y, 1, 1).data)"""


@pytest.fixture(scope="module")
def running_launch(stack: Stack, console_team: Team) -> Any:
    """A board launch of 480 tiny sandboxes, every one running; torn down afterwards whatever happened."""
    with stack.client(console_team) as api:
        made = api.post(
            "/api/v1/launches",
            json={"template": "base", "size": "tiny", "count": COUNT, "ttl_s": 900, "labels": {"board": "small", "board_text": "forkyard"}},
        )
        assert made.status_code == 201, made.text
        launch_id = made.json()["id"]
        try:
            launch = wait_for_launch(api, launch_id, {"ready", "failed"}, timeout_s=240)
            assert launch["progress"]["running"] == COUNT, launch
            deadline = time.monotonic() + 60
            while api.get(f"/api/v1/launches/{launch_id}").json()["ready_at"] is None:
                assert time.monotonic() < deadline
                time.sleep(0.2)
            yield launch_id
        finally:
            api.delete(f"/api/v1/launches/{launch_id}")


def board(page: Page) -> dict[str, Any]:
    found: dict[str, Any] = page.evaluate(
        "() => ({states: Array.from(window.forkyardBoard.states() || []), counters: window.forkyardBoard.counters(),"
        " messages: window.forkyardBoard.messages(), first: window.forkyardBoard.firstFrameDrawn(),"
        " geometry: window.forkyardBoard.geometry()})"
    )
    return found


def test_the_first_frame_is_the_launchs_before_any_websocket_message(console: Page, running_launch: str, artifacts: Path) -> None:
    console.add_init_script(NO_SOCKETS)
    console.goto(f"/board/?launch={running_launch}")
    shown = board(console)
    assert console.evaluate("window.__socketsMade") == 1 and shown["messages"] == 0, "nothing came over a socket"
    assert shown["first"] and len(shown["states"]) == COUNT
    assert shown["states"] == [RUNNING] * COUNT, "every pixel is the launch's own: running"
    assert (shown["counters"]["requested"], shown["counters"]["running"]) == (COUNT, COUNT)
    expect(console.locator("#c-running")).to_have_text(f"{COUNT}")
    assert console.locator("#c-cost").inner_text() != "$0.00", "the cost so far counts the open periods up to now"
    expect(console.locator("#headline")).to_have_text(re.compile(rf"^{COUNT} running in \d+ s$"))
    expect(console.locator("#c-rate-peak")).not_to_have_text("0")
    first = console.evaluate("window.forkyardBoard.position(0)")
    assert console.evaluate(PIXEL, [first["x"], first["y"]]) == RUNNING_RGBA, "the canvas itself has the pixel drawn"
    screenshot(console, artifacts, "board-first-frame")


def test_presenter_mode_scales_to_whole_pixels_with_gaps_and_no_navigation(console: Page, running_launch: str, artifacts: Path) -> None:
    console.set_viewport_size({"width": 1600, "height": 900})
    console.goto(f"/board/?launch={running_launch}&present=1")
    expect(console.locator("header.topbar")).to_have_count(0)
    expect(console.get_by_role("navigation")).to_have_count(0)
    expect(console.locator("#teardown")).to_have_count(0)
    expect(console.get_by_role("button", name="Full screen")).to_be_visible()
    geometry = board(console)["geometry"]
    assert geometry["scale"] >= 2 and geometry["scale"] == int(geometry["scale"]), geometry
    assert (geometry["canvasWidth"], geometry["canvasHeight"]) == (geometry["width"] * geometry["scale"], geometry["height"] * geometry["scale"])
    assert geometry["block"] == geometry["scale"] - 1, "a one-pixel gap between sandboxes"
    shown_width = console.evaluate("document.getElementById('board-canvas').getBoundingClientRect().width * devicePixelRatio")
    assert abs(shown_width - geometry["canvasWidth"]) < 0.5, "one canvas pixel per device pixel: nothing is smoothed"
    first = console.evaluate("window.forkyardBoard.position(0)")
    block = geometry["block"]
    # Sizing the canvas for presenter mode clears it (every pixel transparent) until the next frame: the
    # pixels are read once that frame is drawn (opaque), then must be exactly the launch's and the gap's.
    console.wait_for_function(f"(xy) => ({PIXEL})(xy)[3] === 255", arg=[first["x"], first["y"]], timeout=10_000)
    assert console.evaluate(PIXEL, [first["x"] + block - 1, first["y"] + block - 1]) == RUNNING_RGBA
    assert console.evaluate(PIXEL, [first["x"] + block, first["y"]]) == BACKGROUND_RGBA, "the gap is background"
    screenshot(console, artifacts, "board-presenter")


def engine_alive(stack: Stack, launch_id: str) -> set[str]:
    assert stack.engine is not None
    with stack.engine.client() as engine:
        return {record["key"] for record in engine.list() if record.get("labels", {}).get("launch") == launch_id}


def test_teardown_asks_first_works_in_place_and_its_colours_follow_the_engine(
    console: Page, stack: Stack, console_team: Team, running_launch: str, artifacts: Path
) -> None:
    with stack.client(console_team) as api:
        # A launch's members come in launch order: pixel i is member i.
        index_of = {member["id"]: index for index, member in enumerate(launch_members(api, running_launch))}
        assert len(index_of) == COUNT
    console.goto(f"/board/?launch={running_launch}")
    expect(console.locator("#connection")).to_have_text("live")
    console.evaluate("window.__sameDocument = true")
    asked: list[str] = []

    def answer(dialog: Any) -> None:
        asked.append(dialog.message)
        dialog.accept()

    console.once("dialog", answer)
    console.get_by_role("button", name="Tear down").click()
    deadline = time.monotonic() + 180
    seen_stopping = seen_off = 0
    while True:
        states = board(console)["states"]
        alive = engine_alive(stack, running_launch)  # read after the pixels: alive now means alive then
        off_but_alive = [sandbox_id for sandbox_id in alive if states[index_of[sandbox_id]] == STOPPED]
        assert off_but_alive == [], f"pixels off while the engine still runs their sandboxes: {off_but_alive[:5]}"
        seen_stopping = max(seen_stopping, states.count(STOPPING))
        seen_off = states.count(STOPPED)
        if seen_stopping and 0 < seen_off < COUNT:
            screenshot(console, artifacts, "board-tearing-down")
        if seen_off == COUNT:
            break
        assert PAUSED not in states
        assert time.monotonic() < deadline, f"the board never turned every pixel off: {states.count(STOPPED)} off"
        time.sleep(0.1)
    assert asked and "started by key demo" in asked[0] and running_launch in asked[0], asked
    assert console.evaluate("window.__sameDocument") is True, "torn down in place: the page did not reload"
    expect(console.locator("#running-chart .main-svg").first).to_be_attached()
    assert engine_alive(stack, running_launch) == set()
    with stack.client(console_team) as api:
        assert wait_for_launch(api, running_launch, {"stopped"}, timeout_s=60)["progress"]["running"] == 0
    # The cost clock has stopped: every period is closed, so the counter stands still.
    time.sleep(1.5)
    cost = board(console)["counters"]["costMicro"]
    time.sleep(2.5)
    assert board(console)["counters"]["costMicro"] == cost
    expect(console.locator("#c-stopping")).to_have_text("0")
    screenshot(console, artifacts, "board-torn-down-in-place")
    if not seen_stopping:
        warnings.warn("the engine destroyed every sandbox between two looks: no stopping pixel was caught", stacklevel=1)
