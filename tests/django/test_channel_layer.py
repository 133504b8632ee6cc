"""The embedded channel layer works across processes: two layer objects share the database."""

import asyncio

import pytest
from channels.db import database_sync_to_async
from django.db import connections

from console.channel_layer import DatabaseChannelLayer

pytestmark = pytest.mark.django_db(transaction=True)


def test_send_receive_and_groups_across_layers():
    async def scenario() -> None:
        sender, receiver = DatabaseChannelLayer(), DatabaseChannelLayer()
        channel = await receiver.new_channel()
        await sender.send(channel, {"type": "board.frame", "bytes": b"\x00\xffpixels", "n": 1})
        message = await asyncio.wait_for(receiver.receive(channel), 2)
        assert message == {"type": "board.frame", "bytes": b"\x00\xffpixels", "n": 1}
        second = await receiver.new_channel()
        for name in (channel, second):
            await receiver.group_add("team-a", name)
        await sender.group_send("team-a", {"type": "tick", "seq": 7})
        assert (await receiver.receive(channel))["seq"] == 7
        assert (await receiver.receive(second))["seq"] == 7
        await receiver.group_discard("team-a", second)
        await sender.group_send("team-a", {"type": "tick", "seq": 8})
        assert (await receiver.receive(channel))["seq"] == 8
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(receiver.receive(second), 0.2)
        await database_sync_to_async(connections.close_all)()  # the worker thread's connection

    asyncio.run(scenario())


def test_expired_messages_are_not_delivered():
    async def scenario() -> None:
        layer = DatabaseChannelLayer(expiry=0)
        channel = await layer.new_channel()
        await layer.send(channel, {"type": "stale"})
        await asyncio.sleep(0.05)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(layer.receive(channel), 0.2)
        await database_sync_to_async(connections.close_all)()

    asyncio.run(scenario())


def test_a_message_for_this_process_skips_the_database():
    """The board's ticker and its viewers share the web server: their frames never wait on a database write."""
    from console.models import ChannelMessage

    async def scenario() -> None:
        layer = DatabaseChannelLayer()
        viewer = await layer.new_channel()
        await layer.group_add("team-b", viewer)
        await layer.group_send("team-b", {"type": "board.frame", "bytes": b"\x01"})
        assert await asyncio.wait_for(layer.receive(viewer), 0.01) == {"type": "board.frame", "bytes": b"\x01"}
        assert await database_sync_to_async(ChannelMessage.objects.count)() == 0
        stale = DatabaseChannelLayer(expiry=0)
        channel = await stale.new_channel()
        await stale.send(channel, {"type": "stale"})
        await asyncio.sleep(0.01)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(stale.receive(channel), 0.1)
        await database_sync_to_async(connections.close_all)()

    asyncio.run(scenario())
