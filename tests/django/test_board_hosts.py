"""The board's per-host share of a launch: what the ticker sends when it changes, and to whom (the viewers that
asked, ``{"type": "hosts"}``); the binary frames are tests/django/test_board.py's."""

from __future__ import annotations

import asyncio
import json

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import User
from django.db import connections
from django.utils import timezone

from console.keys import api_key_create
from console.routing import websocket_urlpatterns
from console.services import team_create
from sandboxes.board import ticker as board
from sandboxes.models import Host, Launch, Sandbox

pytestmark = pytest.mark.django_db(transaction=True)
APP = URLRouter(websocket_urlpatterns)
S = Sandbox.State


@pytest.fixture
def spread() -> tuple[Launch, User]:
    """A launch of 6: 4 members on host a (one running), 2 on host b."""
    user = User.objects.create_user("viewer", password="a-long-password")
    team = team_create(name="Board team", owner=user)
    key = api_key_create(team=team, name="k").key
    a, b = (Host.objects.create(name=name, queue=f"host.{name}", engine_socket="", region="r") for name in ("a", "b"))
    launch = Launch.objects.create(team=team, api_key=key, template="base", size="tiny", cpu=1, memory_mib=128, ttl_s=60, count=6)
    shape = {"team": team, "api_key": key, "launch": launch, "template": "base", "size": "tiny", "cpu": 1, "memory_mib": 128}
    Sandbox.objects.bulk_create(
        Sandbox(**shape, ttl_s=60, launch_index=index, host=a if index < 4 else b, state=S.RUNNING if index == 0 else S.QUEUED)
        for index in range(6)
    )
    return launch, user


def _shares(text: str) -> dict[str, tuple[int, int]]:
    message = json.loads(text)
    assert message["type"] == "hosts"
    return {share["host"]: (share["queued"], share["running"]) for share in message["hosts"]}


def test_the_ticker_sends_each_hosts_share_when_it_changes(spread: tuple[Launch, User], monkeypatch: pytest.MonkeyPatch) -> None:
    launch, _ = spread
    monkeypatch.setattr(board, "COUNTERS_EVERY_S", 0.0)  # every call, not once a second
    ticker = board.Ticker()
    Sandbox.objects.filter(launch=launch).update(updated_at=timezone.now())
    ticker.tick()  # the ticker now follows the launch
    (text,) = ticker.host_shares()[launch.team_id]
    assert json.loads(text)["launch"] == launch.id
    assert _shares(text) == {"a": (3, 1), "b": (2, 0)}
    assert ticker.host_shares() == {}, "unchanged: nothing sent"
    Sandbox.objects.filter(launch=launch, launch_index=5).update(state=S.RUNNING)
    (text,) = ticker.host_shares()[launch.team_id]
    assert _shares(text) == {"a": (3, 1), "b": (1, 1)}


def test_a_viewer_gets_the_shares_only_once_it_asks(spread: tuple[Launch, User]) -> None:
    launch, user = spread
    layer = get_channel_layer()

    async def viewer() -> WebsocketCommunicator:
        communicator = WebsocketCommunicator(APP, f"/ws/board/{launch.id}/")
        communicator.scope["user"] = user
        connected, _ = await communicator.connect()
        assert connected
        for _ in range(2):  # the layout and the snapshot
            assert "bytes" in await communicator.receive_output(timeout=5)
        return communicator

    async def next_text(communicator: WebsocketCommunicator, within: float = 5) -> str | None:
        """The next text message, past the binary frames the running ticker sends; None if none comes within
        ``within`` seconds (waiting with receive_nothing, which, unlike a timed-out receive, leaves the app running)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while loop.time() < deadline:
            if await communicator.receive_nothing(timeout=0.05):
                continue
            output = await communicator.receive_output(timeout=1)
            if "text" in output:
                return str(output["text"])
        return None

    async def scenario() -> None:
        asking, silent = await viewer(), await viewer()
        await asking.send_to(text_data='{"type": "hosts"}')
        first = await next_text(asking)
        assert first is not None and _shares(first) == {"a": (3, 1), "b": (2, 0)}
        text = json.dumps({"type": "hosts", "launch": launch.id, "hosts": [{"host": "a", "queued": 0, "running": 4}]})
        other = json.dumps({"type": "hosts", "launch": "launch_other", "hosts": []})
        for message in (other, text):
            await layer.group_send(board.group_name(launch.team_id), {"type": "board.hosts", "text": message})
        sent = await next_text(asking)
        while sent is not None and json.loads(sent) == json.loads(first):
            sent = await next_text(asking)  # the running ticker's own report of the real shares may come first
        assert sent == text, "another launch's shares are not its"
        assert await next_text(silent, within=1) is None, "a viewer that did not ask gets no text"
        await asking.disconnect()
        await silent.disconnect()
        await database_sync_to_async(connections.close_all)()

    asyncio.run(scenario())
