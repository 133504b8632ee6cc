"""A channel layer on the database, for the embedded default.

The in-memory layer only works inside one process; this one works across the
web server and the Celery workers with nothing but the database they already
share; production uses Redis (channels_redis) instead.

A channel's name says which process made it.  A message for a channel of
this process (the board's ticker and its viewers share the web server) goes
straight into that channel's queue, touching no database; only a message
for another process's channel is written to the database, where its
receiver finds it by polling (every 25 ms).  Writing every frame to SQLite
made frames wait behind the workers' writes: up to a second, during a launch.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import time
from typing import Any

from channels.db import database_sync_to_async
from channels.exceptions import ChannelFull
from channels.layers import BaseChannelLayer

POLL_S = 0.025
SWEEP_S = 30.0


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
        self.process = secrets.token_hex(4)  # in every channel name this process makes
        self.local: dict[str, asyncio.Queue[tuple[float, dict[str, Any]]]] = {}
        self.local_groups: dict[str, set[str]] = {}
        self.swept = 0.0

    def _is_local(self, channel: str) -> bool:
        return channel in self.local

    async def new_channel(self, prefix: str = "specific") -> str:
        channel = f"{prefix}.db!{self.process}{secrets.token_hex(6)}"
        self.local[channel] = asyncio.Queue(self.capacity)
        return channel

    def _deliver(self, channel: str, message: dict[str, Any]) -> None:
        try:
            self.local[channel].put_nowait((time.time() + self.expiry, message))
        except asyncio.QueueFull:
            raise ChannelFull(channel) from None

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        assert self.valid_channel_name(channel)
        if self._is_local(channel):
            self._deliver(channel, message)
        else:
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
        queue = self.local.get(channel)
        while True:
            if queue is not None:
                try:
                    expires, message = await asyncio.wait_for(queue.get(), POLL_S)
                except TimeoutError:
                    pass
                else:
                    if expires >= time.time():
                        return message
                    continue
            # From another process, through the database.
            stored = await self._pop(channel)
            if stored is not None:
                return stored
            if queue is None:
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

    async def group_add(self, group: str, channel: str) -> None:
        if self._is_local(channel):
            self.local_groups.setdefault(group, set()).add(channel)
        await self._add_member(group, channel)

    @database_sync_to_async
    def _add_member(self, group: str, channel: str) -> None:
        from console.models import ChannelGroupMember

        ChannelGroupMember.objects.update_or_create(
            group=group, channel=channel, defaults={"expires_at": time.time() + self.group_expiry}
        )

    async def group_discard(self, group: str, channel: str) -> None:
        self.local_groups.get(group, set()).discard(channel)
        if self._is_local(channel) and not any(channel in members for members in self.local_groups.values()):
            self.local.pop(channel, None)  # a consumer discards its groups as it disconnects
        await self._discard_member(group, channel)

    @database_sync_to_async
    def _discard_member(self, group: str, channel: str) -> None:
        from console.models import ChannelGroupMember

        ChannelGroupMember.objects.filter(group=group, channel=channel).delete()

    async def group_send(self, group: str, message: dict[str, Any]) -> None:
        local = self.local_groups.get(group, set())
        for channel in list(local):
            try:
                self._deliver(channel, message)
            except (ChannelFull, KeyError):
                pass  # a slow or gone viewer: it resyncs on its own
        remote = [channel for channel in await self._members(group) if channel not in self.local]
        if remote:
            await self._insert(remote, _encode(message))

    @database_sync_to_async
    def _members(self, group: str) -> list[str]:
        from console.models import ChannelGroupMember, ChannelMessage

        now = time.time()
        if now - self.swept > SWEEP_S:  # expired rows go now and then, not on every send
            self.swept = now
            ChannelMessage.objects.filter(expires_at__lt=now).delete()
            ChannelGroupMember.objects.filter(expires_at__lt=now).delete()
        return list(ChannelGroupMember.objects.filter(group=group).values_list("channel", flat=True))

    @database_sync_to_async
    def _flush(self) -> None:
        from console.models import ChannelGroupMember, ChannelMessage

        ChannelMessage.objects.all().delete()
        ChannelGroupMember.objects.all().delete()

    async def flush(self) -> None:
        self.local.clear()
        self.local_groups.clear()
        await self._flush()
