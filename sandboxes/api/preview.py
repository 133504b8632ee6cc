"""Preview URLs: a sandbox's exposed port at ``http://{port}-{sandbox}.{FORKYARD_PREVIEW_DOMAIN}``.

``console/asgi.py`` sends a request whose Host names a preview here before
anything else (no API key is asked for by default, no Django request is
made).  It finds the exposed port (``selectors.preview_target``), checks its
``auth``, opens a connection to the port through the sandbox's engine
(``engine_link.open_port``: the engine's ``ports.connect``, a byte relay made
inside the sandbox's network namespace) and proxies the request over it:
HTTP with h11 (one connection per request; the answer's body streams as the
sandbox writes it, the request's as the caller sends it) and websockets with
the websockets library's sans-I/O protocol, message by message.

How a port is reached (``ExposedPort.Auth``):

* ``public``: nothing asked.
* ``key``: the team's API key in ``X-Forkyard-Key`` (counted against its rate
  limit like an API request); the header is not passed on.
* ``token``: ``?forkyard_token=...`` from the signed URL the API gave, or the
  cookie of that name which the first answer sets (the host's own, so a page's
  own requests and websockets carry it); neither is passed on.  A token names
  the exposed port (closing it, or exposing it again, ends its tokens) and
  expires.

Refusals are JSON in the API's error format: ``port_not_found`` (404: not
exposed, or its sandbox is not running), ``unauthorized`` (401),
``port_not_listening`` (502: exposed, but nothing in the sandbox listens on
it yet), ``port_bad_response`` (502: what came back was not HTTP).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qsl, urlencode

import h11
from django.conf import settings
from django.core import signing
from websockets.client import ClientProtocol
from websockets.frames import Close, Frame, Opcode
from websockets.protocol import State
from websockets.uri import parse_uri

from console.api_base import check_key, status_of
from console.authorize import authorize
from console.bodies import header, send_refusal
from console.db import db
from console.errors import Refused
from sandboxes import engine_link
from sandboxes.engine import errors as engine_errors

from .. import selectors
from ..models import ExposedPort

Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[Mapping[str, Any]], Awaitable[None]]
Scope = dict[str, Any]

TOKEN_NAME = "forkyard_token"
KEY_HEADER = b"x-forkyard-key"
MAX_TOKEN_TTL_S = 7 * 24 * 3600
READ_CHUNK = 256 * 1024
# Headers about one hop, never passed along (RFC 9110 7.6.1), and ours.
HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-connection",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"te",
    b"trailer",
    b"transfer-encoding",
    b"upgrade",
    KEY_HEADER,
}
_signer = signing.TimestampSigner(salt="forkyard.preview")


# --- names ----------------------------------------------------------------------------------------


def dns_label(sandbox_id: str) -> str:
    """A sandbox id as a host name may carry it (``sb_0a1b...`` -> ``sb-0a1b...``: no ``_`` in host names)."""
    return sandbox_id.replace("_", "-")


def _host_pattern() -> re.Pattern[str]:
    domain = re.escape(settings.FORKYARD_PREVIEW_DOMAIN)
    return re.compile(rf"^([0-9]{{1,5}})-([a-z]{{1,10}})-([0-9a-f]{{1,32}})\.{domain}(?::[0-9]{{1,5}})?$")


def target_of(scope: Scope) -> tuple[int, str] | None:
    """(port, sandbox id) a request's Host names, if it is a preview's."""
    if scope.get("type") not in ("http", "websocket"):
        return None
    match = _host_pattern().match(header(scope, b"host").lower())
    if match is None:
        return None
    port = int(match.group(1))
    return (port, f"{match.group(2)}_{match.group(3)}") if 1 <= port <= 65535 else None


def url_of(row: ExposedPort, request_host: str = "") -> str:
    """The preview URL; on the API's own port unless ``FORKYARD_PREVIEW_PORT`` names one."""
    port = settings.FORKYARD_PREVIEW_PORT or (request_host.rpartition(":")[2] if ":" in request_host else "")
    suffix = f":{port}" if port and str(port).isdigit() else ""
    host = f"{row.port}-{dns_label(row.sandbox_id)}.{settings.FORKYARD_PREVIEW_DOMAIN}{suffix}"
    return f"{settings.FORKYARD_PREVIEW_SCHEME}://{host}/"


def token_for(row: ExposedPort, ttl_s: int) -> tuple[str, float]:
    """A signed token for the port's URL, and when (epoch seconds) it expires."""
    return _signer.sign_object({"p": row.id, "a": row.auth, "t": ttl_s}), time.time() + ttl_s


def token_valid(token: str, row: ExposedPort) -> bool:
    try:
        claims = _signer.unsign_object(token)
        if not isinstance(claims, dict) or claims.get("p") != row.id or claims.get("a") != row.auth:
            return False
        _signer.unsign_object(token, max_age=int(claims.get("t", 0)))
    except (signing.BadSignature, ValueError, TypeError):
        return False  # SignatureExpired is a BadSignature
    return True


# --- serving ---------------------------------------------------------------------------------------


async def serve(scope: Scope, receive: Receive, send: Send, target: tuple[int, str]) -> None:
    port, sandbox_id = target
    websocket = scope["type"] == "websocket"
    row = await db(selectors.preview_target)(sandbox_id, port)
    if row is None:
        await _refuse(scope, receive, send, 404, Refused("port_not_found", f"port {port} of {sandbox_id} is not exposed"))
        return
    refusal, from_query = await _allowed(scope, row)
    if refusal is not None:
        await _refuse(scope, receive, send, 401 if refusal.code == "unauthorized" else status_of(refusal), refusal)
        return
    sandbox = row.sandbox
    assert sandbox.host is not None
    try:
        reader, writer = await engine_link.open_port(sandbox.host.engine_socket, sandbox.engine_id, port)
    except engine_errors.EngineError as error:
        refused = engine_link.refusal(error, sandbox)
        status = 502 if isinstance(error, engine_errors.PortNotListening) else status_of(refused)
        await _refuse(scope, receive, send, status, refused)
        return
    try:
        cookie = _token_cookie(from_query) if from_query else None
        if websocket:
            await _websocket(scope, receive, send, reader, writer)
        else:
            await _http(scope, receive, send, reader, writer, cookie)
    finally:
        writer.close()


async def _allowed(scope: Scope, row: ExposedPort) -> tuple[Refused | None, str]:
    """(the refusal, None if allowed; a token given in the query: the cookie to set)."""
    unauthorized = Refused("unauthorized", _how_to_reach(row))
    if row.auth == ExposedPort.Auth.PUBLIC:
        return None, ""
    if row.auth == ExposedPort.Auth.KEY:
        given = header(scope, KEY_HEADER).strip()
        if not given:
            return unauthorized, ""
        key, verdict = await check_key(given)
        if key is None or verdict is None or key.team_id != row.team_id:
            return unauthorized, ""
        if not verdict.allowed:
            return verdict.refusal(), ""
        # A scoped key reaches a port as the API's port tunnel would (console.permissions: run sandboxes).
        return await authorize(key, "GET", f"/api/v1/sandboxes/{row.sandbox_id}/ports/{row.port}/connect"), ""
    query_token = dict(parse_qsl(scope.get("query_string", b"").decode("latin1"))).get(TOKEN_NAME, "")
    if query_token and token_valid(query_token, row):
        return None, query_token
    cookie_token = _cookies(scope).get(TOKEN_NAME, "")
    return (None if cookie_token and token_valid(cookie_token, row) else unauthorized), ""


def _how_to_reach(row: ExposedPort) -> str:
    if row.auth == ExposedPort.Auth.KEY:
        return "this port needs the team's API key in the X-Forkyard-Key header"
    return "this port needs a valid, unexpired signed URL (ask the API for the port again for a new one)"


def _cookies(scope: Scope) -> dict[str, str]:
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(header(scope, b"cookie"))
    except Exception:  # noqa: BLE001 - a malformed cookie header is no token
        return {}
    return {name: morsel.value for name, morsel in jar.items()}


def _token_cookie(token: str) -> bytes:
    secure = "; Secure" if settings.FORKYARD_PREVIEW_SCHEME == "https" else ""
    return f"{TOKEN_NAME}={token}; Path=/; HttpOnly; SameSite=Lax{secure}".encode()


async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, refusal: Refused) -> None:
    if scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1008 if status in (401, 403, 429) else 1011, "reason": refusal.code})
        return
    await send_refusal(send, scope, status, refusal.body())


def _forwarded_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The caller's headers for the sandbox: minus hop-by-hop ones, our key, and our token in cookies and query."""
    kept: list[tuple[bytes, bytes]] = []
    for name, value in scope.get("headers", []):
        name = bytes(name).lower()
        if name in HOP_BY_HOP or name.startswith(b"sec-websocket-"):
            continue
        if name == b"cookie":
            parts = [part for part in bytes(value).split(b";") if part.strip().partition(b"=")[0] != TOKEN_NAME.encode()]
            if not parts:
                continue
            value = b";".join(parts).strip()
        kept.append((name, bytes(value)))
    client = scope.get("client")
    if client:
        kept.append((b"x-forwarded-for", str(client[0]).encode()))
    kept.append((b"x-forwarded-proto", settings.FORKYARD_PREVIEW_SCHEME.encode()))
    return kept


def _path_of(scope: Scope) -> str:
    path = scope.get("raw_path") or scope["path"].encode()
    query = [(name, value) for name, value in parse_qsl(scope.get("query_string", b"").decode("latin1"), keep_blank_values=True)]
    kept = [(name, value) for name, value in query if name != TOKEN_NAME]
    if len(kept) != len(query):
        return bytes(path).decode("latin1") + (f"?{urlencode(kept)}" if kept else "")
    raw_query = scope.get("query_string", b"").decode("latin1")
    return bytes(path).decode("latin1") + (f"?{raw_query}" if raw_query else "")


async def _http(
    scope: Scope,
    receive: Receive,
    send: Send,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    cookie: bytes | None,
) -> None:
    """One request over its own connection to the port; the answer streams back as it comes."""
    connection = h11.Connection(h11.CLIENT)
    headers = _forwarded_headers(scope)
    has_length = any(name == b"content-length" for name, _ in headers)
    chunked = not has_length and b"chunked" in header(scope, b"transfer-encoding").lower().encode()
    if chunked:
        headers.append((b"transfer-encoding", b"chunked"))
    headers.append((b"connection", b"close"))
    if not any(name == b"host" for name, _ in headers):
        headers.append((b"host", b"localhost"))
    try:
        request = h11.Request(method=scope["method"], target=_path_of(scope), headers=headers)
        writer.write(connection.send(request))
    except h11.LocalProtocolError as error:
        await send_refusal(send, scope, 400, Refused("invalid_request", f"cannot pass this request on: {error}").body())
        return
    gone = asyncio.Event()

    async def send_body() -> None:
        """The request's body as it arrives; then wait for the caller to leave (which ends the answer)."""
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    gone.set()
                    return
                body = message.get("body", b"")
                if body and (has_length or chunked):
                    writer.write(connection.send(h11.Data(data=body)))
                    await writer.drain()
                if not message.get("more_body"):
                    break
            if has_length or chunked:
                writer.write(connection.send(h11.EndOfMessage()))
                await writer.drain()
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
        except (ConnectionError, h11.LocalProtocolError):
            gone.set()

    sender = asyncio.ensure_future(send_body())
    started = False
    try:
        while not gone.is_set():
            event = connection.next_event()
            if event is h11.NEED_DATA:
                data = await _read_or_gone(reader, gone)
                if data is None:
                    return
                connection.receive_data(data)
            elif isinstance(event, h11.InformationalResponse):
                continue
            elif isinstance(event, h11.Response):
                response_headers = [(name, value) for name, value in event.headers if name.lower() not in HOP_BY_HOP]
                if cookie is not None:
                    response_headers.append((b"set-cookie", cookie))
                await send({"type": "http.response.start", "status": event.status_code, "headers": response_headers})
                started = True
            elif isinstance(event, h11.Data):
                await send({"type": "http.response.body", "body": bytes(event.data), "more_body": True})
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
    except (h11.RemoteProtocolError, ConnectionError) as error:
        if not started:
            refusal = Refused("port_bad_response", f"the service on the port did not answer with HTTP: {error}")
            await send_refusal(send, scope, 502, refusal.body())
            return
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await sender
    if started and not gone.is_set():
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    elif not started and not gone.is_set():
        refusal = Refused("port_bad_response", "the service on the port closed the connection without an answer")
        await send_refusal(send, scope, 502, refusal.body())


async def _read_or_gone(reader: asyncio.StreamReader, gone: asyncio.Event) -> bytes | None:
    """The sandbox's next bytes (b"" at its end), or None once the caller has left."""
    read = asyncio.ensure_future(reader.read(READ_CHUNK))
    waiting = asyncio.ensure_future(gone.wait())
    try:
        await asyncio.wait((read, waiting), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
    if not read.done():
        read.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await read
        return None
    return read.result()


async def _websocket(
    scope: Scope, receive: Receive, send: Send, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """The handshake with the sandbox's server first, then messages both ways until either side closes."""
    connect = await receive()
    if connect["type"] != "websocket.connect":
        return
    subprotocols = list(scope.get("subprotocols") or [])
    protocol = ClientProtocol(
        parse_uri(f"ws://{header(scope, b'host') or 'localhost'}{_path_of(scope)}"),
        subprotocols=subprotocols or None,
        max_size=None,
    )
    request = protocol.connect()
    for name, value in _forwarded_headers(scope):
        if name not in (b"host",) and name.decode("latin1") not in request.headers:
            request.headers[name.decode("latin1")] = value.decode("latin1")
    protocol.send_request(request)
    writer.writelines(protocol.data_to_send())
    await writer.drain()
    while protocol.state is State.CONNECTING and protocol.handshake_exc is None:
        data = await reader.read(READ_CHUNK)
        if data:
            protocol.receive_data(data)
        else:
            protocol.receive_eof()
            break
    if protocol.state is not State.OPEN:
        await send({"type": "websocket.close", "code": 1011, "reason": "port_bad_response"})
        return
    accepted = protocol.handshake_exc is None and getattr(protocol, "subprotocol", None)
    await send({"type": "websocket.accept", "subprotocol": accepted or None})
    pending = list(protocol.events_received())

    async def from_caller() -> None:
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                if protocol.state is State.OPEN:
                    protocol.send_close(_close_code(message.get("code", 1000)))
                    writer.writelines(protocol.data_to_send())
                    with contextlib.suppress(ConnectionError):
                        await writer.drain()
                return
            if message.get("bytes") is not None:
                protocol.send_binary(message["bytes"])
            else:
                protocol.send_text(str(message.get("text") or "").encode())
            writer.writelines(protocol.data_to_send())
            await writer.drain()

    async def from_sandbox() -> None:
        fragments: list[bytes] = []
        kind = Opcode.TEXT
        events = pending
        while True:
            for frame in events:
                if not isinstance(frame, Frame):
                    continue  # the handshake's response
                if frame.opcode is Opcode.CLOSE:
                    close = Close.parse(frame.data) if frame.data else None
                    await send({"type": "websocket.close", "code": close.code if close else 1000})
                    return
                if frame.opcode in (Opcode.TEXT, Opcode.BINARY):
                    kind, fragments = frame.opcode, [bytes(frame.data)]
                elif frame.opcode is Opcode.CONT:
                    fragments.append(bytes(frame.data))
                else:
                    continue  # ping, pong: the protocol answers pings itself
                if frame.fin:
                    data = b"".join(fragments)
                    if kind is Opcode.TEXT:
                        await send({"type": "websocket.send", "text": data.decode("utf-8", "replace")})
                    else:
                        await send({"type": "websocket.send", "bytes": data})
            writer.writelines(protocol.data_to_send())  # pongs
            data = await reader.read(READ_CHUNK)
            if not data:
                await send({"type": "websocket.close", "code": 1006 if protocol.state is State.OPEN else 1000})
                return
            protocol.receive_data(data)
            events = protocol.events_received()

    tasks = [asyncio.ensure_future(from_caller()), asyncio.ensure_future(from_sandbox())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def _close_code(code: Any) -> int:
    """A code the caller closed with that may go on the wire (1005 and 1006 may not)."""
    return code if isinstance(code, int) and (code == 1000 or 1001 <= code <= 1003 or 1007 <= code <= 4999) else 1000
