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
import re
import struct
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
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

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
    show_a_window(api, machine)
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
    show_a_window(api, machine)
    sign_in(page, stack.teams[0])  # the team whose template the desktop is
    # A sandbox without a desktop: its page has no desktop panel (loaded after the page, and empty).
    page.goto(f"/sandboxes/{running}/")
    page.wait_for_selector("#desktop-panel", state="attached")
    assert page.locator("#desktop-panel").is_hidden()
    assert page.get_by_role("button", name="Watch live").count() == 0
    # A desktop's page draws it on the page itself: noVNC from the console, over the console's socket.
    page.goto(f"/sandboxes/{machine}/")
    page.get_by_role("button", name="Watch live").click()
    page.wait_for_function(painted("#desktop-screen canvas"), timeout=30_000)
    page.wait_for_selector("#desktop-screen[data-mode=view]")
    assert api.get(f"/api/v1/sandboxes/{machine}/ports").json()["ports"] == [], "nothing is exposed for it"
    # Watching sends nothing: the pointer over the screen is not the desktop's.
    screen = page.locator("#desktop-screen canvas").bounding_box()
    assert screen is not None and screen["width"] > 100, screen
    at = {"x": int(1280 * 0.75), "y": int(800 * 0.75)}
    assert api.get(f"/api/v1/sandboxes/{machine}/desktop").json()["cursor"] != at
    page.mouse.move(screen["x"] + screen["width"] * 0.75, screen["y"] + screen["height"] * 0.75)
    page.mouse.down()
    page.mouse.up()
    time.sleep(0.5)
    assert api.get(f"/api/v1/sandboxes/{machine}/desktop").json()["cursor"] != at
    # Taking control: the same pointer moves the desktop's, to the point under it on the scaled screen.
    page.get_by_role("button", name="Take control").click()
    page.wait_for_selector("#desktop-screen[data-mode=control]")
    page.wait_for_function(painted("#desktop-screen canvas"), timeout=30_000)
    screen = page.locator("#desktop-screen canvas").bounding_box()  # where it is now (the status line changed)
    assert screen is not None
    page.mouse.move(screen["x"] + screen["width"] * 0.75, screen["y"] + screen["height"] * 0.75 + 1)
    page.mouse.move(screen["x"] + screen["width"] * 0.75, screen["y"] + screen["height"] * 0.75)
    deadline = time.monotonic() + 10
    while True:
        cursor = api.get(f"/api/v1/sandboxes/{machine}/desktop").json()["cursor"]
        if abs(cursor["x"] - at["x"]) <= 3 and abs(cursor["y"] - at["y"]) <= 3:
            break
        assert time.monotonic() < deadline, (cursor, at)
        time.sleep(0.1)
    page.get_by_role("button", name="Close the view").click()
    page.wait_for_selector("#desktop-screen", state="hidden")
    # A view in a tab of its own is still there: the signed noVNC page on the preview host.
    with page.context.expect_page() as opened:
        page.get_by_role("button", name="Watch in a new tab").click()
    view = opened.value
    try:
        view.wait_for_url(lambda url: url.startswith("http://6081-"), wait_until="commit")  # the console's page, then noVNC's
        assert view.url.startswith("http://6081-") and "/vnc.html?" in view.url and "view_only=1" in view.url, view.url
        view.wait_for_function(PAINTED, timeout=30_000)
    finally:
        view.close()
    ports = api.get(f"/api/v1/sandboxes/{machine}/ports").json()["ports"]
    assert [(row["port"], row["auth"]) for row in ports] == [(6081, "token")]


def test_the_consoles_view_socket_relays_vnc_and_watching_drops_input(stack: Stack, api: httpx.Client, machine: str, team_b: Team):
    """The page's socket is a VNC connection, signed in by the session; the view's server drops input itself."""
    owner = session_cookie(stack, stack.teams[0])
    start = api.get(f"/api/v1/sandboxes/{machine}/desktop").json()["cursor"]
    target = (start["x"] + 101) % 1280, (start["y"] + 77) % 800
    # A pointer event sent straight on the view's socket (no noVNC, no viewOnly flag) does not move the pointer...
    with vnc_session(stack, owner, machine, "view") as (size, send):
        assert size == (1280, 800)
        send(struct.pack(">BBHH", 5, 0, *target))
        time.sleep(0.5)
    assert api.get(f"/api/v1/sandboxes/{machine}/desktop").json()["cursor"] == start
    # ... and on the control socket it does.
    with vnc_session(stack, owner, machine, "control") as (size, send):
        send(struct.pack(">BBHH", 5, 0, *target))
        deadline = time.monotonic() + 10
        while api.get(f"/api/v1/sandboxes/{machine}/desktop").json()["cursor"] != {"x": target[0], "y": target[1]}:
            assert time.monotonic() < deadline, api.get(f"/api/v1/sandboxes/{machine}/desktop").json()
            time.sleep(0.1)
    # Refused: without a session, from another team, and a mode that is not one.
    assert refusal(stack, "", machine, "view") == (4401, "unauthorized")
    assert refusal(stack, session_cookie(stack, team_b), machine, "view") == (4404, "sandbox_not_found")
    assert refusal(stack, owner, machine, "anything") == (4400, "invalid_request")


def show_a_window(api: httpx.Client, machine: str) -> None:
    """An xterm at the top left: something to see (the X root alone is black)."""
    started = api.post(f"/api/v1/sandboxes/{machine}/processes", json={"cmd": ["on-display", "xterm", "-geometry", "80x24+0+0"]})
    assert started.status_code == 201, started.text
    deadline = time.monotonic() + 20
    while run(api, machine, "xdotool search --onlyvisible --class xterm")["exit_code"] != 0:
        assert time.monotonic() < deadline, "xterm did not map its window"
        time.sleep(0.2)


def painted(selector: str) -> str:
    """A page function: the canvas at ``selector`` is at the desktop's size and has pixels drawn."""
    return PAINTED.replace("'#noVNC_container canvas, canvas'", json.dumps(selector))


def session_cookie(stack: Stack, team: Team) -> str:
    """The console's session of ``team``'s user, signed in through the login form: a Cookie header."""
    with httpx.Client(base_url=stack.url) as browser:
        form = browser.get("/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text)
        assert token is not None, form.text[:200]
        answer = browser.post(
            "/login/",
            data={"username": team.username, "password": team.password, "csrfmiddlewaretoken": token.group(1)},
            headers={"Referer": f"{stack.url}/login/"},
        )
        assert answer.status_code == 302 and "sessionid" in browser.cookies, answer.status_code
        return "; ".join(f"{name}={value}" for name, value in browser.cookies.items())


def _socket(stack: Stack, cookie: str, sandbox_id: str, mode: str) -> Any:
    headers = {"Origin": stack.url, **({"Cookie": cookie} if cookie else {})}
    return connect(f"ws://127.0.0.1:{stack.ws_port}/ws/desktop/{sandbox_id}/{mode}/", additional_headers=headers, open_timeout=10)


@contextmanager
def vnc_session(stack: Stack, cookie: str, sandbox_id: str, mode: str) -> Iterator[tuple[tuple[int, int], Any]]:
    """A VNC client on the console's view socket, past the handshake (RFC 6143, no authentication):
    (the screen's size, a function that sends a client message)."""
    with _socket(stack, cookie, sandbox_id, mode) as socket:
        pending = bytearray()

        def read(count: int) -> bytes:
            while len(pending) < count:
                message = socket.recv(timeout=10)
                assert isinstance(message, bytes), message
                pending.extend(message)
            taken = bytes(pending[:count])
            del pending[:count]
            return taken

        assert read(12).startswith(b"RFB 003.")
        socket.send(b"RFB 003.008\n")
        offered = read(read(1)[0])
        assert 1 in offered, offered  # None: the VNC servers listen on the sandbox's loopback only, without a password
        socket.send(bytes([1]))
        assert read(4) == b"\0\0\0\0", "security handshake failed"
        socket.send(bytes([1]))  # ClientInit: share the desktop
        width, height = struct.unpack(">HH", read(4))
        read(16)  # the pixel format
        read(struct.unpack(">I", read(4))[0])  # the desktop's name
        yield (width, height), socket.send


def refusal(stack: Stack, cookie: str, sandbox_id: str, mode: str) -> tuple[int, str]:
    """(close code, error code) of a refused view socket."""
    with _socket(stack, cookie, sandbox_id, mode) as socket:
        error = json.loads(socket.recv(timeout=10))
        with pytest.raises(ConnectionClosed) as closed:
            socket.recv(timeout=10)
    assert closed.value.rcvd is not None
    return closed.value.rcvd.code, error["code"]
