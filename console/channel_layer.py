"""A channel layer on the database, for the embedded default.

The in-memory layer only works inside one process; this one works across the
web server and the Celery workers with nothing but the database they already
share.  Receivers poll (every 25 ms by default), which is fine for the board's
ten frames a second; production uses Redis (channels_redis) instead.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import time
from typing import Any

from channels.db import database_sync_to_async
from channels.layers import BaseChannelLayer

POLL_S = 0.025


def _encode(message: dict[str, Any]) -> str:
    def default(value: Any) -> Any:
        if isinstance(value, (bytes, bytearray)):
            return {"__bytes__": base64.b64encode(bytes(value)).decode()}
        raise TypeError(f"cannot send {type(value).__name__} on the channel layer")

    return json.dumps(message, default=default)


def _decode(body: str) -> dict[str, Any]:
    def hook(value: dict[str, Any]) -> Any:
        if set(value) == {"__bytes__"}:
            return base64.b64decode(value["__bytes__"])
        return value

    return dict(json.loads(body, object_hook=hook))


class DatabaseChannelLayer(BaseChannelLayer):
    extensions = ["groups", "flush"]

    def __init__(self, expiry: int = 60, group_expiry: int = 86400, capacity: int = 1000, **kwargs: Any) -> None:
        super().__init__(expiry=expiry, capacity=capacity, **kwargs)
        self.group_expiry = group_expiry

    async def new_channel(self, prefix: str = "specific") -> str:
        return f"{prefix}.db!{secrets.token_hex(8)}"

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        assert self.valid_channel_name(channel)
        await self._insert([channel], _encode(message))

    @database_sync_to_async
    def _insert(self, channels: list[str], body: str) -> None:
        from console.models import ChannelMessage

        expires = time.time() + self.expiry
        ChannelMessage.objects.bulk_create(
            [ChannelMessage(channel=channel, body=body, expires_at=expires) for channel in channels]
        )

    async def receive(self, channel: str) -> dict[str, Any]:
        assert self.valid_channel_name(channel)
        while True:
            message = await self._pop(channel)
            if message is not None:
                return message
            await asyncio.sleep(POLL_S)

    @database_sync_to_async
    def _pop(self, channel: str) -> dict[str, Any] | None:
        from console.models import ChannelMessage

        now = time.time()
        while True:
            row = ChannelMessage.objects.filter(channel=channel).order_by("id").values_list("id", "body", "expires_at").first()
            if row is None:
                return None
            # Whoever deletes the row owns the message: two readers never both get it.
            if ChannelMessage.objects.filter(id=row[0]).delete()[0] and row[2] >= now:
                return _decode(row[1])

    @database_sync_to_async
    def group_add(self, group: str, channel: str) -> None:
        from console.models import ChannelGroupMember

        ChannelGroupMember.objects.update_or_create(
            group=group, channel=channel, defaults={"expires_at": time.time() + self.group_expiry}
        )

    @database_sync_to_async
    def group_discard(self, group: str, channel: str) -> None:
        from console.models import ChannelGroupMember

        ChannelGroupMember.objects.filter(group=group, channel=channel).delete()

    async def group_send(self, group: str, message: dict[str, Any]) -> None:
        channels = await self._members(group)
        if channels:
            await self._insert(channels, _encode(message))

    @database_sync_to_async
    def _members(self, group: str) -> list[str]:
        from console.models import ChannelGroupMember, ChannelMessage

        now = time.time()
        ChannelMessage.objects.filter(expires_at__lt=now).delete()
        ChannelGroupMember.objects.filter(expires_at__lt=now).delete()
        return list(ChannelGroupMember.objects.filter(group=group).values_list("channel", flat=True))

    @database_sync_to_async
    def flush(self) -> None:
        from console.models import ChannelGroupMember, ChannelMessage

        ChannelMessage.objects.all().delete()
        ChannelGroupMember.objects.all().delete()
