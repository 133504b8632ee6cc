"""The gateway's fast path: ``/api/v1/inference/*`` answered at the ASGI level, async end to end.

A judge's call costs the gateway what it adds over a direct call to the same
model server, so it skips Django's request machinery as the sandboxes' hot
path does (``sandboxes/api/hot_path.py``): ``console.asgi`` has checked the
key and the team's rate from the headers, what the key may do
(``console.authorize``, from ``console.permissions.ROUTES``: these routes need
the inference scope, as for any other transport), the query against the
OpenAPI document and the body's size, and read the body; here the reply is made
(``replies``: parsed, routed, limited, passed through on httpx, checked) and
sent, the stream's events as they come, and the call recorded once it was
answered. A caller that leaves ends its call (the upstream request is
cancelled). With ``FORKYARD_HOT_PATH=0`` the django-ninja views
(``inference.py``) answer instead, with the same replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from django.conf import settings

from console.bodies import header, request_id_of
from console.ratelimit import Verdict

from ..gateway import RETENTION_HEADER, Caller
from . import replies

Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[Mapping[str, Any]], Awaitable[None]]

PATHS = {"POST": re.compile(r"^/api/v1/inference/chat/completions/?$"), "GET": re.compile(r"^/api/v1/inference/models/?$")}
OFF = {"off", "none", "false", "0", "no"}


def route(scope: Mapping[str, Any]) -> bool:
    """Whether the fast path answers this request."""
    pattern = PATHS.get(scope["method"])
    return bool(settings.FORKYARD_HOT_PATH and pattern is not None and pattern.match(scope["path"]))


def caller_of(team_id: str, key_id: str, retention: str) -> Caller:
    return Caller(team_id=team_id, key_id=key_id, opted_out=retention.strip().lower() in OFF)


def _headers(scope: Mapping[str, Any], verdict: Verdict, content_type: bytes, extra: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """The API's headers (region, request id, the rate limit's), as every answer of the API carries them."""
    return [
        (b"content-type", content_type),
        (b"x-forkyard-region", settings.FORKYARD_REGION.encode()),
        (b"x-request-id", request_id_of(scope).encode()),
        (b"x-content-type-options", b"nosniff"),
        *((name.lower().encode(), value.encode()) for name, value in {**verdict.headers(), **extra}.items()),
    ]


async def _send_reply(scope: Mapping[str, Any], send: Send, verdict: Verdict, reply: replies.Reply) -> None:
    if reply.events is None:
        content = json.dumps(reply.body).encode()
        headers = _headers(scope, verdict, b"application/json", reply.headers)
        await send({"type": "http.response.start", "status": reply.status, "headers": [*headers, (b"content-length", str(len(content)).encode())]})
        await send({"type": "http.response.body", "body": content})
        return
    await send({"type": "http.response.start", "status": reply.status, "headers": _headers(scope, verdict, b"text/event-stream", reply.headers)})
    async for event in reply.events:
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def _until_gone(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def answer(scope: Mapping[str, Any], body: bytes, receive: Receive, send: Send) -> None:
    """Answer an inference request (the key was checked: ``scope["forkyard.auth"]``), then record it."""
    key, verdict = scope["forkyard.auth"]
    caller = caller_of(key.team_id, key.id, header(scope, RETENTION_HEADER.encode()))
    reply: replies.Reply | None = None

    async def work() -> None:
        nonlocal reply
        try:
            reply = await (replies.models(caller) if scope["method"] == "GET" else replies.chat(caller, body))
        except Exception as error:  # noqa: BLE001 - answered as a clear 5xx, never a traceback
            reply = replies.failure(error)
        await _send_reply(scope, send, verdict, reply)

    task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(_until_gone(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()  # the caller left: its upstream call ends with it
    with contextlib.suppress(asyncio.CancelledError):
        await task
    if reply is not None:
        await replies.record(reply)
