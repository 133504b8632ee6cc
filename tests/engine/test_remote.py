"""The engine over TCP, for a control plane on another machine: token first, then the same protocol."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes.engine import errors
from sandboxes.engine.client import AsyncEngineClient, EngineClient
from sandboxes.engine.protocol import encode_json, read_frame_sync
from tests.support.engine import EngineProcess

pytestmark = pytest.mark.root
TOKEN = "t0k3n-" + os.urandom(12).hex()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def remote(work_dir: Path) -> Iterator[tuple[EngineProcess, str]]:
    port = _free_port()
    engine = EngineProcess(
        work_dir / f"remote-{os.urandom(3).hex()}",
        env={"FORKYARD_ENGINE_LISTEN": f"127.0.0.1:{port}", "FORKYARD_ENGINE_TOKEN": TOKEN},
    )
    engine.start()
    with engine.client() as client:
        client.call("templates.build_base", name="base", replace=True)
    try:
        yield engine, f"tcp://127.0.0.1:{port}"
    finally:
        engine.reclaim()
        engine.remove_files()


def test_a_client_with_the_token_gets_the_whole_api(remote: tuple[EngineProcess, str]) -> None:
    _, address = remote
    with EngineClient(address, timeout_s=30, token=TOKEN) as client:
        sandbox = client.create(template="base", size="tiny", ttl_s=60)["id"]
        assert client.exec(sandbox, "echo over tcp").stdout == b"over tcp\n"
        client.write_file(sandbox, "/f", b"x" * 300_000)
        assert client.read_file(sandbox, "/f") == b"x" * 300_000
        client.destroy(sandbox)


def test_the_async_client_speaks_tcp_too(remote: tuple[EngineProcess, str]) -> None:
    import asyncio

    _, address = remote

    async def scenario() -> bytes:
        client = AsyncEngineClient(address, token=TOKEN)
        try:
            sandbox = (await client.create(template="base", size="tiny", ttl_s=60))["id"]
            output = (await client.exec(sandbox, "echo async")).stdout
            await client.destroy(sandbox)
            return output
        finally:
            await client.close()

    assert asyncio.run(scenario()) == b"async\n"


def test_a_wrong_or_missing_token_is_refused(remote: tuple[EngineProcess, str]) -> None:
    _, address = remote
    for token in ("wrong-token-of-some-length", ""):
        with pytest.raises(errors.Unavailable, match="refused"):
            EngineClient(address, timeout_s=5, token=token).ping()
    host, port = address[len("tcp://") :].split(":")
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(encode_json({"op": "list", "args": {}}))  # no hello: refused, whatever the op
        kind, payload = read_frame_sync(raw)
        assert b"unauthorized" in payload
        assert raw.recv(1) == b"", "and the connection is closed"


def test_a_sandbox_cannot_reach_the_listener(remote: tuple[EngineProcess, str]) -> None:
    _, address = remote
    port = address.rsplit(":", 1)[1]
    with EngineClient(address, timeout_s=30, token=TOKEN) as client:
        sandbox = client.create(template="base", size="tiny", ttl_s=60)["id"]
        try:
            result = client.exec(sandbox, f"nc -w 1 127.0.0.1 {port} </dev/null; echo exit=$?", timeout_s=10)
            assert b"exit=0" not in result.stdout, "its loopback is its own"
        finally:
            client.destroy(sandbox)
