"""``sandbox.ports`` (sync and async) and ``forkyard ports`` against the real stack: a busybox web
server in the sandbox, reached at the URL the SDK hands out."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from forkyard import AsyncClient, Client, ExposedPort, NotFound, Sandbox, WaitTimeout
from tests.support.ports import HTTP_PORT, PAGE, serve_in, via_loopback
from tests.support.stack import Stack

pytestmark = pytest.mark.root


def test_expose_list_close_and_wait_for_port(stack: Stack, fy: Client, sb: Sandbox) -> None:
    with pytest.raises(WaitTimeout):
        sb.ports.wait_for_port(HTTP_PORT, timeout_s=0)
    with stack.client() as api:
        serve_in(api, sb.id)
    sb.ports.wait_for_port(HTTP_PORT, timeout_s=30)
    port = sb.ports.expose(HTTP_PORT, auth="token", token_ttl_s=120)
    assert isinstance(port, ExposedPort) and port.auth == "token" and port.token_url and port.token_expires_at
    address, headers = via_loopback(port.token_url, stack.url)
    page = httpx.get(address, headers=headers, timeout=30)
    assert page.status_code == 200 and page.text == PAGE
    assert [(item.port, item.auth) for item in sb.ports.list()] == [(HTTP_PORT, "token")]
    sb.ports.close(HTTP_PORT)
    assert sb.ports.list() == []
    with pytest.raises(NotFound):
        sb.ports.close(HTTP_PORT)
    with pytest.raises(TypeError):
        sb.ports.expose(HTTP_PORT, authentication="public")  # type: ignore[call-arg]


def test_async_ports(stack: Stack, sb: Sandbox) -> None:
    with stack.client() as api:
        serve_in(api, sb.id)

    async def main() -> tuple[ExposedPort, list[ExposedPort]]:
        async with AsyncClient(stack.url, stack.teams[0].key) as fy:
            sandbox = await fy.sandboxes.get(sb.id)
            await sandbox.ports.wait_for_port(HTTP_PORT, timeout_s=30)
            port = await sandbox.ports.expose(HTTP_PORT, auth="public")
            listed = await sandbox.ports.list()
            await sandbox.ports.close(HTTP_PORT)
            return port, listed

    port, listed = asyncio.run(main())
    assert [item.id for item in listed] == [port.id] and port.token_url is None
    address, headers = via_loopback(port.url, stack.url)
    assert httpx.get(address, headers=headers, timeout=30).status_code == 404  # closed


def test_cli_ports(stack: Stack, cli, sb: Sandbox) -> None:  # type: ignore[no-untyped-def]
    with stack.client() as api:
        serve_in(api, sb.id)
    assert cli("ports", "wait", sb.id, str(HTTP_PORT), "--timeout", "30").returncode == 0
    exposed = cli("ports", "expose", sb.id, str(HTTP_PORT), "--auth", "public")
    assert exposed.returncode == 0, exposed.stderr
    url = exposed.stdout.strip()
    address, headers = via_loopback(url, stack.url)
    assert httpx.get(address, headers=headers, timeout=30).text == PAGE
    listed = cli("ports", "list", sb.id)
    assert listed.returncode == 0 and url in listed.stdout and "public" in listed.stdout
    assert cli("ports", "close", sb.id, str(HTTP_PORT)).returncode == 0
    again = cli("ports", "close", sb.id, str(HTTP_PORT))
    assert again.returncode == 1 and "port_not_found" in again.stderr
    nothing = cli("ports", "wait", sb.id, "7001", "--timeout", "0")
    assert nothing.returncode == 1 and "wait_timeout" in nothing.stderr


def test_cli_forward_relays_a_local_port(stack: Stack, sb: Sandbox) -> None:
    import os
    import subprocess
    import sys

    from tests.sdk.conftest import CLI

    with stack.client() as api:
        serve_in(api, sb.id)
    environment = {**os.environ, "FORKYARD_URL": stack.url, "FORKYARD_API_KEY": stack.teams[0].key}
    command = [str(CLI)] if CLI.exists() else [sys.executable, "-m", "forkyard.cli"]
    forwarding = subprocess.Popen(
        [*command, "ports", "forward", sb.id, str(HTTP_PORT)], env=environment, stdout=subprocess.PIPE, text=True
    )
    try:
        assert forwarding.stdout is not None
        line = forwarding.stdout.readline()  # printed once it listens
        assert line.startswith("forwarding 127.0.0.1:"), line
        local = int(line.split()[1].rsplit(":", 1)[1])
        for _ in range(2):  # each connection its own relay
            page = httpx.get(f"http://127.0.0.1:{local}/index.html", timeout=30)
            assert page.status_code == 200 and page.text == PAGE
    finally:
        forwarding.terminate()  # SIGTERM: the relay ends from inside its loop, and says so by its status
        assert forwarding.wait(timeout=30) == 143
    refused = subprocess.run(
        [*command, "ports", "forward", sb.id, "7002"], env=environment, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 1 and "port_not_listening" in refused.stderr
