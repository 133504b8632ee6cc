"""``forkyard ports forward``: a local TCP port relayed to a sandbox's port.

Each connection to the local listener opens a websocket to the API
(``/api/v1/sandboxes/{id}/ports/{port}/connect``, with the API key) that
carries that connection's bytes to and from 127.0.0.1:port in the sandbox;
so any TCP protocol goes through, not only HTTP.  Needs the ``websockets``
package (``pip install 'forkyard[forward]'``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import Callable
from typing import Any

from .errors import ConfigurationError, ForkyardError


def _websocket_url(api_url: str, sandbox_id: str, port: int) -> str:
    base = api_url.rstrip("/")
    scheme = "wss" if base.startswith("https://") else "ws"
    return f"{scheme}://{base.split('://', 1)[1]}/api/v1/sandboxes/{sandbox_id}/ports/{int(port)}/connect"


async def _relay(local_reader: asyncio.StreamReader, local_writer: asyncio.StreamWriter, connect: Callable[[], Any]) -> None:
    try:
        async with connect() as websocket:

            async def upstream() -> None:
                while chunk := await local_reader.read(256 * 1024):
                    await websocket.send(chunk)
                await websocket.send(json.dumps({"type": "eof"}))

            async def downstream() -> None:
                async for message in websocket:
                    if isinstance(message, bytes):
                        local_writer.write(message)
                        await local_writer.drain()
                    else:
                        error = json.loads(message)
                        if error.get("type") == "error":
                            print(f"error [{error.get('code')}]: {error.get('message')}", flush=True)

            sending = asyncio.ensure_future(upstream())
            try:
                await downstream()
            finally:
                sending.cancel()
    except Exception as error:  # noqa: BLE001 - one connection's failure ends that connection only
        print(f"error [forward]: {type(error).__name__}: {error}", flush=True)
    finally:
        local_writer.close()


async def forward(
    api_url: str, api_key: str, sandbox_id: str, port: int, local_port: int, on_ready: Callable[[int], None]
) -> None:
    """Listen on 127.0.0.1:``local_port`` (0: any free port) until cancelled."""
    try:
        from websockets.asyncio.client import connect as websocket_connect
    except ImportError:
        raise ConfigurationError(
            "forward_unavailable", "forwarding needs the websockets package: pip install 'forkyard[forward]'"
        ) from None
    url = _websocket_url(api_url, sandbox_id, port)

    def connect() -> Any:
        # close_timeout: a relay ended by a signal says goodbye briefly, not for websockets' default 10 s.
        return websocket_connect(url, additional_headers={"Authorization": f"Bearer {api_key}"}, max_size=None, close_timeout=2)

    # One connection first, so that a bad key, sandbox or port is said at once rather than per connection.
    async with connect() as probe:
        with contextlib.suppress(asyncio.TimeoutError):
            first = await asyncio.wait_for(probe.recv(), 0.5)
            if isinstance(first, str) and json.loads(first).get("type") == "error":
                error = json.loads(first)
                raise ForkyardError(str(error.get("code")), str(error.get("message")))
    server = await asyncio.start_server(lambda reader, writer: _relay(reader, writer, connect), "127.0.0.1", local_port)
    async with server:
        on_ready(server.sockets[0].getsockname()[1])
        await server.serve_forever()


def run(api_url: str, api_key: str, sandbox_id: str, port: int, local_port: int, on_ready: Callable[[int], None]) -> int:
    """Forward until SIGTERM (exit status 143) or Ctrl-C (``KeyboardInterrupt``, as ``asyncio.run`` raises it).

    SIGTERM is taken by the event loop and cancels the forwarding, as ``asyncio.run`` does with Ctrl-C:
    the SDK's own SIGTERM handler raises wherever the main thread happens to be, which inside a
    websocket's frame parser leaves that connection broken half way and the process hanging at exit."""

    async def until_terminated() -> int:
        loop = asyncio.get_running_loop()
        forwarding = asyncio.ensure_future(forward(api_url, api_key, sandbox_id, port, local_port, on_ready))
        terminated = False

        def terminate() -> None:
            nonlocal terminated
            terminated = True
            forwarding.cancel()

        previous = signal.getsignal(signal.SIGTERM)
        loop.add_signal_handler(signal.SIGTERM, terminate)
        try:
            await forwarding
        except asyncio.CancelledError:
            if not terminated:
                raise
        finally:
            loop.remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, previous)
        return 128 + signal.SIGTERM if terminated else 0

    return asyncio.run(until_terminated())
