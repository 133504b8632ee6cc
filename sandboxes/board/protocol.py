"""The board's wire format (no Django here: tools and benchmarks decode it too).

See sandboxes/board/ticker.py for what the frames mean and who sends them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

MAGIC = b"FY"
VERSION = 2  # 2: paused and stopping pixels, and their counters
COUNTERS = struct.Struct("<8IIQ")
HEADER = struct.Struct("<2sBcIH")
RUN = struct.Struct("<IHB")
# A pixel's state. STOPPED is "off": its sandbox has really ended (the engine destroyed it, or it
# never started); a sandbox asked to stop is STOPPING until then.
REQUESTED, STARTING, RUNNING, FAILED, STOPPED, STOPPING, PAUSED = range(7)


@dataclass
class Counters:
    """A launch's members by stage, as ``GET /api/v1/launches/{id}`` counts them (``running`` holds the
    paused ones, ``ended`` the stopping ones: ``paused`` and ``stopping`` say how many of each)."""

    requested: int = 0
    queued: int = 0
    creating: int = 0
    running: int = 0
    failed: int = 0
    ended: int = 0
    paused: int = 0
    stopping: int = 0
    elapsed_ms: int = 0
    cost_micro_usd: int = 0

    def pack(self) -> bytes:
        return COUNTERS.pack(
            self.requested,
            self.queued,
            self.creating,
            self.running,
            self.failed,
            self.ended,
            self.paused,
            self.stopping,
            min(self.elapsed_ms, 2**32 - 1),
            self.cost_micro_usd,
        )

    @classmethod
    def unpack(cls, data: bytes, offset: int = 0) -> Counters:
        return cls(*COUNTERS.unpack_from(data, offset))


def section_id(launch_id: str) -> bytes:
    raw = launch_id.encode()
    return struct.pack("<B", len(raw)) + raw


def frame(kind: bytes, seq: int, sections: list[bytes]) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, seq, len(sections)) + b"".join(sections)


def runs(changes: dict[int, int]) -> list[tuple[int, int, int]]:
    """{index: state} -> [(start, length, state)], consecutive equal states merged."""
    result: list[tuple[int, int, int]] = []
    for index in sorted(changes):
        state = changes[index]
        if result and result[-1][0] + result[-1][1] == index and result[-1][2] == state and result[-1][1] < 65535:
            start, length, _ = result[-1]
            result[-1] = (start, length + 1, state)
        else:
            result.append((index, 1, state))
    return result


def delta_section(launch_id: str, counters: Counters, changes: dict[int, int]) -> bytes:
    encoded = runs(changes)
    return section_id(launch_id) + counters.pack() + struct.pack("<I", len(encoded)) + b"".join(RUN.pack(*run) for run in encoded)


def parse(data: bytes) -> dict[str, Any]:
    """Decode a frame (for tests and tools; the browser has its own decoder)."""
    magic, version, kind, seq, count = HEADER.unpack_from(data)
    assert magic == MAGIC and version == VERSION
    offset = HEADER.size
    sections = []
    for _ in range(count):
        length = data[offset]
        launch_id = data[offset + 1 : offset + 1 + length].decode()
        offset += 1 + length
        section: dict[str, Any] = {"launch": launch_id}
        if kind == b"L":
            width, height = struct.unpack_from("<HH", data, offset)
            size = ((width + 7) // 8) * height
            section.update(width=width, height=height, bits=data[offset + 4 : offset + 4 + size])
            offset += 4 + size
        else:
            section["counters"] = Counters.unpack(data, offset)
            offset += COUNTERS.size
            (items,) = struct.unpack_from("<I", data, offset)
            offset += 4
            if kind == b"S":
                section["states"] = data[offset : offset + items]
                offset += items
            else:
                section["runs"] = [RUN.unpack_from(data, offset + i * RUN.size) for i in range(items)]
                offset += items * RUN.size
        sections.append(section)
    return {"kind": kind.decode(), "seq": seq, "sections": sections, "size": offset}
