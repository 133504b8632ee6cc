"""The desktop environment: screenshots, input, the live view and the sandbox's own Chromium.

The template is the shipped spec (sandboxes/environments/desktop.json) built through the API. Its
`apt` step needs Debian's archive, which tests may not reach, so its packages come the way
``scripts/bootstrap`` installs them, once per machine, into a Debian root filesystem
(/var/cache/forkyard/debian-bookworm-desktop); that is imported as the build's base, and the spec's
other steps and its services are built on it here. Every sandbox is a fork of that template, handed
over with its X server, VNC, noVNC and Chromium running (the snapshot's services).
"""

from __future__ import annotations

import base64
import io
import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image, ImageChops
from playwright.sync_api import Browser, Page

from forkyard import Client
from tests.api.test_template_builds import build
from tests.browser.conftest import sign_in
from tests.support.debian import DESKTOP as DESKTOP_CACHE
from tests.support.debian import import_public, require_root_filesystem
from tests.support.stack import Stack, Team

pytestmark = [pytest.mark.root, pytest.mark.slow]
SPEC = Path(__file__).resolve().parents[2] / "sandboxes" / "environments" / "desktop.json"
# A page of a colour nothing else on the screen has, that paints a green square wherever it is pressed:
# where the page is on the screen, and where a click landed, are both read from screenshots.
PAGE_COLOUR = (48, 96, 192)
MARK_COLOUR = (0, 192, 0)
CLICK_PAGE = """<!doctype html><html><body style="margin:0;background:rgb(48,96,192)">
<canvas id="c" style="display:block"></canvas><script>
const c = document.getElementById('c'); c.width = innerWidth; c.height = innerHeight;
const g = c.getContext('2d');
addEventListener('mousedown', e => { g.fillStyle = 'rgb(0,192,0)'; g.fillRect(e.clientX - 10, e.clientY - 10, 20, 20);
  document.title = 'clicked ' + e.clientX + ',' + e.clientY; });
</script></body></html>"""
# The noVNC canvas at the desktop's size with pixels drawn (the first update follows the resize).
PAINTED = (
    "() => { const c = document.querySelector('#noVNC_container canvas, canvas');"
    " if (!c || c.width !== 1280 || c.height !== 800) return false;"
    " const d = c.getContext('2d').getImageData(0, 0, 640, 400).data;"
    " for (let i = 0; i < d.length; i += 4 * 97) if (d[i] + d[i + 1] + d[i + 2] > 0) return true;"
    " return false; }"
)


@pytest.fixture(scope="module")
def desktop(stack: Stack) -> str:
    """The desktop template, built from the shipped spec on the bootstrap's Debian with its packages."""
    require_root_filesystem(DESKTOP_CACHE, "usr/bin/Xvfb")
    import_public(stack, "debian-desktop", DESKTOP_CACHE)
    spec = json.loads(SPEC.read_text())
    assert spec["steps"][0]["apt"], "the spec's first step installs the desktop's packages"
    name = f"desktop-{uuid.uuid4().hex[:6]}"
    body = {**spec, "name": name, "base": "debian-desktop", "steps": spec["steps"][1:]}
    with stack.client() as api:
        built = build(api, body, timeout_s=600)
    assert built["state"] == "ready", built
    return name


@pytest.fixture
def machine(api: httpx.Client, desktop: str) -> Iterator[str]:
    """A desktop sandbox, running (its services answered), destroyed afterwards."""
    made = api.post("/api/v1/sandboxes", json={"template": desktop, "size": "default", "ttl_s": 600, "wait": True})
    assert made.status_code in (200, 201), made.text
    assert made.json()["state"] == "running", made.json()
    yield made.json()["id"]
    api.delete(f"/api/v1/sandboxes/{made.json()['id']}")


def shot(api: httpx.Client, sandbox_id: str, **options: Any) -> tuple[dict[str, Any], Image.Image]:
    answer = api.post(f"/api/v1/sandboxes/{sandbox_id}/desktop/screenshot", json=options)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    image = Image.open(io.BytesIO(base64.b64decode(data["image_b64"])))
    image.load()
    return data, image.convert("RGB")


def act(api: httpx.Client, sandbox_id: str, *actions: dict[str, Any]) -> dict[str, Any]:
    answer = api.post(f"/api/v1/sandboxes/{sandbox_id}/desktop/actions", json={"actions": list(actions)})
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


def run(api: httpx.Client, sandbox_id: str, cmd: str, timeout_s: float = 30) -> dict[str, Any]:
    answer = api.post(f"/api/v1/sandboxes/{sandbox_id}/exec", json={"cmd": cmd, "timeout_s": timeout_s})
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


def test_a_fork_answers_a_screenshot_of_the_size_asked(api: httpx.Client, machine: str):
    info = api.get(f"/api/v1/sandboxes/{machine}/desktop").json()
    assert info["screen"] == {"width": 1280, "height": 800}, info
    full, image = shot(api, machine)
    assert (full["width"], full["height"], full["scale"], full["format"]) == (1280, 800, 1.0, "png")
    assert image.size == (1280, 800)
    half, image = shot(api, machine, scale=0.5)
    assert image.size == (640, 400) and half["scale"] == 0.5 and half["screen"] == {"width": 1280, "height": 800}
    boxed, image = shot(api, machine, max_width=1024, format="jpeg", quality=60)
    assert image.size == (1024, 640) and boxed["scale"] == 0.8 and boxed["format"] == "jpeg"
    assert base64.b64decode(boxed["image_b64"])[:3] == b"\xff\xd8\xff"


def test_typing_into_a_window_reaches_it_and_changes_the_screen(api: httpx.Client, machine: str):
    # The browser's window maps on its own time after the handover: once it has, nothing covers the xterm.
    deadline = time.monotonic() + 30
    while run(api, machine, "xdotool search --onlyvisible --class chromium")["exit_code"] != 0:
        assert time.monotonic() < deadline, "Chromium did not map its window"
        time.sleep(0.2)
    started = api.post(
        f"/api/v1/sandboxes/{machine}/processes",
        json={"cmd": ["on-display", "xterm", "-geometry", "60x10+40+40", "-e", "sh", "-c", "cat > /tmp/typed"]},
    )
    assert started.status_code == 201, started.text
    deadline = time.monotonic() + 20
    while run(api, machine, "xdotool search --class xterm")["exit_code"] != 0:
        assert time.monotonic() < deadline, "xterm did not map its window"
        time.sleep(0.2)
    time.sleep(0.5)  # drawn
    _, before = shot(api, machine)
    moved = act(api, machine, {"type": "click", "x": 150, "y": 80}, {"type": "type", "text": "hello desktop\n"})
    assert moved["done"] == 2 and moved["cursor"] == {"x": 150, "y": 80}, moved
    deadline = time.monotonic() + 10
    while run(api, machine, "cat /tmp/typed")["stdout"] != "hello desktop\n":
        assert time.monotonic() < deadline, run(api, machine, "cat /tmp/typed")["stdout"]
        time.sleep(0.2)
    _, after = shot(api, machine)
    region = (40, 40, 440, 200)
    assert before.crop(region).tobytes() != after.crop(region).tobytes(), "the typed text is not on the screen"
    # A chord and a key by its agent name reach the window too (ctrl+d ends cat's input: xterm exits).
    act(api, machine, {"type": "key", "keys": ["ctrl", "d"]})
    deadline = time.monotonic() + 10
    while run(api, machine, "xdotool search --class xterm")["exit_code"] == 0:
        assert time.monotonic() < deadline, "ctrl+d did not reach the terminal"
        time.sleep(0.2)


def test_bad_actions_are_refused_before_anything_runs(api: httpx.Client, machine: str):
    off = api.post(
        f"/api/v1/sandboxes/{machine}/desktop/actions",
        json={"actions": [{"type": "move", "x": 5, "y": 5}, {"type": "click", "x": 1280, "y": 10}]},
    )
    assert off.status_code == 400 and off.json()["error"]["field"] == "actions.1.x", off.text
    assert api.get(f"/api/v1/sandboxes/{machine}/desktop").json()["cursor"] != {"x": 5, "y": 5}
    extra = api.post(f"/api/v1/sandboxes/{machine}/desktop/actions", json={"actions": [{"type": "type", "text": "a", "x": 1}]})
    assert extra.status_code == 400 and extra.json()["error"]["field"] == "actions.0", extra.text
    key = api.post(f"/api/v1/sandboxes/{machine}/desktop/actions", json={"actions": [{"type": "key", "keys": "ctrl+nosuch key"}]})
    assert key.status_code == 400 and key.json()["error"]["field"] == "actions.0.keys.1", key.text
    unknown = api.post(f"/api/v1/sandboxes/{machine}/desktop/screenshot", json={"scale": 0.5, "colour": "red"})
    assert unknown.status_code == 400, unknown.text


def test_a_sandbox_without_a_desktop_says_so(api: httpx.Client, running: str):
    for answer in (
        api.get(f"/api/v1/sandboxes/{running}/desktop"),
        api.post(f"/api/v1/sandboxes/{running}/desktop/screenshot", json={}),
        api.post(f"/api/v1/sandboxes/{running}/desktop/actions", json={"actions": [{"type": "move", "x": 1, "y": 1}]}),
    ):
        assert answer.status_code == 409 and answer.json()["error"]["code"] == "desktop_not_running", answer.text


def test_another_teams_key_finds_no_desktop(stack: Stack, team_b: Team, machine: str):
    with stack.client(team_b) as other:
        assert other.post(f"/api/v1/sandboxes/{machine}/desktop/screenshot", json={}).status_code == 404
        assert other.post(f"/api/v1/sandboxes/{machine}/desktop/view", json={}).status_code == 404


def where(image: Image.Image, colour: tuple[int, int, int]) -> tuple[int, int, int, int] | None:
    """The bounding box (left, top, right, bottom) of the pixels of ``colour`` (within 2 of each channel)."""
    channels = [
        band.point(lambda v, c=c: 255 if abs(v - c) <= 2 else 0)
        for band, c in zip(image.convert("RGB").split(), colour, strict=True)
    ]
    return ImageChops.multiply(ImageChops.multiply(channels[0], channels[1]), channels[2]).getbbox()


def serve_click_page(api: httpx.Client, machine: str) -> str:
    """CLICK_PAGE served inside the sandbox, on its own loopback: its URL there."""
    written = api.put(
        f"/api/v1/sandboxes/{machine}/files", params={"path": "/srv/page/click.html", "make_parents": "true"}, content=CLICK_PAGE
    )
    assert written.status_code == 200, written.text
    served = api.post(
        f"/api/v1/sandboxes/{machine}/processes",
        json={"cmd": ["python3", "-m", "http.server", "8000", "--bind", "127.0.0.1", "--directory", "/srv/page"]},
    )
    assert served.status_code == 201, served.text
    assert api.post(f"/api/v1/sandboxes/{machine}/ports/8000/wait", json={"timeout_s": 20}).json()["listening"]
    return "http://127.0.0.1:8000/click.html"


@contextmanager
def sandbox_page(stack: Stack, chromium: Browser, machine: str, url: str) -> Iterator[Page]:
    """The sandbox's own Chromium (its first tab) at ``url``, driven by the suite's Playwright over CDP."""
    with Client(stack.url, stack.teams[0].key) as fy:
        with fy.sandboxes.get(machine).desktop.browser() as cdp:
            assert cdp.startswith("http://127.0.0.1:")
            # The suite's Playwright (one per thread), connecting to the sandbox's browser, not its own.
            browser = chromium.browser_type.connect_over_cdp(cdp)
            try:
                page = browser.contexts[0].pages[0]
                page.goto(url)
                yield page
            finally:
                browser.close()  # the connection: the sandbox's Chromium runs on


def test_playwright_drives_the_sandboxs_chromium_through_a_relayed_port(
    stack: Stack, api: httpx.Client, chromium: Browser, machine: str
):
    with sandbox_page(stack, chromium, machine, serve_click_page(api, machine)) as page:
        assert page.evaluate("document.getElementById('c').width") > 0
        assert page.evaluate("location.origin") == "http://127.0.0.1:8000"


def test_a_click_lands_where_asked_as_the_screenshots_show(stack: Stack, api: httpx.Client, chromium: Browser, machine: str):
    with sandbox_page(stack, chromium, machine, serve_click_page(api, machine)) as page:
        # Where the page is on the screen, from screenshots: the same box twice in a row (Chromium's bars,
        # and the bar it shows about --no-sandbox, settle above the page after it loads).
        deadline, box, seen = time.monotonic() + 20, None, None
        while box is None or box != seen or box[3] - box[1] < 200:
            assert time.monotonic() < deadline, f"the page did not settle on the screen: {box}, then {seen}"
            time.sleep(0.2)
            box, seen = where(shot(api, machine)[1], PAGE_COLOUR), box
        left, top, right, bottom = box
        x, y = (left + right) // 2, (top + bottom) // 2
        _, before = shot(api, machine)
        assert where(before, MARK_COLOUR) is None
        done = act(api, machine, {"type": "click", "x": x, "y": y})
        assert done["cursor"] == {"x": x, "y": y}, done
        # The page saw the press, in its own coordinates: the screen's, less where the page starts (the
        # bar above it shades the page's first rows, so its top is a few rows above the box's).
        page.wait_for_function("document.title.startsWith('clicked')", timeout=10_000)
        client_x, client_y = (int(part) for part in page.title().removeprefix("clicked ").split(","))
        assert x - client_x == left and top - 8 <= y - client_y <= top, (page.title(), box, (x, y))
        # ... and the screen shows the square it painted there, centred on the point asked for.
        deadline = time.monotonic() + 10
        while (mark := where(shot(api, machine)[1], MARK_COLOUR)) is None:
            assert time.monotonic() < deadline, "the click's mark is not on the screen"
            time.sleep(0.1)
        assert abs((mark[0] + mark[2]) / 2 - x) <= 1 and abs((mark[1] + mark[3]) / 2 - y) <= 1, (mark, (x, y))
        # A half-size screenshot shows it at half the coordinates: its scale maps back to the screen.
        half, small = shot(api, machine, scale=0.5)
        found = where(small, MARK_COLOUR)
        assert found is not None and half["scale"] == 0.5
        assert abs((found[0] + found[2]) / 2 / half["scale"] - x) <= 3, (found, x)
        assert abs((found[1] + found[3]) / 2 / half["scale"] - y) <= 3, (found, y)


def test_the_live_view_loads_in_a_browser_and_shows_the_desktop(api: httpx.Client, chromium: Browser, machine: str):
    # Something to see: a window (the X root alone is black).
    started = api.post(f"/api/v1/sandboxes/{machine}/processes", json={"cmd": ["on-display", "xterm", "-geometry", "80x24+0+0"]})
    assert started.status_code == 201, started.text
    deadline = time.monotonic() + 20
    while run(api, machine, "xdotool search --onlyvisible --class xterm")["exit_code"] != 0:
        assert time.monotonic() < deadline, "xterm did not map its window"
        time.sleep(0.2)
    view = api.post(f"/api/v1/sandboxes/{machine}/desktop/view", json={"mode": "view"})
    assert view.status_code == 201, view.text
    assert view.json()["port"] == 6081 and "view_only=1" in view.json()["url"]
    ports = api.get(f"/api/v1/sandboxes/{machine}/ports").json()["ports"]
    assert [(row["port"], row["auth"]) for row in ports] == [(6081, "token")]
    host = view.json()["url"].split("/")[2]
    unsigned = httpx.get(f"http://127.0.0.1:{host.rpartition(':')[2]}/vnc.html", headers={"Host": host})
    assert unsigned.status_code == 401, "without its token the view is refused"
    page = chromium.new_page(viewport={"width": 1400, "height": 900})
    try:
        page.goto(view.json()["url"])
        # Connected at the desktop's size, then its pixels drawn (the first update follows the resize).
        page.wait_for_function(PAINTED, timeout=30_000)
    finally:
        page.close()


def test_the_sandbox_page_shows_its_desktop_live(stack: Stack, page: Page, api: httpx.Client, machine: str, running: str):
    sign_in(page, stack.teams[0])  # the team whose template the desktop is
    # A sandbox without a desktop: its page has no desktop panel (loaded after the page, and empty).
    page.goto(f"/sandboxes/{running}/")
    page.wait_for_selector("#desktop-panel", state="attached")
    assert page.locator("#desktop-panel").is_hidden()
    assert page.get_by_role("button", name="Watch live").count() == 0
    # A desktop's page: watching opens noVNC, view-only, on the preview host, and the desktop is drawn.
    page.goto(f"/sandboxes/{machine}/")
    with page.context.expect_page() as opened:
        page.get_by_role("button", name="Watch live").click()
    view = opened.value
    try:
        view.wait_for_url(lambda url: url.startswith("http://6081-"), wait_until="commit")  # the console's page, then noVNC's
        assert view.url.startswith("http://6081-") and "/vnc.html?" in view.url and "view_only=1" in view.url, view.url
        view.wait_for_function(PAINTED, timeout=30_000)
    finally:
        view.close()
    ports = api.get(f"/api/v1/sandboxes/{machine}/ports").json()["ports"]
    assert [(row["port"], row["auth"]) for row in ports] == [(6081, "token")]
    # Taking control opens the interactive view instead (its own port, 6080).
    with page.context.expect_page() as opened:
        page.get_by_role("button", name="Take control").click()
    control = opened.value
    try:
        control.wait_for_url(lambda url: url.startswith("http://6080-"), wait_until="commit")
        assert control.url.startswith("http://6080-") and "view_only" not in control.url, control.url
    finally:
        control.close()
    assert {row["port"] for row in api.get(f"/api/v1/sandboxes/{machine}/ports").json()["ports"]} == {6080, 6081}
