"""A background process over a websocket: its output as it comes, its input and terminal size as they are typed.

``/api/v1/sandboxes/<sandbox id>/processes/<pid>/pty`` on the websocket
server (Daphne), authenticated as the API is: ``Authorization: Bearer <key>``
(a header a web page cannot set, so no origin check is needed; no cookie is
read). The sandbox is looked up within the key's team: another team's is not
found, exactly like one that does not exist.

Once open:

* server to client: binary frames are the process's stdout (a terminal's
  output) as the engine reads it, from ``stdout_offset`` (query; 0 replays
  what the engine still keeps); text frames are JSON: ``{"type": "stderr",
  "data_b64"}``, ``{"type": "missed", "stream", "bytes"}`` (output that fell
  off the engine's buffer before it was sent), ``{"type": "error", "code",
  "message"}`` and, last, ``{"type": "exit", ...}`` (the process's summary),
  then the socket closes (1000).
* client to server: binary frames are input (its terminal or stdin); text
  frames are JSON ``{"type": "resize", "rows", "cols"}``, ``{"type": "input",
  "data"}`` or ``{"type": "eof"}``.

Refusals close the socket after an ``error`` frame: 4400 (an offset that is
not a whole number), 4401 (no or a bad key; or the key revoked or expired
while the socket is open: it is checked again every ``RECENT_S`` seconds),
4429 (over the team's rate), 4403 (the key's scopes do not allow it: ``console.authorize``),
4404 (no such sandbox or process in the team),
4409 (not running), 1011 (the sandbox's host stopped answering). A bad
message closes nothing: it is answered with an ``error`` frame. Closing the socket ends the attachment, not the process
(``POST .../signal`` ends that).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qs

from channels.generic.websocket import AsyncWebsocketConsumer

from console.api_base import check_key, key_still_active
from console.authorize import authorize
from console.db import db
from console.errors import Refused, Unavailable
from console.keys import RECENT_S
from sandboxes.engine.errors import EngineError

from .. import engine_link, selectors
from ..models import Sandbox
from ..schemas import ProcessSummary
from .processes import summary

CLOSE_CODES = {401: 4401, 403: 4403, 404: 4404, 409: 4409, 429: 4429, 503: 1011}


def _bearer(headers: Iterable[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


def _offset(query: dict[str, list[str]], name: str) -> int | None:
    """The offset asked for (0 if none); None if it is not a whole number of ASCII digits ("²" is a
    digit to str.isdigit() but not to int())."""
    value = (query.get(name) or ["0"])[0]
    return int(value) if value.isascii() and value.isdigit() else None


class ProcessConsumer(AsyncWebsocketConsumer):
    sandbox: Sandbox | None = None
    address = ""
    pid = 0
    follower: asyncio.Task[None] | None = None
    guard: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        await self.accept()
        token = _bearer(self.scope.get("headers", []))
        key, verdict = await check_key(token) if token else (None, None)
        if key is None or verdict is None:
            await self._refuse(401, "unauthorized", "a valid API key is required: Authorization: Bearer <key>")
            return
        if not verdict.allowed:
            refusal = verdict.refusal()
            await self._refuse(429, refusal.code, refusal.message)
            return
        refused = await authorize(key, "GET", self.scope["path"])
        if refused is not None:
            await self._refuse(404 if refused.code.endswith("not_found") else 403, refused.code, refused.message)
            return
        query = parse_qs(self.scope.get("query_string", b"").decode("latin1"))
        offsets: dict[str, int] = {}
        for name in ("stdout_offset", "stderr_offset"):
            offset = _offset(query, name)
            if offset is None:
                await self._refuse(400, "invalid_request", f"{name} must be a whole number of bytes")
                return
            offsets[name] = offset
        route = self.scope["url_route"]["kwargs"]
        if await self.attach(key.team_id, route["sandbox_id"], int(route["pid"]), offsets):
            self.guard = asyncio.create_task(self._keep_checking(token))

    async def attach(self, team_id: str, sandbox_id: str, pid: int, offsets: dict[str, int]) -> bool:
        """Follow process ``pid`` of the team's sandbox from ``offsets``; False (and the socket closed) if there is none."""
        try:
            self.sandbox = await db(selectors.started_sandbox_for)(team_id, sandbox_id)
        except Refused as error:
            await self._refuse(404 if error.code.endswith("not_found") else 409, error.code, error.message)
            return False
        assert self.sandbox.host is not None  # a started sandbox has a host
        self.address, self.pid = self.sandbox.host.engine_socket, pid
        self.follower = asyncio.create_task(self._follow(offsets))
        return True

    async def _keep_checking(self, token: str) -> None:
        """The key, checked again every ``RECENT_S``: once revoked or expired, the socket closes (4401)
        and nothing more reaches the process, as the HTTP API refuses the key's next request."""
        while True:
            await asyncio.sleep(RECENT_S)
            if not await key_still_active(token):
                self.sandbox = None  # no more input or resizes
                if self.follower is not None:
                    self.follower.cancel()
                await self._refuse(401, "unauthorized", "the API key was revoked or has expired")
                return

    async def _follow(self, offsets: dict[str, int]) -> None:
        """The engine's ``processes.attach``: each output event on to the client, then the exit."""
        assert self.sandbox is not None
        args = {"id": self.sandbox.engine_id, "pid": self.pid, **offsets}
        try:
            async for kind, message in engine_link.stream_call(self.address, "processes.attach", args):
                if kind == "event":
                    if message.get("missed_bytes"):
                        missed = {"type": "missed", "stream": message["stream"], "bytes": message["missed_bytes"]}
                        await self.send(text_data=json.dumps(missed))
                    if message["stream"] == "stdout" and message["data_b64"]:
                        await self.send(bytes_data=base64.b64decode(message["data_b64"]))
                    elif message["data_b64"]:
                        await self.send(text_data=json.dumps({"type": "stderr", "data_b64": message["data_b64"]}))
                elif kind == "result":
                    ended = ProcessSummary.model_validate(summary(message)).model_dump(mode="json")
                    await self.send(text_data=json.dumps({"type": "exit", **ended}))
                    await self.close(1000)
        except EngineError as error:
            refusal = engine_link.refusal(error, self.sandbox)
            status = 404 if refusal.code.endswith("not_found") else 503 if isinstance(refusal, Unavailable) else 409
            await self._refuse(status, refusal.code, refusal.message)
        except (OSError, asyncio.IncompleteReadError):  # the engine went away mid-attach
            await self._refuse(503, "host_unavailable", "the sandbox's host stopped answering; connect again shortly")

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.sandbox is None:
            return
        try:
            if bytes_data is not None:
                await self._call("processes.input", data_b64=base64.b64encode(bytes_data).decode(), eof=False)
                return
            message = json.loads(text_data or "")
            kind = message.get("type") if isinstance(message, dict) else None
            if kind == "resize":
                await self._call("processes.resize", rows=message.get("rows"), cols=message.get("cols"))
            elif kind == "input" and isinstance(message.get("data"), str):
                await self._call("processes.input", data_b64=base64.b64encode(message["data"].encode()).decode(), eof=False)
            elif kind == "eof":
                await self._call("processes.input", data_b64="", eof=True)
            else:
                raise ValueError("a message is {type: resize, rows, cols}, {type: input, data} or {type: eof}")
        except ValueError as error:
            await self.send(text_data=json.dumps({"type": "error", "code": "invalid_request", "message": str(error)}))
        except EngineError as error:
            refusal = engine_link.refusal(error, self.sandbox)
            await self.send(text_data=json.dumps({"type": "error", "code": refusal.code, "message": refusal.message}))

    async def _call(self, op: str, **args: Any) -> Any:
        assert self.sandbox is not None
        async with engine_link.async_pool(self.address).client() as client:
            return await client.call(op, id=self.sandbox.engine_id, pid=self.pid, **args)

    async def _refuse(self, status: int, code: str, message: str) -> None:
        await self.send(text_data=json.dumps({"type": "error", "code": code, "message": message}))
        await self.close(CLOSE_CODES.get(status, 4400))

    async def disconnect(self, code: int) -> None:
        if self.guard is not None:
            self.guard.cancel()
        if self.follower is not None:
            self.follower.cancel()  # the engine's attach ends with its connection; the process runs on
