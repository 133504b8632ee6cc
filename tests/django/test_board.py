"""The board's websocket protocol: snapshot on connect, deltas, reconnect, resync."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from channels.db import database_sync_to_async
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser, User
from django.db import connections
from django.utils import timezone

from console.keys import api_key_create
from console.routing import websocket_urlpatterns
from console.services import team_create
from sandboxes.board import protocol as wire
from sandboxes.board import ticker as board
from sandboxes.models import Launch, Sandbox

pytestmark = pytest.mark.django_db(transaction=True)
APP = URLRouter(websocket_urlpatterns)


@pytest.fixture
def launch():
    user = User.objects.create_user("viewer", password="a-long-password")
    team = team_create(name="Board team", owner=user)
    key = api_key_create(team=team, name="k").key
    launch = Launch.objects.create(
        team=team, api_key=key, template="base", size="tiny", cpu=1, memory_mib=128, ttl_s=60, count=20
    )
    Sandbox.objects.bulk_create(
        Sandbox(
            team=team,
            api_key=key,
            launch=launch,
            launch_index=index,
            template="base",
            size="tiny",
            cpu=1,
            memory_mib=128,
            ttl_s=60,
        )
        for index in range(20)
    )
    return launch, user


async def connect(launch_id: str, user) -> WebsocketCommunicator:
    communicator = WebsocketCommunicator(APP, f"/ws/board/{launch_id}/")
    communicator.scope["user"] = user
    connected, code = await communicator.connect()
    assert connected, code
    return communicator


async def receive(communicator: WebsocketCommunicator, timeout: float = 5.0) -> dict:
    output = await communicator.receive_output(timeout=timeout)
    return wire.parse(output["bytes"])


async def until(communicator: WebsocketCommunicator, predicate, timeout: float = 8.0) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        frame = await receive(communicator, max(0.1, deadline - loop.time()))
        if predicate(frame):
            return frame


def _set_running(launch: Launch, indexes: list[int]) -> None:
    Sandbox.objects.filter(launch=launch, launch_index__in=indexes).update(state=Sandbox.State.RUNNING, updated_at=timezone.now())


class View:
    """What a browser holds: pixels from snapshots, then deltas newer than the snapshot."""

    def __init__(self, launch_id: str) -> None:
        self.launch_id, self.states, self.snapshot_seq, self.counters = launch_id, bytearray(), -1, None

    def apply(self, frame: dict) -> None:
        for section in frame["sections"]:
            if section["launch"] != self.launch_id or frame["kind"] == "L":
                continue
            if frame["kind"] == "S":
                self.states, self.snapshot_seq = bytearray(section["states"]), frame["seq"]
            elif frame["seq"] > self.snapshot_seq:
                for start, length, state in section["runs"]:
                    self.states[start : start + length] = bytes([state]) * length
            else:
                continue
            self.counters = section["counters"]

    def running(self) -> list[int]:
        return [index for index, state in enumerate(self.states) if state == wire.RUNNING]


def test_snapshot_then_deltas_then_reconnect(launch):
    launch, user = launch

    async def scenario() -> None:
        viewer = await connect(launch.id, user)
        view = View(launch.id)
        layout = await receive(viewer)
        assert layout["kind"] == "L"
        section = layout["sections"][0]
        assert section["launch"] == launch.id and section["width"] * section["height"] >= 20
        snapshot = await receive(viewer)
        assert snapshot["kind"] == "S"
        assert bytes(snapshot["sections"][0]["states"]) == bytes(20)
        assert snapshot["sections"][0]["counters"].requested == 20
        view.apply(snapshot)
        await database_sync_to_async(_set_running)(launch, [3, 4, 5, 9])

        def caught_up(frame: dict) -> bool:
            view.apply(frame)
            return view.running() == [3, 4, 5, 9] and view.counters.running == 4

        last = await until(viewer, caught_up)
        assert last["seq"] > snapshot["seq"]
        await viewer.disconnect()

        again = await connect(launch.id, user)
        await receive(again)
        states = (await receive(again))["sections"][0]["states"]
        assert [index for index, state in enumerate(states) if state == wire.RUNNING] == [3, 4, 5, 9]
        await again.send_to(text_data='{"type": "resync"}')
        await until(again, lambda f: f["kind"] == "S")
        await again.disconnect()
        await database_sync_to_async(connections.close_all)()

    asyncio.run(scenario())


def test_a_launch_first_seen_after_a_change_is_sent_whole(launch):
    """A viewer's snapshot predates the ticker's first look at the launch; what
    changed between them must reach the viewer, not vanish into the ticker's copy."""
    launch, _ = launch
    Sandbox.objects.filter(launch=launch).update(updated_at=timezone.now() - timedelta(minutes=5))
    view = View(launch.id)
    view.apply(wire.parse(board.snapshot_frames(launch)[1]))
    ticker = board.Ticker()
    assert ticker.tick() == {}, "nothing changed recently: nothing to say"
    _set_running(launch, [0, 7])
    frames = ticker.tick()[launch.team_id]
    assert [wire.parse(data)["kind"] for data in frames] == ["S"]
    for data in frames:
        view.apply(wire.parse(data))
    assert view.running() == [0, 7]
    _set_running(launch, [8])
    (delta,) = ticker.tick()[launch.team_id]
    view.apply(wire.parse(delta))
    assert wire.parse(delta)["kind"] == "D" and view.running() == [0, 7, 8]


def test_strangers_and_anonymous_viewers_are_refused(launch):
    launch, _ = launch
    stranger = User.objects.create_user("stranger", password="another-password")

    async def scenario() -> None:
        for user, code in ((AnonymousUser(), 4401), (stranger, 4404)):
            communicator = WebsocketCommunicator(APP, f"/ws/board/{launch.id}/")
            communicator.scope["user"] = user
            connected, close_code = await communicator.connect()
            assert not connected and close_code == code
        await database_sync_to_async(connections.close_all)()

    asyncio.run(scenario())


def test_frames_are_compact_runs():
    assert wire.runs({0: 2, 1: 2, 2: 2, 5: 3, 6: 2}) == [(0, 3, 2), (5, 1, 3), (6, 1, 2)]
    section = wire.delta_section("launch_x", wire.Counters(requested=32752), {index: 2 for index in range(250)})
    assert len(section) < 100, "a chunk of 250 sandboxes going running is one run"


def test_stopping_has_its_own_pixel_and_a_pixel_goes_off_only_when_its_sandbox_ended(launch) -> None:
    """The ticker's pixels follow the rows: stopping (asked to stop, still on its engine) is not off;
    destroyed (its engine's end recorded) is; paused has its own colour; the counters say how many."""
    launch, _ = launch
    ticker = board.Ticker()
    ticker.tick()  # first sight of the launch: sent whole
    ids = list(Sandbox.objects.filter(launch=launch).order_by("launch_index").values_list("pk", flat=True))
    now = timezone.now()
    Sandbox.objects.filter(pk__in=ids[:5]).update(state=Sandbox.State.RUNNING, updated_at=now)
    Sandbox.objects.filter(pk__in=ids[5:8]).update(state=Sandbox.State.PAUSED, updated_at=now)
    Sandbox.objects.filter(pk__in=ids[8:12]).update(state=Sandbox.State.STOPPING, updated_at=now)
    Sandbox.objects.filter(pk__in=ids[12:14]).update(state=Sandbox.State.DESTROYED, updated_at=now)
    frames = ticker.tick()[launch.team_id]
    [section] = wire.parse(frames[-1])["sections"]
    states = bytes(ticker.watched[launch.id].states)
    assert states[:5] == bytes([wire.RUNNING] * 5)
    assert states[5:8] == bytes([wire.PAUSED] * 3)
    assert states[8:12] == bytes([wire.STOPPING] * 4), "asked to stop, not yet gone: not off"
    assert states[12:14] == bytes([wire.STOPPED] * 2), "destroyed: off"
    counters = section["counters"]
    assert (counters.running, counters.paused, counters.stopping, counters.ended) == (8, 3, 4, 6)


def test_the_cost_is_read_every_few_seconds_and_when_the_launch_changes_state(launch, monkeypatch) -> None:
    """The cost so far is two aggregates over every member's billing: at 32,752 members the most the ticker
    asked of the database each second, on cores the launch kept busy. It is read every COST_EVERY_S, and
    again at once when the launch changes state (a stopped launch's final cost shows without waiting); the
    counts, from the pixels, move every tick."""
    launch, _ = launch
    reads: list[str] = []
    real = board.cost_micro_usd
    monkeypatch.setattr(board, "cost_micro_usd", lambda of, now=None: reads.append(of.state) or real(of, now))
    clock = [1000.0]
    monkeypatch.setattr(board.time, "monotonic", lambda: clock[0])
    ticker = board.Ticker()
    ticker.tick()  # the launch is new to it: loaded whole
    ids = list(Sandbox.objects.filter(launch=launch).order_by("launch_index").values_list("pk", flat=True))
    for step in range(4):  # a second apart: each tick sends counters, none reads the cost again
        clock[0] += 1.0
        Sandbox.objects.filter(pk=ids[step]).update(state=Sandbox.State.RUNNING, updated_at=timezone.now())
        [section] = wire.parse(ticker.tick()[launch.team_id][-1])["sections"]
        assert section["counters"].running == step + 1
    assert len(reads) == 1, reads
    clock[0] += board.COST_EVERY_S
    ticker.tick()
    assert len(reads) == 2, "read again once COST_EVERY_S has passed"
    Launch.objects.filter(pk=launch.pk).update(state=Launch.State.STOPPING)
    clock[0] += 0.1
    Sandbox.objects.filter(pk=ids[0]).update(state=Sandbox.State.STOPPING, updated_at=timezone.now())
    ticker.tick()
    assert reads[2:] == [Launch.State.STOPPING], "a launch that changed state has its cost read at once"


def test_a_torn_down_launchs_unmade_pixels_go_off(launch) -> None:
    launch, _ = launch
    Launch.objects.filter(pk=launch.pk).update(count=25)  # five members never made
    ticker = board.Ticker()
    ticker.tick()
    assert bytes(ticker.watched[launch.id].states)[20:] == bytes([wire.REQUESTED] * 5)
    Launch.objects.filter(pk=launch.pk).update(state=Launch.State.STOPPING)
    Sandbox.objects.filter(launch=launch).update(state=Sandbox.State.DESTROYED, updated_at=timezone.now())
    ticker.watched[launch.id].last_counters = 0
    ticker.tick()
    assert bytes(ticker.watched[launch.id].states) == bytes([wire.STOPPED] * 25), "they never will be made: off"


def test_the_ticker_ends_when_cancelled_even_if_a_call_turns_the_cancel_into_an_error(monkeypatch) -> None:
    """A cancel that a call catches and re-raises as an error of its own (as a database or Redis client can)
    still ends the ticker: otherwise its loop ticks on and the event loop that cancelled it never closes."""
    swallow = True

    def cancel_turned_into_an_error(function):
        async def call(*args, **kwargs):
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                if swallow:
                    raise ConnectionError("the connection was closed under the call") from None
                raise

        return call

    monkeypatch.setattr(board, "db", cancel_turned_into_an_error)

    async def scenario() -> None:
        nonlocal swallow
        task = asyncio.get_running_loop().create_task(board._run())
        await asyncio.sleep(0.1)  # the ticker is inside its first call
        task.cancel()
        try:
            await asyncio.wait({task}, timeout=30)
            assert task.cancelled(), "the ticker ticks on after its cancel"
        finally:
            swallow = False  # lets asyncio.run close if the ticker did not end
            task.cancel()

    asyncio.run(scenario())
