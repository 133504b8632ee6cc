"""Request bodies: refused before they are read, bounded by endpoint, and streamed where they are files.

Django's ASGI handler reads a whole body (into memory, then a temporary file)
before any view runs, so a 1 GiB PUT without a key cost the web server 1 GiB
of memory and 2 GiB of disk before its 401.  Here, for the API:

1. the key is checked, and the request counted against the team's rate
   limit, from the headers alone: no key, a wrong one, or one over its limit
   is answered (401, 429) without reading a byte of the body;
2. a declared ``Content-Length`` over the endpoint's limit is answered 413
   at once; a body without one is counted as it arrives and refused at the
   limit;
3. uploads (a file, a tar, an image) are not read here at all: the view streams them
   from the connection to the sandbox's engine, chunk by chunk
   (``StreamedBody``), so no whole upload is ever held by the web server.

The console gets 2 and a fixed limit too (its forms are small).
"""

from __future__ import annotations

import io
import json
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestAborted

from .errors import TooLarge

Receive = Callable[[], Awaitable[Mapping[str, Any]]]
MIB = 1024 * 1024


@dataclass(frozen=True)
class BodyRule:
    """How an endpoint's body may be: at most ``limit`` bytes; ``streamed``: handed to the view as it arrives."""

    limit: int
    streamed: bool = False


def rule_for(method: str, path: str) -> BodyRule:
    """The body rule of an API endpoint, by method and path."""
    if method == "PUT" and UPLOADS.match(path):
        return BodyRule(settings.FORKYARD_MAX_UPLOAD_BYTES, streamed=True)
    if method == "POST" and IMAGES.match(path):
        return BodyRule(settings.FORKYARD_MAX_IMAGE_BYTES, streamed=True)
    if method == "POST" and EXECS.match(path):
        return BodyRule(16 * MIB)  # a command's standard input travels in its body
    if method == "POST" and MODEL_INPUTS.match(path):
        return BodyRule(16 * MIB)  # a rollout's text for a judge: a chat completion's messages, a batch of grades
    if method == "POST" and INPUTS.match(path):
        return BodyRule(2 * MIB)  # a process's input: 1 MiB, as base64
    return BodyRule(1 * MIB)


UPLOADS = re.compile(r"^/api/v1/sandboxes/[^/]+/(files|archive)/?$")
IMAGES = re.compile(r"^/api/v1/snapshots/import/?$")  # an image archive, streamed to a host's engine
EXECS = re.compile(r"^/api/v1/(sandboxes/[^/]+/exec(/stream)?|exec)/?$")  # one sandbox's, or a batch's
INPUTS = re.compile(r"^/api/v1/sandboxes/[^/]+/processes/[^/]+/input/?$")
MODEL_INPUTS = re.compile(r"^/api/v1/(inference/chat/completions|grades)/?$")
CONSOLE_RULE = BodyRule(2 * MIB)


def too_large(limit: int) -> TooLarge:
    return TooLarge("too_large", f"the request body is over this endpoint's limit of {limit} bytes", details={"limit": limit})


def declared_length(scope: Mapping[str, Any]) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def read_bounded(receive: Receive, limit: int) -> io.BytesIO:
    """The whole body, refused (``TooLarge``) as soon as it passes ``limit``; ``RequestAborted`` if the client left."""
    body = io.BytesIO()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise RequestAborted()
        body.write(message.get("body", b""))
        if body.tell() > limit:
            raise too_large(limit)
        if not message.get("more_body", False):
            break
    body.seek(0)
    return body


class StreamedBody:
    """A body the view reads as it arrives (``chunks``), for an upload that goes straight on to an engine."""

    def __init__(self, receive: Receive, limit: int) -> None:
        self.receive, self.limit, self.received, self.done = receive, limit, 0, False

    async def chunks(self) -> AsyncIterator[bytes]:
        while not self.done:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise RequestAborted()
            chunk = message.get("body", b"")
            self.received += len(chunk)
            if self.received > self.limit:
                raise too_large(self.limit)
            self.done = not message.get("more_body", False)
            if chunk:
                yield chunk

    # What Django calls on a request's body file; an upload's is read with chunks() only.
    def read(self, *_: Any) -> bytes:
        raise RuntimeError("a streamed body is read with chunks(), as it arrives")

    def readline(self, *_: Any) -> bytes:
        raise RuntimeError("a streamed body is read with chunks(), as it arrives")

    def close(self) -> None:
        pass


def header(scope: Mapping[str, Any], name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key == name:
            return bytes(value).decode("latin1")
    return ""


def request_id_of(scope: Mapping[str, Any]) -> str:
    given = header(scope, b"x-request-id")
    return given if 0 < len(given) <= 64 and given.replace("-", "").replace("_", "").isalnum() else uuid.uuid4().hex


async def send_refusal(
    send: Callable[[Mapping[str, Any]], Awaitable[None]],
    scope: Mapping[str, Any],
    status: int,
    body: dict[str, Any],
    headers: Mapping[str, str] | None = None,
) -> None:
    """Answer without Django (the body was never read): the API's error format and headers, and close."""
    content = json.dumps(body).encode()
    response_headers = {
        "content-type": "application/json",
        "content-length": str(len(content)),
        "x-forkyard-region": settings.FORKYARD_REGION,
        "x-request-id": request_id_of(scope),
        "x-content-type-options": "nosniff",
        "connection": "close",
        **{name.lower(): value for name, value in (headers or {}).items()},
    }
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(name.encode("latin1"), value.encode("latin1")) for name, value in response_headers.items()],
        }
    )
    await send({"type": "http.response.body", "body": content})
