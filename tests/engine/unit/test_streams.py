"""The engine's byte streams end, whatever fails: a trailer after ``E``, always (no root needed)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from sandboxes.engine import server
from sandboxes.engine.errors import TooLarge
from sandboxes.engine.protocol import DATA, END, JSON, read_frame_sync


def _frames_of(produce) -> list[tuple[bytes, Any]]:
    """Run ``Call.stream_from_thread`` over a socket pair; the frames the caller reads."""
    ours, theirs = socket.socketpair()

    async def serve() -> None:
        _, writer = await asyncio.open_connection(sock=ours)
        call = server.Call(SimpleNamespace(engine=None), {}, writer, None)  # type: ignore[arg-type]
        try:
            await call.stream_from_thread(produce)
        except server._AlreadyAnswered:
            pass
        await writer.drain()
        writer.close()

    asyncio.run(serve())
    frames = []
    theirs.settimeout(10)
    while True:
        try:
            kind, payload = read_frame_sync(theirs)
        except ConnectionError:
            break
        frames.append((kind, json.loads(payload) if kind == JSON else payload))
    theirs.close()
    return frames


def test_a_stream_that_ends_has_an_ok_trailer():
    def produce() -> Iterator[bytes]:
        yield b"one"
        yield b"two"

    assert _frames_of(produce) == [
        (JSON, {"ok": True, "result": {"stream": True}}),
        (DATA, b"one"),
        (DATA, b"two"),
        (END, b""),
        (JSON, {"ok": True, "result": {}}),
    ]


@pytest.mark.parametrize(
    "failure,code",
    [
        (TooLarge("too deep", limit=256), "too_large"),
        (OSError(2, "gone"), "internal_error"),
        (RecursionError("deep"), "internal_error"),
    ],
)
def test_a_failure_mid_stream_ends_it_with_the_error_as_trailer(failure: BaseException, code: str):
    def produce() -> Iterator[bytes]:
        yield b"first"
        raise failure

    frames = _frames_of(produce)
    assert frames[:3] == [(JSON, {"ok": True, "result": {"stream": True}}), (DATA, b"first"), (END, b"")]
    assert frames[3][0] == JSON and frames[3][1]["ok"] is False and frames[3][1]["error"]["code"] == code
    assert len(frames) == 4


def test_a_failure_before_the_first_chunk_is_the_answer():
    def produce() -> Iterator[bytes]:
        raise TooLarge("too big", size=1)
        yield b""  # pragma: no cover - a generator

    with pytest.raises(TooLarge):
        asyncio.run(_first_answer(produce))


async def _first_answer(produce) -> None:
    ours, theirs = socket.socketpair()
    try:
        _, writer = await asyncio.open_connection(sock=ours)
        await server.Call(SimpleNamespace(engine=None), {}, writer, None).stream_from_thread(produce)  # type: ignore[arg-type]
    finally:
        theirs.close()


def test_error_details_that_do_not_serialize_still_make_a_trailer():
    def produce() -> Iterator[bytes]:
        yield b"x"
        raise TooLarge("with a strange detail", path=object())

    trailer = _frames_of(produce)[-1][1]
    assert trailer["ok"] is False and trailer["error"] == {"code": "too_large", "message": "with a strange detail", "details": {}}
