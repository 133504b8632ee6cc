"""How the control plane reaches a host's engine.

Workers (threads) use blocking clients, one per thread and host.  The web
server (one asyncio loop under Daphne) keeps a small pool of async
connections per host: an engine connection serves one call at a time.

A host's address is what it registered (``FORKYARD_ENGINE_ADDRESS``): a
socket path on one machine, ``tcp://...`` across machines, with the shared
``FORKYARD_ENGINE_TOKEN``.  A process on the host itself takes the socket.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sandboxes.engine.client import AsyncEngineClient, EngineClient
from sandboxes.engine.errors import EngineError, Unavailable, from_dict
from sandboxes.engine.protocol import CHUNK, DATA, END, JSON, decode_json, encode, encode_json, read_frame

POOL_SIZE = 64

_local = threading.local()


def route(address: str) -> str:
    """This host's own engine by its socket; any other by its address."""
    from django.conf import settings

    return settings.FORKYARD_ENGINE_SOCKET if address == settings.FORKYARD_ENGINE_ADDRESS else address


def _token() -> str | None:
    from django.conf import settings

    return settings.FORKYARD_ENGINE_TOKEN or None


def engine(address: str) -> EngineClient:
    """A blocking client for this thread (kept open between calls)."""
    clients: dict[str, EngineClient] = getattr(_local, "clients", None) or {}
    _local.clients = clients
    client = clients.get(address)
    if client is None:
        client = clients[address] = EngineClient(route(address), timeout_s=300, token=_token())
    return client


class AsyncEnginePool:
    def __init__(self, socket_path: str, size: int = POOL_SIZE) -> None:
        self.socket_path = socket_path
        self.idle: list[AsyncEngineClient] = []
        self.slots = asyncio.Semaphore(size)

    @asynccontextmanager
    async def client(self) -> AsyncIterator[AsyncEngineClient]:
        async with self.slots:
            client = self.idle.pop() if self.idle else AsyncEngineClient(route(self.socket_path), token=_token())
            reusable = False
            try:
                yield client
                reusable = True
            except EngineError as error:
                # The engine answered with an error: the connection is intact.
                reusable = not isinstance(error, Unavailable)
                raise
            finally:
                # Anything else (a cancelled request, say) may have left a reply
                # half read: that connection is closed, not reused.
                if reusable and client._streams is not None:
                    self.idle.append(client)
                else:
                    await client.close()


_pools: dict[tuple[int, str], AsyncEnginePool] = {}


def async_pool(socket_path: str) -> AsyncEnginePool:
    key = (id(asyncio.get_running_loop()), socket_path)
    pool = _pools.get(key)
    if pool is None:
        pool = _pools[key] = AsyncEnginePool(socket_path)
    return pool


async def stream_call(
    socket_path: str, op: str, args: dict[str, Any], body: AsyncIterator[bytes] | None = None
) -> AsyncIterator[tuple[str, Any]]:
    """A call whose answer (or request) is a stream, holding one pooled connection.

    Yields ("event", message) for events, ("result", result) once, then
    ("data", chunk) for each chunk of a streamed answer.  Errors the engine
    answers with are raised as engine errors.
    """
    async with async_pool(socket_path).client() as client:
        async with client._lock:
            reader, writer = await client._connect()
            writer.write(encode_json({"op": op, "args": args}))
            if body is not None:
                async for chunk in body:
                    for offset in range(0, len(chunk), CHUNK):
                        writer.write(encode(DATA, chunk[offset : offset + CHUNK]))
                        await writer.drain()
                writer.write(encode(END))
            await writer.drain()
            while True:
                kind, payload = await read_frame(reader)
                if kind != JSON:
                    continue
                message = decode_json(payload)
                if "event" in message:
                    yield "event", message
                    continue
                if not message.get("ok"):
                    raise from_dict(message.get("error") or {})
                result = message.get("result")
                yield "result", result
                if isinstance(result, dict) and result.get("stream"):
                    while True:
                        kind, payload = await read_frame(reader)
                        if kind == END:
                            break
                        if kind == DATA:
                            yield "data", payload
                    kind, payload = await read_frame(reader)
                    trailer = decode_json(payload)
                    if not trailer.get("ok"):
                        raise from_dict(trailer.get("error") or {})
                return
