"""The desktop's screen dump is the sandbox's file: a forged or short one is refused, never trusted."""

from __future__ import annotations

import struct

import pytest

from sandboxes.engine.desktop import XWD_HEADER, read_header, screenshot_options, target_size, xdotool_argv
from sandboxes.engine.errors import DesktopNotRunning, InvalidRequest


def header(width: int = 64, height: int = 32, bytes_per_line: int | None = None, ncolors: int = 0) -> bytes:
    """An XWD header as Xvfb writes it for a 24-bit screen (little-endian pixels)."""
    row = width * 4 if bytes_per_line is None else bytes_per_line
    fields = [XWD_HEADER.size, 7, 2, 24, width, height, 0, 0, 32, 0, 32, 32, row, 4, 0xFF0000, 0xFF00, 0xFF, 8]
    return struct.pack(">25I", *fields, ncolors, ncolors, width, height, 0, 0, 0)


def full_size(width: int = 64, height: int = 32, ncolors: int = 0) -> int:
    return XWD_HEADER.size + ncolors * 12 + width * 4 * height


def test_a_screen_dump_as_xvfb_writes_it_is_read():
    screen = read_header(header(ncolors=256), full_size(ncolors=256))
    assert (screen.width, screen.height, screen.bytes_per_line) == (64, 32, 256)
    assert screen.offset == XWD_HEADER.size + 256 * 12 and screen.little_endian


@pytest.mark.parametrize(
    ("data", "size"),
    [
        (header(), full_size() - 1),  # shorter than its header says
        (header(), 50),  # not even a header
        (header(bytes_per_line=1 << 30), 1 << 40),  # rows of a gigabyte, in a (sparse) file as large as they need
        (header(bytes_per_line=100), full_size()),  # rows narrower than the width
        (header(width=0), full_size()),
        (header(width=9000), full_size(width=9000)),
    ],
    ids=["short", "no-header", "huge-rows", "narrow-rows", "no-width", "too-wide"],
)
def test_a_forged_or_short_dump_is_refused(data: bytes, size: int):
    with pytest.raises(DesktopNotRunning):
        read_header(data, size)


def test_screenshot_options_are_checked_before_the_screen_is_read():
    for args, field in (
        ({"format": "gif"}, "format"),
        ({"scale": 2}, "scale"),
        ({"max_width": 8}, "max_width"),
        ({"colour": 1}, "colour"),
    ):
        with pytest.raises(InvalidRequest) as refused:
            screenshot_options(args)
        assert refused.value.details["field"] == field
    screen = read_header(header(1280, 800), full_size(1280, 800))
    assert target_size(screen, screenshot_options({"max_width": 1024})) == (1024, 640, 0.8)
    assert target_size(screen, screenshot_options({"scale": 0.5, "max_height": 600})) == (640, 400, 0.5)
    assert target_size(screen, screenshot_options({})) == (1280, 800, 1.0)


def test_moves_do_not_wait_for_the_pointer_to_move():
    """xdotool's ``mousemove --sync`` waits (15 s) when the pointer is already where it is sent: an agent
    clicking twice at one place must not wait for it."""
    screen = read_header(header(1280, 800), full_size(1280, 800))
    for action in (
        {"type": "move", "x": 10, "y": 10},
        {"type": "click", "x": 10, "y": 10},
        {"type": "drag", "path": [{"x": 1, "y": 1}, {"x": 10, "y": 10}]},
    ):
        argv = xdotool_argv(action, "actions.0", screen)
        assert isinstance(argv, list) and "mousemove" in argv and "--sync" not in argv, argv


def test_one_press_is_not_followed_by_a_delay():
    """xdotool sleeps ``--delay`` after the last click or key too (100 ms for a click unless told): a
    single one is given none."""
    screen = read_header(header(1280, 800), full_size(1280, 800))
    assert xdotool_argv({"type": "click", "x": 5, "y": 5}, "a", screen) == [
        "xdotool",
        "mousemove",
        "5",
        "5",
        "click",
        "--delay",
        "0",
        "1",
    ]
    assert xdotool_argv({"type": "key", "keys": "enter"}, "a", screen) == ["xdotool", "key", "--delay", "0", "Return"]
    double = xdotool_argv({"type": "double_click"}, "a", screen)
    assert double == ["xdotool", "click", "--repeat", "2", "--delay", "80", "1"]
    assert xdotool_argv({"type": "key", "keys": "tab", "repeat": 3}, "a", screen) == [
        "xdotool",
        "key",
        "--repeat",
        "3",
        "--delay",
        "20",
        "Tab",
    ]
