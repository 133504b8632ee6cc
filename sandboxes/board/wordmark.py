"""The board's wordmark: text rendered to a bitmap on the server, one lit pixel per sandbox.

Pixels are numbered in reading order (row by row, left to right); pixel *i*
is the launch's sandbox *i*.  Rendering picks the largest font size whose text
has at most ``target`` lit pixels, then underlines the text with exactly the
pixels still missing, so a wordmark has exactly as many pixels as asked: the
default full-size one has 32,752.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

FULL = 32_752
PRESETS = {"small": 480, "medium": 4_096, "full": FULL}
MAX_PIXELS = 65_535
UNDERLINE_GAP = 3


@dataclass(frozen=True)
class Wordmark:
    text: str
    width: int
    height: int
    bits: bytes  # row-major, most significant bit first, rows padded to whole bytes

    @property
    def row_bytes(self) -> int:
        return (self.width + 7) // 8

    def lit(self) -> list[tuple[int, int]]:
        """(x, y) of every lit pixel, in reading order: index = sandbox number."""
        points = []
        for y in range(self.height):
            row = self.bits[y * self.row_bytes : (y + 1) * self.row_bytes]
            for x in range(self.width):
                if row[x >> 3] & (0x80 >> (x & 7)):
                    points.append((x, y))
        return points

    @property
    def count(self) -> int:
        return sum(bin(byte).count("1") for byte in self.bits)


def _render(text: str, size: int) -> Image.Image:
    font = ImageFont.load_default(size=size)
    # Whole pixels: FreeType's box is made of ints, though a font's type allows floats.
    left, top, right, bottom = (int(edge) for edge in font.getbbox(text))
    image = Image.new("1", (max(1, right - left), max(1, bottom - top)), 0)
    ImageDraw.Draw(image).text((-left, -top), text, font=font, fill=1)
    return image


def _lit(image: Image.Image) -> int:
    return sum(image.histogram()[1:])  # every pixel that is not 0


@functools.lru_cache(maxsize=32)
def render(text: str = "forkyard", target: int = FULL) -> Wordmark:
    """``text`` drawn with exactly ``target`` lit pixels."""
    if not 1 <= target <= MAX_PIXELS:
        raise ValueError(f"a wordmark has 1 to {MAX_PIXELS} pixels")
    text = text.strip() or "forkyard"
    low, high = 4, 600
    best = None
    while low <= high:  # the largest size that does not overshoot
        middle = (low + high) // 2
        image = _render(text, middle)
        if _lit(image) <= target:
            best, low = image, middle + 1
        else:
            high = middle - 1
    if best is None:
        best = Image.new("1", (1, 1), 0)
    missing = target - _lit(best)
    width = max(best.width, 8)
    underline_rows = (missing + width - 1) // width
    height = best.height + (UNDERLINE_GAP + underline_rows if missing else 0)
    canvas = Image.new("1", (width, height), 0)
    canvas.paste(best, (0, 0))
    pixels = canvas.load()
    assert pixels is not None  # an image made in memory always has its pixels
    for index in range(missing):
        pixels[index % width, best.height + UNDERLINE_GAP + index // width] = 1
    bits = canvas.tobytes()  # mode "1": rows padded to bytes, MSB first
    mark = Wordmark(text=text, width=width, height=height, bits=bits)
    assert mark.count == target, (mark.count, target)
    return mark
