"""The host's gateway: the public API's data path, answered by the engine that runs the sandbox.

A trainer's loop is mostly commands and small files. Through the control
plane each one crosses the web server (HTTP, the key, the rate limit, the
body's checks) and then the engine's socket, framed and parsed once more.
Here the SDK sends them straight to the host, as the hosted peers do with a
daemon beside each sandbox, and one process answers: the engine itself, over
HTTP (uvicorn's protocol, on the engine's own event loop).

The routes are the API's own, with the same bodies and answers
(``data_path``): ``POST /api/v1/sandboxes/{id}/exec``, ``GET`` and ``PUT
/api/v1/sandboxes/{id}/files?path=``. Nothing else is answered here.

A request, in the order the code runs it (``Gateway.__call__``):

1. Its route, from the method and path alone (``404 not_found`` otherwise).
2. Its data token (``Authorization: Bearer fyd1...``, data_tokens.py), from
   the headers alone, before a byte of the body is read: signed by this
   host, not expired, not of a revoked key, and naming the sandbox in the
   path (``401 data_token_invalid|data_token_expired``).
3. The team's rate, counted here (a fixed one-second window per team, as
   the API's, but per host): over it, ``429 rate_limited`` with
   ``Retry-After``, the body unread.
4. Its body: a declared length over the route's limit is ``413`` at once;
   an exec's body (at most 16 MiB, as the API's) is read whole and checked
   with the API's own model; a file's is streamed to the sandbox's file
   writer as it arrives (``Engine.write_file``: charged to the sandbox).
5. The work, on the engine itself: an exec is cancelled, its command killed,
   if the caller disconnects first (execution.py); a file's bytes are sent
   as they are read, with their length.
6. The answer: the API's body, or the API's refusal for an engine's error
   (``data_path.public_refusal``), with the API's headers (region, request
   id, rate limit).

An exec's output is never held whole in memory, whatever the command prints:
each stream keeps its first ``MEMORY_BYTES`` in memory and the rest, up to
its ``max_output_bytes``, in an unnamed 0600 file of the state directory
(gone when closed); an answer that spilled is sent in chunks from there. The
output is gone once the answer is sent, as everywhere else.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import io
import itertools
import json
import logging
import os
import re
import socket
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

import uvicorn
from pydantic import ValidationError

from . import data_tokens
from .data_path import (
    CallerGone,
    ExecIn,
    ExecOut,
    FileReadQuery,
    FileWriteQuery,
    FileWritten,
    Receive,
    Refusal,
    bad_text,
    exec_args,
    invalid_body,
    public_refusal,
    unknown_parameter,
    until_disconnect,
)
from .errors import EngineError, InvalidRequest

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("forkyard.engine.gateway")

Send = Callable[[Mapping[str, Any]], Awaitable[None]]

MIB = 1024 * 1024
EXEC = re.compile(r"^/api/v1/sandboxes/(?P<sandbox>[^/]+)/exec/?$")
FILES = re.compile(r"^/api/v1/sandboxes/(?P<sandbox>[^/]+)/files/?$")
EXEC_BODY_BYTES = 16 * MIB  # a command's standard input travels in its body (the API's limit)
MEMORY_BYTES = 64 * 1024  # of each output stream, kept in memory; the rest waits in a file
READ_CHUNK = 256 * 1024
SMALL_BODY = 64 * 1024  # a file written with a body up to this long is read whole before the write starts
REVOKED_FOR_S = 24 * 3600  # longer than any token lives


@dataclass(frozen=True)
class Route:
    kind: str  # "exec", "read" or "write"
    sandbox: str


def route(method: str, path: str) -> Route | None:
    if method == "POST" and (match := EXEC.match(path)):
        return Route("exec", match["sandbox"])
    if method in ("GET", "PUT") and (match := FILES.match(path)):
        return Route("read" if method == "GET" else "write", match["sandbox"])
    return None


class Windows:
    """Requests per team in the current second (the API's fixed window, kept by this host)."""

    def __init__(self) -> None:
        self.windows: dict[str, tuple[int, int]] = {}

    def hit(self, team: str, limit: int, now: float) -> tuple[bool, int, float]:
        """(allowed, remaining, seconds until the window resets)."""
        window = int(now)
        current, count = self.windows.get(team, (window, 0))
        if current != window:
            if len(self.windows) > 100_000:
                self.windows.clear()
            current, count = window, 0
        count += 1
        self.windows[team] = (current, count)
        return count <= limit, limit - count, window + 1 - now


class _Output:
    """One stream of an exec's output: its first ``MEMORY_BYTES`` in memory, the rest in an unnamed file."""

    def __init__(self, spool_dir: str) -> None:
        self.spool_dir = spool_dir
        self.head = bytearray()
        self.spill: int | None = None  # an O_TMPFILE descriptor, once the head is full
        self.size = 0

    def add(self, data: bytes) -> None:
        self.size += len(data)
        room = MEMORY_BYTES - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            if self.spill is None:
                self.spill = os.open(self.spool_dir, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
            os.write(self.spill, data)

    def chunks(self) -> Iterator[bytes]:
        yield bytes(self.head)
        if self.spill is not None:
            os.lseek(self.spill, 0, os.SEEK_SET)
            while chunk := os.read(self.spill, READ_CHUNK):
                yield chunk

    def close(self) -> None:
        if self.spill is not None:
            os.close(self.spill)
            self.spill = None


def _text_pieces(chunks: Iterator[bytes], encoding: str) -> Iterator[str]:
    """A stream's bytes as the pieces of one JSON string: UTF-8 text (invalid bytes replaced, as the API
    decodes it) or base64, chunk by chunk, each piece already escaped for JSON."""
    if encoding == "base64":
        pending = b""
        for chunk in chunks:
            pending += chunk
            whole = len(pending) - len(pending) % 3
            if whole:
                yield base64.b64encode(pending[:whole]).decode()
                pending = pending[whole:]
        if pending:
            yield base64.b64encode(pending).decode()
        return
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    for chunk in chunks:
        if text := decoder.decode(chunk):
            yield json.dumps(text)[1:-1]
    if tail := decoder.decode(b"", final=True):
        yield json.dumps(tail)[1:-1]


class _Collected:
    """What an exec sent while it ran (``on_output``); never congested: what memory cannot hold waits on disk."""

    def __init__(self, spool_dir: str) -> None:
        self.streams = {"stdout": _Output(spool_dir), "stderr": _Output(spool_dir)}

    def __call__(self, stream: str, data: bytes) -> None:
        self.streams[stream].add(data)

    def congested(self) -> bool:
        return False

    async def drained(self) -> None:
        return None

    @property
    def spilled(self) -> bool:
        return any(output.spill is not None for output in self.streams.values())

    def answer_pieces(self, summary: Mapping[str, Any], encoding: str) -> Iterator[bytes]:
        """The API's answer (``ExecOut``) to the engine's ``summary``, as JSON in pieces."""
        fields = {name: summary.get(name) for name in ExecOut.model_fields if name in summary}
        yield json.dumps({**fields, "encoding": encoding})[:-1].encode()
        for name in ("stdout", "stderr"):
            yield f', "{name}": "'.encode()
            for piece in _text_pieces(self.streams[name].chunks(), encoding):
                yield piece.encode()
            yield b'"'
        yield b"}"

    def close(self) -> None:
        for output in self.streams.values():
            output.close()


def _header(scope: Mapping[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None


class Gateway:
    """The engine's HTTP listener for the data path (see the module's docstring)."""

    def __init__(self, engine: Engine, secret: bytes, revoked_path: Path | None = None) -> None:
        self.engine = engine
        self.secret = secret
        self.windows = Windows()
        self.revoked_path = revoked_path
        self.revoked: dict[str, float] = _read_revoked(revoked_path)  # key id -> until when its tokens are refused
        self.url = ""
        self.counters = {"requests": 0, "refused": 0, "execs": 0, "reads": 0, "writes": 0, "spilled": 0}
        self._server: Any = None
        self._ticker: asyncio.Task[None] | None = None
        # A request without an id of its own gets this process's prefix and a count: unique, and without
        # a getrandom call a request (uuid4's, a few percent of a small request's CPU here).
        self._ids = itertools.count(1)
        self._id_prefix = os.urandom(8).hex()

    def _request_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids):016x}"

    # --- the listener ---------------------------------------------------------------------

    async def listen(self, address: str, public_url: str = "") -> str:
        """Serve on ``address`` (``host:port``; port 0 takes a free one); the URL callers use (``public_url``,
        or the address bound)."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidRequest(f"gateway address {address!r} is not host:port", field="gateway")
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host.strip("[]"), int(port)))
        listener.listen(4096)
        listener.setblocking(False)
        bound_host, bound_port = listener.getsockname()[:2]
        config = uvicorn.Config(
            self,
            http="httptools",
            ws="none",
            lifespan="off",
            access_log=False,
            log_config=None,
            server_header=False,
            proxy_headers=False,
            timeout_keep_alive=75,
            backlog=4096,
        )
        config.load()
        self._server = uvicorn.Server(config)
        self._server.lifespan = config.lifespan_class(config)  # "off": what Server.serve would make; nothing runs
        await self._server.startup(sockets=[listener])
        self._ticker = asyncio.get_running_loop().create_task(self._server.main_loop())  # its Date header
        shown = f"[{bound_host}]" if family == socket.AF_INET6 else bound_host
        self.url = public_url.rstrip("/") or f"http://{shown}:{bound_port}"
        return self.url

    async def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._ticker is not None:
                await self._ticker
            await self._server.shutdown()
            self._server = None

    def revoke(self, keys: list[str], now: float) -> int:
        """Refuse every token of these keys from now on."""
        for key in keys:
            self.revoked[key] = now + REVOKED_FOR_S
        for key, until in list(self.revoked.items()):
            if until <= now:
                del self.revoked[key]
        if self.revoked_path is not None:
            data_tokens.write_private(self.revoked_path, json.dumps(self.revoked).encode())
        return len(self.revoked)

    def info(self) -> dict[str, Any]:
        return {"url": self.url, **self.counters, "revoked_keys": len(self.revoked)}

    # --- a request ------------------------------------------------------------------------

    async def __call__(self, scope: Mapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        self.counters["requests"] += 1
        request_id = _header(scope, b"x-request-id") or self._request_id()
        headers = [(b"x-request-id", request_id.encode()[:128]), (b"x-content-type-options", b"nosniff")]
        call = route(scope["method"], scope["path"])
        if call is None:
            what = f"{scope['method']} {scope['path'][:200]}"
            await self._refuse(
                send, headers, Refusal(404, "not_found", f"this host's gateway answers commands and files only, not {what}")
            )
            return
        try:
            grant = self._grant(scope, call)
        except data_tokens.TokenRefused as refused:
            await self._refuse(send, headers, Refusal(401, refused.code, refused.message))
            return
        headers.append((b"x-forkyard-region", grant.region.encode()))
        allowed, remaining, reset_s = self.windows.hit(grant.team, grant.rate, time.time())
        headers += [
            (b"x-ratelimit-limit", str(grant.rate).encode()),
            (b"x-ratelimit-remaining", str(max(0, remaining)).encode()),
            (b"x-ratelimit-reset", str(max(1, int(reset_s + 0.999))).encode()),
        ]
        if not allowed:
            over = Refusal(429, "rate_limited", f"over the team's limit of {grant.rate} requests per second", retry_after_s=1)
            await self._refuse(send, headers, over)
            return
        try:
            if call.kind == "exec":
                await self._exec(scope, receive, send, headers, grant)
            elif call.kind == "read":
                await self._read(scope, send, headers, grant)
            else:
                await self._write(scope, receive, send, headers, grant)
        except CallerGone:
            pass  # nobody to answer; an exec's command ended with its caller
        except _Answer as answer:
            await self._refuse(send, headers, answer.refusal)
        except EngineError as error:
            await self._refuse(send, headers, public_refusal(error, grant.engine_id, grant.sandbox))

    def _grant(self, scope: Mapping[str, Any], call: Route) -> data_tokens.Grant:
        scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise data_tokens.TokenRefused("data_token_invalid", "a data token is required: Authorization: Bearer <token>")
        grant = data_tokens.verify(self.secret, token.strip(), time.time())
        if grant.key in self.revoked:
            raise data_tokens.TokenRefused("data_token_invalid", "the API key this data token was given to was revoked")
        if grant.sandbox != call.sandbox:
            raise data_tokens.TokenRefused("data_token_invalid", f"this data token is for sandbox {grant.sandbox}, not this one")
        return grant

    async def _refuse(self, send: Send, headers: list[tuple[bytes, bytes]], refusal: Refusal) -> None:
        self.counters["refused"] += 1
        extra = [] if refusal.retry_after_s is None else [(b"retry-after", str(refusal.retry_after_s).encode())]
        await _json(send, refusal.status, refusal.body(), headers + extra)

    # --- exec -----------------------------------------------------------------------------

    async def _exec(
        self, scope: Mapping[str, Any], receive: Receive, send: Send, headers: list[Any], grant: data_tokens.Grant
    ) -> None:
        body = await _bounded_body(scope, receive, EXEC_BODY_BYTES)
        payload = _exec_payload(body)
        self.counters["execs"] += 1
        collected = _Collected(str(self.engine.config.state_dir))
        try:
            work = self.engine.exec(grant.engine_id, exec_args(payload), collected, collected)
            summary = (await until_disconnect(receive, work)).summary()
            if collected.spilled:
                self.counters["spilled"] += 1
                await send(
                    {"type": "http.response.start", "status": 200, "headers": [*headers, (b"content-type", b"application/json")]}
                )
                for piece in collected.answer_pieces(summary, payload.output):
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
            else:
                await _raw_json(send, 200, b"".join(collected.answer_pieces(summary, payload.output)), headers)
        finally:
            collected.close()

    # --- files ----------------------------------------------------------------------------

    async def _read(self, scope: Mapping[str, Any], send: Send, headers: list[Any], grant: data_tokens.Grant) -> None:
        """The file's bytes with their length. Opened and read in a worker thread (a file system may block),
        except what reads in one call: a file of at most ``READ_CHUNK`` bytes once it is open."""
        path = _file_query(scope, writes=False)["path"]
        self.counters["reads"] += 1
        tree = self.engine.open_tree(grant.engine_id)
        fd, size = await asyncio.to_thread(self.engine.open_file, tree, path)
        try:
            start = {
                "type": "http.response.start",
                "status": 200,
                "headers": [*headers, (b"content-type", b"application/octet-stream"), (b"content-length", str(size).encode())],
            }
            await send(start)
            remaining = size
            while remaining > 0:
                wanted = min(READ_CHUNK, remaining)
                chunk = os.read(fd, wanted) if size <= READ_CHUNK else await asyncio.to_thread(os.read, fd, wanted)
                if not chunk:
                    # Shorter than when it was opened: the length already sent cannot be kept, so the
                    # connection is dropped (uvicorn closes it) rather than the answer finished short.
                    raise RuntimeError(f"{path!r} of sandbox {grant.sandbox} shrank while it was read")
                remaining -= len(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": remaining > 0})
        finally:
            os.close(fd)

    async def _write(
        self, scope: Mapping[str, Any], receive: Receive, send: Send, headers: list[Any], grant: data_tokens.Grant
    ) -> None:
        query = _file_query(scope, writes=True)
        limit = self.engine.config.max_file_bytes
        declared = _header(scope, b"content-length")
        length = int(declared) if declared is not None and declared.isdigit() else None
        if length is not None and length > limit:
            raise _Answer(_too_large(limit))
        self.counters["writes"] += 1
        loop = asyncio.get_running_loop()

        async def next_message() -> Mapping[str, Any]:
            return await receive()

        def chunks() -> Iterator[bytes]:
            while True:
                message = asyncio.run_coroutine_threadsafe(next_message(), loop).result()
                if message["type"] == "http.disconnect":
                    raise ConnectionResetError("the caller left before its file was sent whole")
                if data := message.get("body", b""):
                    yield data
                if not message.get("more_body", False):
                    return

        # A small body (most are) is read whole on the loop first: the writer's thread then never waits on
        # the loop for a chunk (a hop each way per message, most of a small write's overhead); a longer one
        # is pulled as the writer takes it.
        content = await _bounded_body(scope, receive, limit) if length is not None and length <= SMALL_BODY else chunks
        result = await self.engine.write_file(grant.engine_id, query["path"], content, query["mode"], query["make_parents"])
        await _json(send, 200, FileWritten.model_validate(result).model_dump(), headers)


def _read_revoked(path: Path | None) -> dict[str, float]:
    """The revoked keys a restarted engine still refuses (a key revoked must stay so across a restart)."""
    if path is None:
        return {}
    try:
        kept = json.loads(path.read_bytes())
    except (FileNotFoundError, ValueError):
        return {}
    now = time.time()
    return {str(key): float(until) for key, until in kept.items() if isinstance(until, (int, float)) and until > now}


class _Answer(Exception):
    """A refusal found while reading the request."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


def _too_large(limit: int) -> Refusal:
    return Refusal(413, "too_large", f"the request body is over this endpoint's limit of {limit} bytes", details={"limit": limit})


async def _bounded_body(scope: Mapping[str, Any], receive: Receive, limit: int) -> bytes:
    declared = _header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _Answer(_too_large(limit))
    body = io.BytesIO()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise CallerGone()
        body.write(message.get("body", b""))
        if body.tell() > limit:
            raise _Answer(_too_large(limit))
        if not message.get("more_body", False):
            return body.getvalue()


def _exec_payload(body: bytes) -> ExecIn:
    """The exec's body, checked as the API's view checks it: JSON, valid Unicode, the API's model."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        raise _Answer(Refusal(400, "invalid_request", f"the body is not JSON: {error}")) from None
    where = bad_text(document)
    if where is not None:
        message = f"{where or 'the body'}: text must be valid Unicode (a lone surrogate is not)"
        raise _Answer(Refusal(400, "invalid_text", message, field=where or None))
    try:
        return ExecIn.model_validate(document)
    except ValidationError as error:
        raise _Answer(invalid_body(error.errors(), source=("body", "payload"))) from None


def _file_query(scope: Mapping[str, Any], writes: bool) -> dict[str, Any]:
    """A file request's parameters, checked as the API's view checks them (``data_path.File*Query``)."""
    model = FileWriteQuery if writes else FileReadQuery
    pairs = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    given = [name for name, _ in pairs]
    unknown = sorted(set(given) - set(model.model_fields))
    if unknown:
        raise _Answer(unknown_parameter(scope["method"], scope["path"], unknown, list(model.model_fields)))
    try:
        return model.model_validate(dict(pairs)).model_dump()
    except ValidationError as error:
        raise _Answer(invalid_body(error.errors(), source=("query",))) from None


async def _json(send: Send, status: int, body: Any, headers: list[tuple[bytes, bytes]]) -> None:
    await _raw_json(send, status, json.dumps(body).encode(), headers)


async def _raw_json(send: Send, status: int, content: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": content})
