"""A sandbox's TCP port over a websocket: what ``forkyard ports forward`` rides on.

``/api/v1/sandboxes/<sandbox id>/ports/<port>/connect``, authenticated as the
API is (``Authorization: Bearer <key>``; no cookie, no origin check, as
``api/pty.py``), within the key's team (another team's sandbox is not found).
The port need not be exposed: this is the team's own key at work.

Once open, binary frames are the bytes of one TCP connection to 127.0.0.1:port
in the sandbox (the engine's ``ports.connect`` relay), both ways; a text frame
``{"type": "eof"}`` from the client half-closes its side.  The sandbox closing
its side closes the socket (1000).  Refusals close after an ``error`` text
frame: 4401, 4429, 4404, 4409 as the terminal's, 4502 when nothing listens
on the port (``port_not_listening``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from channels.generic.websocket import AsyncWebsocketConsumer

from console.api_base import check_key
from console.authorize import authorize
from console.db import db
from console.errors import Refused
from sandboxes.engine import errors as engine_errors

from .. import engine_link, selectors
from ..models import Sandbox
from .pty import CLOSE_CODES, _bearer

READ_CHUNK = 256 * 1024


class PortTunnelConsumer(AsyncWebsocketConsumer):
    writer: asyncio.StreamWriter | None = None
    pump: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        await self.accept()
        token = _bearer(self.scope.get("headers", []))
        key, verdict = await check_key(token) if token else (None, None)
        if key is None or verdict is None:
            await self._refuse(4401, "unauthorized", "a valid API key is required: Authorization: Bearer <key>")
            return
        if not verdict.allowed:
            over = verdict.refusal()
            await self._refuse(4429, over.code, over.message)
            return
        refused = await authorize(key, "GET", self.scope["path"])
        if refused is not None:
            await self._refuse(4404 if refused.code.endswith("not_found") else 4403, refused.code, refused.message)
            return
        route = self.scope["url_route"]["kwargs"]
        sandbox = await self.started_sandbox(key.team_id, route["sandbox_id"])
        if sandbox is not None:
            await self.relay(sandbox, int(route["port"]))

    async def started_sandbox(self, team_id: str, sandbox_id: str) -> Sandbox | None:
        """The team's sandbox, running or paused; None once refused (4404 not found, 4409 not started)."""
        try:
            sandbox: Sandbox = await db(selectors.started_sandbox_for)(team_id, sandbox_id)
        except Refused as error:
            await self._refuse(4404 if error.code.endswith("not_found") else 4409, error.code, error.message)
            return None
        return sandbox

    async def relay(self, sandbox: Sandbox, port: int) -> None:
        """Carry one TCP connection to ``port`` in the started ``sandbox`` both ways; refuse if none opens."""
        assert sandbox.host is not None  # a started sandbox has a host
        try:
            reader, self.writer = await engine_link.open_port(sandbox.host.engine_socket, sandbox.engine_id, port)
        except engine_errors.EngineError as error:
            refusal = engine_link.refusal(error, sandbox)
            if isinstance(error, engine_errors.PortNotListening):
                close = 4502
            elif refusal.code.endswith("not_found"):
                close = 4404
            elif isinstance(error, engine_errors.InvalidRequest):
                close = 4400
            else:
                close = CLOSE_CODES.get(409 if isinstance(error, engine_errors.Conflict) else 503, 1011)
            await self._refuse(close, refusal.code, refusal.message)
            return
        self.pump = asyncio.create_task(self._from_sandbox(reader))

    async def _from_sandbox(self, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while chunk := await reader.read(READ_CHUNK):
                await self.send(bytes_data=chunk)
        await self.close(1000)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.writer is None:
            return
        try:
            if bytes_data is not None:
                self.writer.write(bytes_data)
                await self.writer.drain()
            elif json.loads(text_data or "null") == {"type": "eof"} and self.writer.can_write_eof():
                self.writer.write_eof()
        except (ConnectionError, OSError, ValueError):
            await self.close(1000)

    async def _refuse(self, close: int, code: str, message: str) -> None:
        await self.send(text_data=json.dumps({"type": "error", "code": code, "message": message}))
        await self.close(close)

    async def disconnect(self, code: int) -> None:
        if self.pump is not None:
            self.pump.cancel()
        if self.writer is not None:
            self.writer.close()
