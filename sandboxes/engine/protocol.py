"""The engine's local wire format, shared by its server and its clients.

A connection carries frames: one type byte, a 4-byte big-endian length, the
payload.  ``J`` is a JSON object, ``D`` a chunk of a byte stream, ``E`` the end
of that stream.  A request is one ``J`` (``{"op": ..., "args": ...}``),
followed by ``D``* ``E`` when the operation takes a body (file writes and
uploads).  A reply is zero or more event ``J`` frames (``{"event": ...}``),
then one final ``J`` (``{"ok": true, "result": ...}`` or ``{"ok": false,
"error": {"code", "message", "details"}}``), followed by ``D``* ``E`` when
the result says ``"stream": true``, and then a trailer ``J`` (``{"ok":
true}``, or the error that cut the stream short).  A plain ``exec`` sends
its output as ``D`` frames *before* its final ``J`` (``OUTPUT_TAGS``), as the
command writes it: no frame has to hold a whole output.  ``ports.connect``
(``ports.py``) takes the connection over: after its ok ``J``, no more frames,
only the bytes to and from the sandbox's port, both ways, until both ends
finish; then the connection closes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from typing import Any

JSON, DATA, END = b"J", b"D", b"E"
# A plain exec's output comes as data frames before its answer, each one of
# these bytes (which stream) then the bytes the command wrote.
OUTPUT_TAGS = {"stdout": b"1", "stderr": b"2"}
STREAM_OF_TAG = {tag[0]: stream for stream, tag in OUTPUT_TAGS.items()}
HEADER = struct.Struct(">cI")
MAX_FRAME = 16 * 1024 * 1024
CHUNK = 256 * 1024


class ProtocolError(Exception):
    pass


def encode(kind: bytes, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, len(payload)) + payload


def encode_json(message: dict[str, Any]) -> bytes:
    return encode(JSON, json.dumps(message, separators=(",", ":")).encode())


def decode_json(payload: bytes) -> dict[str, Any]:
    try:
        message = json.loads(payload)
    except ValueError as error:
        raise ProtocolError(f"frame is not JSON: {error}") from None
    if not isinstance(message, dict):
        raise ProtocolError("frame is not a JSON object")
    return message


async def read_frame(reader: asyncio.StreamReader, header: bytes | None = None) -> tuple[bytes, bytes]:
    """The next frame; ``header``: its header, if it was read already."""
    if header is None:
        header = await reader.readexactly(HEADER.size)
    kind, length = HEADER.unpack(header)
    if kind not in (JSON, DATA, END):
        raise ProtocolError(f"unknown frame type {kind!r}")
    if length > MAX_FRAME:
        raise ProtocolError(f"frame of {length} bytes is over the {MAX_FRAME}-byte limit")
    return kind, await reader.readexactly(length)


def _receive_exactly(connection: socket.socket, count: int) -> bytes:
    parts = []
    while count:
        chunk = connection.recv(min(count, 1 << 20))
        if not chunk:
            raise ConnectionError("the engine closed the connection")
        parts.append(chunk)
        count -= len(chunk)
    return b"".join(parts)


def read_frame_sync(connection: socket.socket) -> tuple[bytes, bytes]:
    kind, length = HEADER.unpack(_receive_exactly(connection, HEADER.size))
    if kind not in (JSON, DATA, END) or length > MAX_FRAME:
        raise ProtocolError(f"bad frame {kind!r} of {length} bytes")
    return kind, _receive_exactly(connection, length)
