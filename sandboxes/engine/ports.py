"""A sandbox's TCP ports, reached from the host without any network device.

Every sandbox has a network namespace of its own with loopback only.  To
reach a port in it, the engine makes a socket *in that namespace*
(``fork_services.netns_socket``: the thread enters it with setns, makes the
socket and leaves at once; the socket stays bound to the namespace it was
made in) and connects it to ``127.0.0.1:port``.  ``ports.connect`` then hands
the caller's engine connection over to a plain byte relay between the two:
after its ``J`` answer, no more frames, just the bytes each side sends, in
both directions, until both have finished (a half close is passed on).
That is what the control plane's preview URLs (``console/preview.py``) and
the CLI's port forwarding ride on: HTTP, streamed answers and websockets
alike, since the relay never looks at the bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import Any

from .errors import InvalidRequest, PortNotListening

CONNECT_TIMEOUT_S = 5.0
RELAY_CHUNK = 256 * 1024
MAX_WAIT_S = 300.0


def parse_port(value: Any, field: str = "port") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        raise InvalidRequest("port is a TCP port number from 1 to 65535", field=field)
    return value


async def connect(open_socket: Callable[[], socket.socket], port: int, sandbox_id: str) -> socket.socket:
    """A socket connected to ``127.0.0.1:port`` in the sandbox; ``port_not_listening`` if nothing accepts."""
    loop = asyncio.get_running_loop()
    made = open_socket()
    try:
        await asyncio.wait_for(loop.sock_connect(made, ("127.0.0.1", port)), CONNECT_TIMEOUT_S)
    except (OSError, TimeoutError) as error:
        made.close()
        reason = "nothing listens on it" if isinstance(error, ConnectionRefusedError) else f"cannot connect: {error}"
        raise PortNotListening(f"port {port} of sandbox {sandbox_id}: {reason} (yet)", sandbox=sandbox_id, port=port) from None
    made.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return made


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until the reader's end, then pass the end on (a half close)."""
    try:
        while True:
            chunk = await reader.read(RELAY_CHUNK)
            if not chunk:
                break
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass


async def relay(caller_reader: asyncio.StreamReader, caller_writer: asyncio.StreamWriter, connected: socket.socket) -> None:
    """Bytes both ways between the caller and the sandbox's socket until both ends finish (or either breaks)."""
    reader, writer = await asyncio.open_connection(sock=connected, limit=RELAY_CHUNK)
    pumps = [
        asyncio.ensure_future(_pump(caller_reader, writer)),
        asyncio.ensure_future(_pump(reader, caller_writer)),
    ]
    try:
        await asyncio.gather(*pumps)
    finally:
        for pump in pumps:
            pump.cancel()
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


def wait_service(port: int, timeout_s: float) -> dict[str, Any]:
    """A readiness check as fork_services runs them: accepting on ``port``."""
    return {"name": f"port {port}", "ready": {"tcp": port}, "timeout_s": timeout_s}
