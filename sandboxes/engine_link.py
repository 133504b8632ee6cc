"""How the control plane reaches a host's engine, and what its errors mean here.

Workers (threads) use blocking clients, one per thread and host.  The web
server (one asyncio loop under Daphne) keeps a small pool of async
connections per host: an engine connection serves one call at a time.

A host's address is what it registered (``FORKYARD_ENGINE_ADDRESS``): a
socket path on one machine, ``tcp://...`` across machines, with the shared
``FORKYARD_ENGINE_TOKEN``.  A process on the host itself takes the socket.

Every blocking client comes from one factory, ``connect``: the in-process
tests of the worker and the transitions swap it for a recording fake engine
(``connected_to``), as youki's cgroup tests do with their test manager.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Protocol

from django.conf import settings

from console.errors import Conflict, Failed, InvalidRequest, NotFound, OverLimit, Refused, TooLarge, Unavailable
from sandboxes.engine import errors as engine_errors
from sandboxes.engine.client import AsyncEngineClient, EngineClient
from sandboxes.engine.data_path import public_refusal
from sandboxes.engine.protocol import CHUNK, DATA, END, JSON, decode_json, encode, encode_json, read_frame

POOL_SIZE = 64

_local = threading.local()


def route(address: str) -> str:
    """This host's own engine by its socket; any other by its address."""
    return settings.FORKYARD_ENGINE_SOCKET if address == settings.FORKYARD_ENGINE_ADDRESS else address


def _token() -> str | None:
    return settings.FORKYARD_ENGINE_TOKEN or None


def _connect_for_real(address: str) -> EngineClient:
    return EngineClient(route(address), timeout_s=300, token=_token())


connect: Callable[[str], EngineClient] = _connect_for_real


def engine(address: str) -> EngineClient:
    """A blocking client for this thread (kept open between calls, and made again once
    ``connect`` changed: a long-lived thread does not keep a client of the old factory)."""
    clients: dict[str, EngineClient] = getattr(_local, "clients", None) or {}
    if getattr(_local, "factory", None) is not connect:
        clients = {}
        _local.factory = connect
    _local.clients = clients
    client = clients.get(address)
    if client is None:
        client = clients[address] = connect(address)
    return client


@contextmanager
def connected_to(factory: Callable[[str], Any]) -> Iterator[None]:
    """Every blocking engine client made meanwhile comes from ``factory`` (the tests' fake engine)."""
    global connect
    previous, connect = connect, factory
    try:
        yield
    finally:
        connect = previous


class Named(Protocol):
    """A sandbox as both sides know it: the engine's id for it and its public id."""

    @property
    def engine_id(self) -> str: ...

    @property
    def id(self) -> str: ...


# The kind of refusal each public status is, so that the API's one table (console.api_base.STATUS) turns it back.
_KINDS: dict[int, type[Refused]] = {
    400: InvalidRequest,
    404: NotFound,
    409: Conflict,
    413: TooLarge,
    429: OverLimit,
    503: Unavailable,
}


def refusal(error: engine_errors.EngineError, sandbox: Named | None = None) -> Refused:
    """What an engine's error means to a caller of the control plane (``data_path.public_refusal``: the
    same answer a host's gateway gives), naming the sandbox as the caller knows it, by its public id."""
    public = public_refusal(error, sandbox.engine_id if sandbox else None, sandbox.id if sandbox else None)
    kind = _KINDS.get(public.status, Failed)
    if kind is Unavailable:
        return Unavailable(public.code, public.message, retry_after_s=public.retry_after_s or 5)
    return kind(public.code, public.message, field=public.field, details=public.details)


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
            except engine_errors.EngineError as error:
                # The engine answered with an error: the connection is intact.
                reusable = not isinstance(error, engine_errors.Unavailable)
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
    socket_path: str, op: str, args: dict[str, Any], body: AsyncIterator[bytes] | None = None, *, pooled: bool = True
) -> AsyncGenerator[tuple[str, Any], None]:
    """A call whose answer (or request) is a stream, holding one pooled connection
    (or, not ``pooled``, a connection of its own: a call that may last as long
    as its caller wants, a watch, must not hold one of the pool's few slots).

    Yields ("event", message) for events, ("result", result) once, then
    ("data", chunk) for each chunk of a streamed answer.  Errors the engine
    answers with are raised as engine errors.
    """
    if not pooled:
        own = AsyncEngineClient(route(socket_path), token=_token())
        try:
            async for item in _stream_on(own, op, args, body):
                yield item
        finally:
            await own.close()
        return
    async with async_pool(socket_path).client() as client:
        async for item in _stream_on(client, op, args, body):
            yield item


async def _stream_on(
    client: AsyncEngineClient, op: str, args: dict[str, Any], body: AsyncIterator[bytes] | None
) -> AsyncGenerator[tuple[str, Any], None]:
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
                raise engine_errors.from_dict(message.get("error") or {})
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
                    raise engine_errors.from_dict(trailer.get("error") or {})
            return


async def open_port(address: str, engine_id: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection of its own to ``port`` in the sandbox (the engine's ``ports.connect``): after
    this, the streams carry the bytes to and from the sandbox's port, nothing else.  The caller
    closes the writer.  ``port_not_listening`` (and any other engine error) is raised."""
    client = AsyncEngineClient(route(address), token=_token())
    reader, writer = await client._connect()
    try:
        writer.write(encode_json({"op": "ports.connect", "args": {"id": engine_id, "port": port}}))
        await writer.drain()
        kind, payload = await read_frame(reader)
        message = decode_json(payload) if kind == JSON else {}
        if not message.get("ok"):
            raise engine_errors.from_dict(message.get("error") or {"code": "protocol_error", "message": "no answer"})
    except (OSError, asyncio.IncompleteReadError) as error:
        writer.close()
        raise engine_errors.Unavailable(f"lost the engine connection: {error}") from error
    except BaseException:
        writer.close()
        raise
    return reader, writer
