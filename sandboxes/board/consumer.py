"""The board's websocket: a snapshot on connect, then the team's frames as they come; each host's share of
the launch to a viewer that asks for it (``{"type": "hosts"}``: see ``ticker``)."""

from __future__ import annotations

import json
from typing import Any

from channels.generic.websocket import AsyncWebsocketConsumer

from console.db import db

from ..models import Launch
from . import ticker

NOT_SIGNED_IN, NOT_FOUND = 4401, 4404


def _launch_for(user: Any, launch_id: str) -> Launch | None:
    """The launch, if the user belongs to its team (same answer for 'absent' and 'not yours')."""
    if not getattr(user, "is_authenticated", False):
        return None
    return Launch.objects.filter(pk=launch_id, team__memberships__user=user).first()


class BoardConsumer(AsyncWebsocketConsumer):
    launch: Launch | None = None
    group: str | None = None
    hosts_wanted = False  # asked for each host's share of the launch

    async def connect(self) -> None:
        user = self.scope.get("user")
        if not getattr(user, "is_authenticated", False):
            await self.close(code=NOT_SIGNED_IN)
            return
        self.launch = await db(_launch_for)(user, self.scope["url_route"]["kwargs"]["launch_id"])
        if self.launch is None:
            await self.close(code=NOT_FOUND)
            return
        self.group = ticker.group_name(self.launch.team_id)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        ticker.ensure_ticker()
        await self.send_snapshot()

    async def send_snapshot(self) -> None:
        assert self.launch is not None
        layout, snapshot = await db(ticker.snapshot_frames)(self.launch)
        await self.send(bytes_data=layout)
        await self.send(bytes_data=snapshot)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        try:
            message = json.loads(text_data or "{}")
        except ValueError:
            return
        if isinstance(message, dict) and message.get("type") == "resync" and self.launch is not None:
            self.launch = await db(Launch.objects.get)(pk=self.launch.pk)  # its state may have moved on
            await self.send_snapshot()
        if isinstance(message, dict) and message.get("type") == "hosts" and self.launch is not None:
            self.hosts_wanted = True
            await self.send(text_data=await db(ticker.shares_message)(self.launch))

    async def board_hosts(self, event: dict[str, Any]) -> None:
        if self.hosts_wanted and self.launch is not None and json.loads(event["text"]).get("launch") == self.launch.pk:
            await self.send(text_data=event["text"])

    async def board_frame(self, event: dict[str, Any]) -> None:
        await self.send(bytes_data=event["bytes"])

    async def disconnect(self, code: int) -> None:
        if self.group:
            await self.channel_layer.group_discard(self.group, self.channel_name)
