"""The engine's ports ops: a connection into a sandbox's own loopback, made without any network device.

``ports.connect`` hands the engine connection over to a byte relay: a busybox
echo server (``nc -e cat``) in the sandbox gets what the test sends and sends
it back; a half close reaches it (cat ends at its end of input) and comes
back as the end of the relay.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest

from sandboxes.engine.client import EngineClient
from sandboxes.engine.errors import InvalidRequest, PortNotListening, SandboxNotFound
from sandboxes.engine.protocol import JSON, decode_json, encode_json, read_frame_sync
from tests.support.engine import EngineProcess

pytestmark = pytest.mark.root


def connect(engine_process: EngineProcess, sandbox: str, port: Any) -> tuple[socket.socket, dict[str, Any]]:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.settimeout(30)
    connection.connect(str(engine_process.config.socket_path))
    connection.sendall(encode_json({"op": "ports.connect", "args": {"id": sandbox, "port": port}}))
    kind, payload = read_frame_sync(connection)
    assert kind == JSON
    return connection, decode_json(payload)


def read_to_end(connection: socket.socket) -> bytes:
    parts = []
    while chunk := connection.recv(65536):
        parts.append(chunk)
    return b"".join(parts)


def test_connect_relays_bytes_both_ways_and_a_half_close(
    engine_process: EngineProcess, engine: EngineClient, sandbox: str
) -> None:
    started = engine.call("processes.start", id=sandbox, cmd="nc -ll -p 7000 -e /bin/cat")
    assert started["state"] == "running", started
    assert engine.call("ports.wait", id=sandbox, port=7000, timeout_s=30)["listening"] is True
    connection, answer = connect(engine_process, sandbox, 7000)
    try:
        assert answer == {"ok": True, "result": {"relay": True, "port": 7000}}
        payload = bytes(range(256)) * 4096  # 1 MiB, every byte value: no framing, no decoding
        connection.sendall(payload)
        connection.shutdown(socket.SHUT_WR)  # cat sees the end of its input, exits, and the relay ends
        assert read_to_end(connection) == payload
    finally:
        connection.close()


def test_a_port_nobody_listens_on_is_refused_with_its_code(
    engine_process: EngineProcess, engine: EngineClient, sandbox: str
) -> None:
    connection, answer = connect(engine_process, sandbox, 7001)
    try:
        assert answer["ok"] is False and answer["error"]["code"] == PortNotListening.code
        assert read_to_end(connection) == b""  # and the connection ends
    finally:
        connection.close()
    waited = engine.call("ports.wait", id=sandbox, port=7001, timeout_s=0)
    assert waited["listening"] is False and waited["port"] == 7001


@pytest.mark.parametrize("port", [0, 65536, "80", True, None])
def test_bad_ports_and_sandboxes_are_refused(
    engine_process: EngineProcess, engine: EngineClient, sandbox: str, port: Any
) -> None:
    connection, answer = connect(engine_process, sandbox, port)
    connection.close()
    assert answer["error"]["code"] == InvalidRequest.code and answer["error"]["details"]["field"] == "port"
    with pytest.raises(InvalidRequest):
        engine.call("ports.wait", id=sandbox, port=port, timeout_s=0)
    connection, answer = connect(engine_process, "sb-nobody", 80)
    connection.close()
    assert answer["error"]["code"] == SandboxNotFound.code
