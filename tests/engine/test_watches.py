"""A directory watch at the engine: bounded whatever the sandbox does, and gone with its caller."""

from __future__ import annotations

import socket

import pytest

from sandboxes.engine.protocol import JSON, decode_json, encode_json, read_frame_sync
from tests.engine.engines import wait_for

pytestmark = pytest.mark.root


def _open_watch(engine_process, sandbox: str, path: str, **args: object) -> socket.socket:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader with little room
    connection.connect(str(engine_process.config.socket_path))
    connection.sendall(encode_json({"op": "files.watch", "args": {"id": sandbox, "path": path, **args}}))
    kind, payload = read_frame_sync(connection)
    assert kind == JSON and decode_json(payload) == {"event": "watch", "type": "ready", "path": path}
    return connection


def test_a_flood_under_a_reader_that_does_not_read_is_dropped_and_counted(engine, engine_process, sandbox):
    engine.exec(sandbox, "mkdir /flood")
    connection = _open_watch(engine_process, sandbox, "/flood", timeout_s=60)
    try:
        # Far more events than the socket, the engine's write buffer and the watch's queue hold together.
        count = 20_000
        flood = engine.exec(sandbox, f"cd /flood && i=0; while [ $i -lt {count} ]; do : > f$i; rm f$i; i=$((i+1)); done")
        assert flood.exit_code == 0
        # The engine went on answering meanwhile.
        assert engine.exec(sandbox, "echo alive").stdout == b"alive\n"
        connection.settimeout(30)
        received, dropped = 0, 0
        while True:
            kind, payload = read_frame_sync(connection)
            message = decode_json(payload)
            if "event" not in message:
                break  # the end: it timed out before any overflow reached us
            if message["type"] == "overflow":
                dropped += message["dropped"]
                break
            received += 1
        assert dropped > 0
        assert received + dropped <= 2 * count
    finally:
        connection.close()


def test_a_watch_is_removed_when_its_caller_hangs_up(engine, engine_process, sandbox):
    engine.exec(sandbox, "mkdir /quiet")
    before = engine.call("info")
    connection = _open_watch(engine_process, sandbox, "/quiet")
    assert engine.call("info")["watches"] == before["watches"] + 1
    connection.close()
    # The engine notices the hang-up and removes the watch.
    wait_for(lambda: engine.call("info")["watches"] == before["watches"], "the watch to be removed")
