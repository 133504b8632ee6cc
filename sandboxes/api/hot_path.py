"""The hot path: a well-formed command or small file answered without Django's request machinery.

A trainer's loop is mostly ``POST /api/v1/sandboxes/{id}/exec`` and small
files (``GET``/``PUT .../files``). Through Django each cost the web server
about 3-4 ms of CPU: the request and response objects, the middleware,
django-ninja's routing and parsing, a thread for the request's sync code, and
a query to find the sandbox. Here, once ``console.asgi`` has checked the key
and the rate limit from the headers and read the (bounded) body:

1. the request is taken only in its plain forms (``route``): an exec's body
   validated with the view's own schema (``ExecIn``); a file's query as
   Django reads it, with only the parameters the view takes, in their
   plainest spelling; a write only up to ``WRITE_BYTES``;
2. the sandbox's engine is found in a short-lived cache of where this team's
   sandboxes run (``LOCATION_TTL_S``), else with the view's own query;
3. the call runs on a pooled engine connection (an exec cancelled if the
   caller leaves, as Django's handler cancels a view), and the view's own
   answer is sent: ``exec_answer``, ``FileWritten``, a file's bytes as they
   come.

Anything else is not answered here, and nothing has been sent: a body that
does not validate, a sandbox that is not found or not started, a database
that is down, a cached place the engine no longer knows. The request then
goes on to Django with its body, and the view answers it, so that every
refusal is the view's own and the two paths cannot disagree. An engine's
refusal of the command itself (a paused sandbox, a bad ``cwd``) is mapped
here exactly as the view maps it.

The cache costs nothing in safety: an entry only says which engine holds a
sandbox that was running or paused a moment ago, the engine checks it holds
it, and a command sent to a sandbox destroyed since answers ``not found``,
which sends the request to the view.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from django.conf import settings
from django.http import QueryDict
from pydantic import ValidationError

from console.api_base import status_of
from console.bodies import request_id_of
from console.db import db
from console.ratelimit import Verdict
from sandboxes.engine import errors as engine_errors

from .. import engine_link, selectors
from ..engine.data_path import CallerGone, ExecIn, FileWritten, Receive, exec_answer, exec_args, until_disconnect

Send = Callable[[Mapping[str, Any]], Awaitable[None]]

EXEC = re.compile(r"^/api/v1/sandboxes/(?P<sandbox>[^/]+)/exec/?$")
FILES = re.compile(r"^/api/v1/sandboxes/(?P<sandbox>[^/]+)/files/?$")
WRITE_BYTES = 1 << 20  # larger writes stream through the view, never held here
LOCATION_TTL_S = 2.0
_MAX_LOCATIONS = 100_000

# (team id, sandbox id) -> (until, the engine's id for it, its engine's address)
_locations: dict[tuple[str, str], tuple[float, str, str]] = {}


@dataclass(frozen=True)
class Call:
    """A request the hot path may answer: what it is, on which sandbox, with which engine arguments."""

    kind: Literal["exec", "read", "write"]
    sandbox: str
    args: dict[str, Any]


def _single(query: QueryDict, name: str) -> str | None:
    values = query.getlist(name)
    return values[0] if len(values) == 1 else None


def _file_args(scope: Mapping[str, Any], writes: bool) -> dict[str, Any] | None:
    """The engine's arguments for a file request in its plain form; None for any other (the view parses it)."""
    query = QueryDict(scope.get("query_string", b""))
    path = _single(query, "path")
    if path is None or set(query) - ({"path", "mode", "make_parents"} if writes else {"path"}):
        return None
    if not writes:
        return {"path": path}
    mode, parents = query.get("mode", "420"), query.get("make_parents", "true")
    if len(query.getlist("mode")) > 1 or len(query.getlist("make_parents")) > 1:
        return None
    if not (mode.isdigit() and len(mode) <= 4 and int(mode) <= 0o7777) or parents not in ("true", "false"):
        return None
    return {"path": path, "mode": int(mode), "make_parents": parents == "true"}


def route(scope: Mapping[str, Any], length: int | None) -> Call | None:
    """The hot path's call for a request, or None: the view's."""
    if not settings.FORKYARD_HOT_PATH:
        return None
    method, path = scope["method"], scope["path"]
    if method == "POST" and not scope.get("query_string") and (match := EXEC.match(path)):
        return Call("exec", match["sandbox"], {})
    if method not in ("GET", "PUT") or not (match := FILES.match(path)):
        return None
    if method == "PUT" and (length is None or length > WRITE_BYTES):
        return None
    args = _file_args(scope, writes=method == "PUT")
    return None if args is None else Call("read" if method == "GET" else "write", match["sandbox"], args)


def forget(team_id: str, sandbox_id: str) -> None:
    _locations.pop((team_id, sandbox_id), None)


async def _location(team_id: str, sandbox_id: str) -> tuple[str, str] | None:
    now = time.monotonic()
    cached = _locations.get((team_id, sandbox_id))
    if cached is not None and cached[0] > now:
        return cached[1], cached[2]
    try:
        sandbox = await db(selectors.started_sandbox_for)(team_id, sandbox_id)
    except Exception:  # noqa: BLE001  # not found, not started, a database down: the view says which
        forget(team_id, sandbox_id)
        return None
    assert sandbox.host is not None  # a started sandbox has a host
    if len(_locations) >= _MAX_LOCATIONS:
        _locations.clear()
    _locations[(team_id, sandbox_id)] = (now + LOCATION_TTL_S, sandbox.engine_id, sandbox.host.engine_socket)
    return sandbox.engine_id, sandbox.host.engine_socket


class _Named(NamedTuple):
    """What ``engine_link.refusal`` needs of a sandbox to name it as its caller knows it."""

    engine_id: str
    id: str


class CutOff(RuntimeError):
    """A file's bytes stopped coming after its answer began: the connection is dropped, not the answer finished."""


async def _engine_call(address: str, op: str, args: dict[str, Any], body: bytes | None = None) -> Any:
    async with engine_link.async_pool(address).client() as client:
        return await client.call(op, body, **args)


def _headers(scope: Mapping[str, Any], verdict: Verdict, content_type: bytes) -> list[tuple[bytes, bytes]]:
    """The API's headers (``console.middleware.decorate``), and the rate limit's."""
    return [
        (b"content-type", content_type),
        (b"x-forkyard-region", settings.FORKYARD_REGION.encode()),
        (b"x-request-id", request_id_of(scope).encode()),
        (b"x-content-type-options", b"nosniff"),
        *((name.lower().encode(), value.encode()) for name, value in verdict.headers().items()),
    ]


async def _send(send: Send, scope: Mapping[str, Any], status: int, body: dict[str, Any], verdict: Verdict) -> None:
    content = json.dumps(body).encode()
    headers = [*_headers(scope, verdict, b"application/json; charset=utf-8"), (b"content-length", str(len(content)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": content})


async def _stream_file(send: Send, scope: Mapping[str, Any], verdict: Verdict, address: str, args: dict[str, Any]) -> None:
    """A file's bytes as the engine sends them; a refusal before the first byte is raised (``EngineError``).

    A failure after it ends the response unfinished (the exception reaches the
    server, which drops the connection): a client must never take a cut-off
    file for a whole one."""
    stream = engine_link.stream_call(address, "files.read", args)
    try:
        await stream.__anext__()  # the header: not found, not a file, ... are raised here
        await send(
            {"type": "http.response.start", "status": 200, "headers": _headers(scope, verdict, b"application/octet-stream")}
        )
        try:
            async for kind, data in stream:
                if kind == "data":
                    await send({"type": "http.response.body", "body": data, "more_body": True})
        except engine_errors.EngineError as error:
            raise CutOff(f"{args['path']!r} of sandbox {args['id']}: {error.message}") from error
        await send({"type": "http.response.body", "body": b""})
    finally:
        await stream.aclose()


async def answer(call: Call, scope: Mapping[str, Any], body: bytes, receive: Receive, send: Send) -> bool:
    """Answer ``call`` as its view would; False, with nothing sent, to leave the request to the view."""
    key, verdict = scope["forkyard.auth"]
    payload: ExecIn | None = None
    if call.kind == "exec":
        try:
            payload = ExecIn.model_validate_json(body)
        except ValidationError:
            return False
    location = await _location(key.team_id, call.sandbox)
    if location is None:
        return False
    engine_id, address = location
    args = {"id": engine_id, **call.args}
    try:
        if payload is not None:
            result = await until_disconnect(receive, _engine_call(address, "exec", {**args, **exec_args(payload)}))
            await _send(send, scope, 200, exec_answer(result, payload), verdict)
        elif call.kind == "write":
            result = await _engine_call(address, "files.write", args, body)
            await _send(send, scope, 200, FileWritten.model_validate(result).model_dump(), verdict)
        else:
            await _stream_file(send, scope, verdict, address, args)
    except CallerGone:
        pass  # nobody to answer; the command ended with its caller, as through the view
    except engine_errors.EngineError as error:
        if isinstance(error, (engine_errors.SandboxNotFound, engine_errors.SandboxNotRunning)):
            # Not running (paused, or gone since its place was remembered): the view says what became of it.
            forget(key.team_id, call.sandbox)
            return False
        refusal = engine_link.refusal(error, _Named(engine_id, call.sandbox))
        await _send(send, scope, status_of(refusal), refusal.body(), verdict)
    return True
