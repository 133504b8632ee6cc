"""The embedded channel layer works across processes: two layer objects share the database.

What is not delivered is shown by what is delivered instead: a marker sent after it
arrives first (each channel is first in, first out), so no test waits out a timer
to conclude that nothing came. The timeouts below only keep a broken layer from
hanging the suite.
"""

import asyncio

import pytest
from channels.db import database_sync_to_async
from django.db import connections

from console.channel_layer import DatabaseChannelLayer

pytestmark = pytest.mark.django_db(transaction=True)

GUARD_S = 30  # would otherwise hang; never a measure


def test_send_receive_and_groups_across_layers():
    async def scenario() -> None:
        sender, receiver = DatabaseChannelLayer(), DatabaseChannelLayer()
        channel = await receiver.new_channel()
        await sender.send(channel, {"type": "board.frame", "bytes": b"\x00\xffpixels", "n": 1})
        message = await asyncio.wait_for(receiver.receive(channel), GUARD_S)
        assert message == {"type": "board.frame", "bytes": b"\x00\xffpixels", "n": 1}
        second = await receiver.new_channel()
        for name in (channel, second):
            await receiver.group_add("team-a", name)
        await sender.group_send("team-a", {"type": "tick", "seq": 7})
        assert (await asyncio.wait_for(receiver.receive(channel), GUARD_S))["seq"] == 7
        assert (await asyncio.wait_for(receiver.receive(second), GUARD_S))["seq"] == 7
        await receiver.group_discard("team-a", second)
        await sender.group_send("team-a", {"type": "tick", "seq": 8})
        await sender.send(second, {"type": "marker", "seq": 9})  # sent after the group's 8
        assert (await asyncio.wait_for(receiver.receive(channel), GUARD_S))["seq"] == 8
        assert (await asyncio.wait_for(receiver.receive(second), GUARD_S))["seq"] == 9, (
            "a discarded channel got the group's message"
        )
        await database_sync_to_async(connections.close_all)()  # the worker thread's connection

    asyncio.run(scenario())


def test_expired_messages_are_not_delivered():
    async def scenario() -> None:
        # Within the process (the channel's own queue) and across processes (the database).
        layer, other = DatabaseChannelLayer(expiry=0), DatabaseChannelLayer(expiry=0)
        local, remote = await layer.new_channel(), await layer.new_channel()
        await layer.send(local, {"type": "stale"})
        await other.send(remote, {"type": "stale"})
        await asyncio.sleep(0.01)  # the clock moves past their expiry (a floor, not a bound)
        layer.expiry = other.expiry = 60
        await layer.send(local, {"type": "fresh"})
        await other.send(remote, {"type": "fresh"})
        assert await asyncio.wait_for(layer.receive(local), GUARD_S) == {"type": "fresh"}
        assert await asyncio.wait_for(layer.receive(remote), GUARD_S) == {"type": "fresh"}
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
        # Before anyone reads it: in the viewer's own queue, and not a row in the database.
        assert layer.local[viewer].qsize() == 1
        assert await database_sync_to_async(ChannelMessage.objects.count)() == 0
        assert await asyncio.wait_for(layer.receive(viewer), GUARD_S) == {"type": "board.frame", "bytes": b"\x01"}
        # For another process's channel, the same send is a row.
        elsewhere = await DatabaseChannelLayer().new_channel()
        await layer.send(elsewhere, {"type": "board.frame", "bytes": b"\x02"})
        assert await database_sync_to_async(ChannelMessage.objects.filter(channel=elsewhere).count)() == 1
        await database_sync_to_async(connections.close_all)()

    asyncio.run(scenario())
