"""A sandbox's desktop, for computer-use agents: screenshots and input.

A desktop sandbox runs an X server inside it (the ``desktop`` environment:
``sandboxes/environments/desktop.json``; its processes are the snapshot's
services, so every fork starts its own).  Its X server is Xvfb started with
``-fbdir``, so the screen is also a file in the sandbox, in X's own dump
format (XWD), kept current by the X server itself.

* **Screenshot**: the engine reads that file from the host through the
  sandbox's root (``Engine.open_tree``: resolved inside the sandbox, never
  following a link out of it), checks its header against its size (the file
  is the sandbox's: a forged or truncated one is refused, not trusted),
  and encodes the pixels as PNG or JPEG, scaled when asked.  No process runs
  in the sandbox for it.
* **Input**: each action is one ``xdotool`` command run in the sandbox with
  the sandbox's confinement like any exec (argv, never a shell), against
  display ``:0``.  The action set is the union of what computer-use agents
  are trained on (move, click with any button and count, press and release,
  drag along a path, scroll, key chords, hold a key, type text, wait, cursor
  position), so an agent's actions map one to one.  Coordinates are screen
  pixels and must be on the screen.

A sandbox without a running desktop is ``desktop_not_running`` (409).
"""

from __future__ import annotations

import asyncio
import io
import mmap
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import DesktopNotRunning, EngineError, InvalidRequest
from .execution import ExecResult
from .trees import Tree

DISPLAY = ":0"
FB_DIR = "/tmp/.forkyard-desktop"  # Xvfb -fbdir: the screen as a file (the desktop environment's xvfb service)
FB_FILE = f"{FB_DIR}/Xvfb_screen0"
MAX_SIDE = 8192
MAX_ACTIONS = 64
MAX_TEXT = 10_000
MAX_WAIT_S = 10.0
ACTION_TIMEOUT_S = 30.0
TYPE_DELAY_MS = 2
BUTTONS = {"left": 1, "middle": 2, "right": 3, "back": 8, "forward": 9}
CLICK_COUNTS = {"click": None, "double_click": 2, "triple_click": 3}
KEY_ALIASES = {
    "enter": "Return", "return": "Return", "esc": "Escape", "escape": "Escape", "backspace": "BackSpace",
    "tab": "Tab", "space": "space", "delete": "Delete", "del": "Delete", "insert": "Insert", "home": "Home",
    "end": "End", "pageup": "Prior", "page_up": "Prior", "pagedown": "Next", "page_down": "Next",
    "up": "Up", "down": "Down", "left": "Left", "right": "Right", "arrowup": "Up", "arrowdown": "Down",
    "arrowleft": "Left", "arrowright": "Right", "ctrl": "ctrl", "control": "ctrl", "alt": "alt", "option": "alt",
    "shift": "shift", "cmd": "super", "command": "super", "meta": "super", "super": "super", "win": "super",
    "capslock": "Caps_Lock", "caps_lock": "Caps_Lock",
}  # fmt: skip
PUNCTUATION = {
    "-": "minus", "=": "equal", "/": "slash", ".": "period", ",": "comma", ";": "semicolon", "'": "apostrophe",
    "[": "bracketleft", "]": "bracketright", "\\": "backslash", "`": "grave", " ": "space", "+": "plus",
    "*": "asterisk", "!": "exclam", "@": "at", "#": "numbersign", "$": "dollar", "%": "percent",
    "^": "asciicircum", "&": "ampersand", "(": "parenleft", ")": "parenright", "_": "underscore", ":": "colon",
    '"': "quotedbl", "<": "less", ">": "greater", "?": "question", "{": "braceleft", "}": "braceright",
    "|": "bar", "~": "asciitilde",
}  # fmt: skip
KEYSYM = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_]{0,31}$")
FUNCTION_KEY = re.compile(r"^f([1-9]|1[0-9]|2[0-4])$")
XWD_HEADER = struct.Struct(">25I")
XWD_COLOR = 12  # bytes per colormap entry after the header and window name


@dataclass(frozen=True)
class Screen:
    """The X server's screen as its dump file describes it."""

    width: int
    height: int
    bytes_per_line: int
    offset: int  # of the first pixel in the file
    little_endian: bool


def read_header(data: bytes | mmap.mmap, size: int) -> Screen:
    """The screen of an XWD dump of ``size`` bytes (Xvfb's -fbdir file): 32-bit TrueColor pixels only."""
    if size < XWD_HEADER.size:
        raise DesktopNotRunning("the desktop's screen is not there yet (its X server has not started)")
    fields = XWD_HEADER.unpack_from(data, 0)
    header_size, version, pixmap_format, depth, width, height = fields[:6]
    byte_order, bits_per_pixel, bytes_per_line, ncolors = fields[7], fields[11], fields[12], fields[19]
    red, green, blue = fields[14:17]
    true_color = (red, green, blue) == (0xFF0000, 0xFF00, 0xFF)
    if version != 7 or pixmap_format != 2 or depth != 24 or bits_per_pixel != 32 or not true_color:
        raise DesktopNotRunning("the desktop's screen is not a 24-bit X screen dump (start Xvfb with -screen 0 WxHx24)")
    # A row is the width's pixels padded to at most 32 bits more: a wider row in a forged (sparse) file
    # would have the engine copy gigabytes.
    row_ok = width * 4 <= bytes_per_line <= width * 4 + 4
    if not (0 < width <= MAX_SIDE and 0 < height <= MAX_SIDE) or not row_ok or ncolors > 1 << 16 or header_size > 1 << 16:
        raise DesktopNotRunning(f"the desktop's screen dump has an impossible geometry ({width}x{height})")
    offset = header_size + ncolors * XWD_COLOR
    if header_size < XWD_HEADER.size or offset + bytes_per_line * height > size:
        raise DesktopNotRunning("the desktop's screen dump is shorter than its header says")
    return Screen(width, height, bytes_per_line, offset, byte_order == 0)


def encode(data: bytes | mmap.mmap, screen: Screen, width: int, height: int, image_format: str, quality: int) -> bytes:
    """The screen's pixels as an image of ``width`` x ``height`` (scaled when smaller than the screen)."""
    from PIL import Image  # the engine's only use of Pillow: loaded on the first screenshot

    raw = "BGRX" if screen.little_endian else "XRGB"
    pixels = bytes(data[screen.offset : screen.offset + screen.bytes_per_line * screen.height])
    image = Image.frombuffer("RGB", (screen.width, screen.height), pixels, "raw", raw, screen.bytes_per_line, 1)
    if (width, height) != (screen.width, screen.height):
        image = image.resize((width, height), Image.Resampling.BILINEAR)
    out = io.BytesIO()
    if image_format == "jpeg":
        image.save(out, "JPEG", quality=quality)
    else:
        image.save(out, "PNG", compress_level=1)
    return out.getvalue()


@dataclass(frozen=True)
class ShotOptions:
    """A screenshot's options, checked before the screen is read."""

    image_format: str
    quality: int
    scale: float
    max_width: int | None
    max_height: int | None


def screenshot_options(args: dict[str, Any]) -> ShotOptions:
    unknown = set(args) - {"id", "scale", "max_width", "max_height", "format", "quality"}
    if unknown:
        raise InvalidRequest(f"unknown screenshot fields: {', '.join(sorted(unknown))}", field=sorted(unknown)[0])
    image_format = args.get("format", "png")
    if image_format not in ("png", "jpeg"):
        raise InvalidRequest("format is png or jpeg", field="format")
    quality = _int(args, "quality", "screenshot", 10, 95, default=80) if image_format == "jpeg" else 0
    scale = args.get("scale")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0.05 <= scale <= 1:
            raise InvalidRequest("scale is a number from 0.05 to 1", field="scale")
    box = []
    for name in ("max_width", "max_height"):
        value = args.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 16 <= value <= MAX_SIDE):
            raise InvalidRequest(f"{name} is a number of pixels from 16 to {MAX_SIDE}", field=name)
        box.append(value)
    return ShotOptions(image_format, quality, float(1.0 if scale is None else scale), box[0], box[1])


def target_size(screen: Screen, options: ShotOptions) -> tuple[int, int, float]:
    """The image's size and its scale from ``scale`` or a box (``max_width``/``max_height``), never larger."""
    factors = [options.scale, 1.0]
    for limit, side in ((options.max_width, screen.width), (options.max_height, screen.height)):
        if limit is not None:
            factors.append(limit / side)
    factor = min(factors)
    width, height = max(1, round(screen.width * factor)), max(1, round(screen.height * factor))
    return width, height, width / screen.width


def _int(raw: dict[str, Any], name: str, field: str, low: int, high: int, default: int | None = None) -> int:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequest(f"{name} is an integer from {low} to {high}", field=f"{field}.{name}")
    return value


def _point(raw: Any, field: str, screen: Screen) -> tuple[int, int]:
    if not isinstance(raw, dict):
        raise InvalidRequest("a point is {x, y}", field=field)
    return _int(raw, "x", field, 0, screen.width - 1), _int(raw, "y", field, 0, screen.height - 1)


def _button(raw: dict[str, Any], field: str) -> str:
    button = raw.get("button", "left")
    if button not in BUTTONS:
        raise InvalidRequest(f"button is one of {', '.join(BUTTONS)}", field=f"{field}.button")
    return str(BUTTONS[button])


def keysym(name: Any, field: str) -> str:
    """An X keysym for a key as agents name it: 'enter', 'ctrl', 'a', 'F5', '-', 'Page_Up'."""
    if not isinstance(name, str) or not name:
        raise InvalidRequest("a key is a name such as 'enter', 'ctrl', 'a' or 'F5'", field=field)
    if len(name) == 1:
        if name.isascii() and name.isalnum():
            return name
        if name in PUNCTUATION:
            return PUNCTUATION[name]
        raise InvalidRequest(f"unknown key {name!r}: type it as text instead", field=field)
    lowered = name.lower()
    if lowered in KEY_ALIASES:
        return KEY_ALIASES[lowered]
    if FUNCTION_KEY.match(lowered):
        return lowered.upper()
    if KEYSYM.match(name):
        return name  # an X keysym by its own name (Page_Up, KP_Enter, XF86AudioMute)
    raise InvalidRequest(f"unknown key {name[:40]!r}", field=field)


def chord(raw: dict[str, Any], field: str) -> str:
    """``keys`` (a list pressed together, or one string 'ctrl+shift+t') as xdotool's chord."""
    keys = raw.get("keys")
    if isinstance(keys, str):
        keys = keys.split("+") if keys != "+" else ["+"]
    if not isinstance(keys, list) or not 1 <= len(keys) <= 8:
        raise InvalidRequest(
            "keys is a list of 1 to 8 keys pressed together, or one string such as 'ctrl+c'", field=f"{field}.keys"
        )
    return "+".join(keysym(key, f"{field}.keys.{index}") for index, key in enumerate(keys))


def _repeat(count: int, delay_ms: int) -> list[str]:
    """xdotool's options for ``count`` presses ``delay_ms`` apart; one press gets ``--delay 0``, as
    xdotool sleeps the delay (by default 100 ms for a click) after the last press too."""
    return ["--repeat", str(count), "--delay", str(delay_ms)] if count > 1 else ["--delay", "0"]


def xdotool_argv(action: Any, field: str, screen: Screen) -> list[str] | float | None:
    """One action: the xdotool argv that does it, seconds to wait (``wait``), or None (``cursor_position``)."""
    if not isinstance(action, dict) or not isinstance(action.get("type"), str):
        raise InvalidRequest("an action is an object with a type", field=field)
    kind = action["type"]
    allowed = ACTION_FIELDS.get(kind)
    if allowed is None:
        raise InvalidRequest(f"unknown action {kind[:40]!r}: one of {', '.join(ACTION_FIELDS)}", field=f"{field}.type")
    unknown = set(action) - allowed - {"type"}
    if unknown:
        raise InvalidRequest(f"unknown fields for {kind}: {', '.join(sorted(unknown))}", field=field)
    # No ``mousemove --sync``: it waits for the pointer to leave where it is, so a move to where it
    # already is waited xdotool's 15 s. One xdotool's requests reach the X server in order, and each
    # action's xdotool has exited (its display closed, so synced) before the next one starts.
    argv = ["xdotool"]
    if kind in ("move", "click", "double_click", "triple_click", "mouse_down", "mouse_up", "scroll"):
        if kind == "move" or "x" in action or "y" in action:
            x, y = _point(action, field, screen)
            argv += ["mousemove", str(x), str(y)]
    if kind == "move":
        return argv
    if kind in CLICK_COUNTS:
        count = CLICK_COUNTS[kind] or _int(action, "count", field, 1, 3, default=1)
        return [*argv, "click", *_repeat(count, 80), _button(action, field)]
    if kind in ("mouse_down", "mouse_up"):
        return [*argv, kind.replace("_", ""), _button(action, field)]
    if kind == "drag":
        path = action.get("path")
        if not isinstance(path, list) or not 2 <= len(path) <= 256:
            raise InvalidRequest("path is a list of 2 to 256 points {x, y}", field=f"{field}.path")
        points = [_point(point, f"{field}.path.{index}", screen) for index, point in enumerate(path)]
        button = _button(action, field)
        argv += ["mousemove", *map(str, points[0]), "mousedown", button]
        for x, y in points[1:]:
            argv += ["mousemove", str(x), str(y)]
        return [*argv, "mouseup", button]
    if kind == "scroll":
        dx, dy = _int(action, "dx", field, -100, 100, default=0), _int(action, "dy", field, -100, 100, default=0)
        for amount, (negative, positive) in ((dy, ("4", "5")), (dx, ("6", "7"))):
            if amount:
                argv += ["click", "--repeat", str(abs(amount)), "--delay", "10", positive if amount > 0 else negative]
        return argv
    if kind == "key":
        repeat = _int(action, "repeat", field, 1, 100, default=1)
        return [*argv, "key", *_repeat(repeat, 20), chord(action, field)]
    if kind == "hold_key":
        keys = chord(action, field)
        seconds = action.get("seconds", 0.5)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= MAX_WAIT_S:
            raise InvalidRequest(f"seconds is a number from 0 to {MAX_WAIT_S:g}", field=f"{field}.seconds")
        return [*argv, "keydown", keys, "sleep", f"{seconds:.3f}", "keyup", keys]
    if kind == "type":
        text = action.get("text")
        if not isinstance(text, str) or not 1 <= len(text) <= MAX_TEXT or "\0" in text:
            raise InvalidRequest(f"text is 1 to {MAX_TEXT} characters, without NUL", field=f"{field}.text")
        return [*argv, "type", "--delay", str(TYPE_DELAY_MS), "--", text]
    if kind == "wait":
        seconds = action.get("seconds", 1.0)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= MAX_WAIT_S:
            raise InvalidRequest(f"seconds is a number from 0 to {MAX_WAIT_S:g}", field=f"{field}.seconds")
        return float(seconds)
    return None  # cursor_position: answered after every batch anyway


POINTER = {"x", "y"}
ACTION_FIELDS: dict[str, set[str]] = {
    "move": POINTER,
    "click": POINTER | {"button", "count"},
    "double_click": POINTER | {"button"},
    "triple_click": POINTER | {"button"},
    "mouse_down": POINTER | {"button"},
    "mouse_up": POINTER | {"button"},
    "drag": {"path", "button"},
    "scroll": POINTER | {"dx", "dy"},
    "key": {"keys", "repeat"},
    "hold_key": {"keys", "seconds"},
    "type": {"text"},
    "wait": {"seconds"},
    "cursor_position": set(),
}
LOCATION = re.compile(rb"x:(\d+) y:(\d+)")


class DesktopHost(Protocol):
    """What the desktop needs of the engine (``engine.Engine`` is one): a protocol, so that the
    engine imports this module and not the other way round."""

    def open_tree(self, sandbox_id: Any, starting: bool = False) -> Tree: ...

    async def exec(self, sandbox_id: Any, args: dict[str, Any]) -> ExecResult: ...


class Desktop:
    """The engine's desktop operations (``desktop.*``) on one engine's sandboxes."""

    def __init__(self, engine: DesktopHost) -> None:
        self.engine = engine

    def _read(self, tree: Tree, options: ShotOptions | None) -> tuple[Screen, dict[str, Any]]:
        """The screen dump of ``tree`` (``open_tree``, on the loop; its fd is closed here), and the image
        ``options`` ask for (none: the header only). Blocking: for a worker thread."""
        try:
            fd, size = tree.open_regular(FB_FILE)
        except EngineError as error:
            raise DesktopNotRunning(
                f"the sandbox has no desktop running (no screen at {FB_FILE}): create it from the desktop"
                " environment, or start Xvfb with -fbdir " + FB_DIR,
            ) from error
        finally:
            os.close(tree.root_fd)
        try:
            if size < XWD_HEADER.size:
                return read_header(b"", size), {}
            with mmap.mmap(fd, size, prot=mmap.PROT_READ) as data:
                screen = read_header(data, size)
                if options is None:
                    return screen, {}
                width, height, scale = target_size(screen, options)
                image = encode(data, screen, width, height, options.image_format, options.quality)
        finally:
            os.close(fd)
        return screen, {"width": width, "height": height, "scale": scale, "format": options.image_format, "image": image}

    async def _screen(self, sandbox_id: Any, options: ShotOptions | None = None) -> tuple[Screen, dict[str, Any]]:
        return await asyncio.to_thread(self._read, self.engine.open_tree(sandbox_id), options)

    async def screenshot(self, sandbox_id: Any, args: dict[str, Any]) -> dict[str, Any]:
        """``{width, height, scale, format, image, screen: {width, height}}``; ``image`` is the encoded bytes."""
        screen, shot = await self._screen(sandbox_id, screenshot_options(args))
        return {**shot, "screen": {"width": screen.width, "height": screen.height}}

    async def _xdotool(self, sandbox_id: Any, argv: list[str]) -> bytes:
        """Run one xdotool argv in the sandbox, as any exec is run (``Engine.exec``)."""
        args = {"cmd": argv, "env": {"DISPLAY": DISPLAY}, "timeout_s": ACTION_TIMEOUT_S, "max_output_bytes": 4096}
        result = await self.engine.exec(sandbox_id, args)
        if result.exit_code != 0:
            detail = (result.stderr or result.stdout).decode(errors="replace").strip()[:300]
            if result.exit_code == 127:
                raise DesktopNotRunning(f"sandbox {sandbox_id} has no xdotool: is it a desktop sandbox?", sandbox=sandbox_id)
            raise DesktopNotRunning(
                f"the desktop refused the action ({detail or f'exit {result.exit_code}'})", sandbox=sandbox_id
            )
        return bytes(result.stdout)

    async def cursor(self, sandbox_id: Any) -> dict[str, int]:
        found = LOCATION.search(await self._xdotool(sandbox_id, ["xdotool", "getmouselocation"]))
        if found is None:
            raise DesktopNotRunning("the desktop did not report its cursor", sandbox=sandbox_id)
        return {"x": int(found.group(1)), "y": int(found.group(2))}

    async def info(self, sandbox_id: Any) -> dict[str, Any]:
        """The screen's size and the cursor's position."""
        screen, _ = await self._screen(sandbox_id)
        return {"screen": {"width": screen.width, "height": screen.height}, "cursor": await self.cursor(sandbox_id)}

    async def act(self, sandbox_id: Any, actions: Any) -> dict[str, Any]:
        """Do ``actions`` in order (all checked before the first runs): ``{done, screen, cursor}``."""
        if not isinstance(actions, list) or not 1 <= len(actions) <= MAX_ACTIONS:
            raise InvalidRequest(f"actions is a list of 1 to {MAX_ACTIONS} actions", field="actions")
        screen, _ = await self._screen(sandbox_id)
        steps = [xdotool_argv(action, f"actions.{index}", screen) for index, action in enumerate(actions)]
        for step in steps:
            if isinstance(step, float):
                await asyncio.sleep(step)
            elif step is not None:
                await self._xdotool(sandbox_id, step)
        return {
            "done": len(steps),
            "screen": {"width": screen.width, "height": screen.height},
            "cursor": await self.cursor(sandbox_id),
        }
