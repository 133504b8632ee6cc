"""The live launch board: its wire format, its snapshots and its ticker.

One frame per team per tick (about ten a second at most), never one message
per sandbox.  The ticker reads what changed in the database, keeps the last
state it sent for each pixel, and publishes the differences to the team's
group as run-length-encoded binary sections.  A viewer gets the layout and a
full snapshot when it connects, then applies deltas whose sequence number is
newer than its snapshot; on a gap it asks for a new snapshot.

Frame (little-endian):

    "FY" | version u8 (1) | kind u8 (L layout, S snapshot, D delta) | seq u32 | sections u16 | section*
    section  = launch id (u8 length + ASCII) | body
    layout   = width u16 | height u16 | bitmap (rows of ceil(width/8) bytes, MSB first)
    snapshot = counters | count u32 | one state byte per pixel
    delta    = counters | runs u32 | run* (start u32 | length u16 | state u8)
    counters = requested, queued, creating, running, failed, ended, paused, stopping: u32 each |
               elapsed_ms u32 | cost so far in micro-USD u64

Pixel states: 0 requested, 1 starting, 2 running, 3 failed, 4 off (its sandbox has really
ended: destroyed by its engine, stopped, or never made), 5 stopping (asked to stop, still
there: still billed), 6 paused.  The counters count as the API does (``running`` holds the
paused, ``ended`` the stopping); ``paused`` and ``stopping`` say how many of those.

Each host's share of a launch (how many of its members each host holds, by
stage: ``selectors.launch_host_shares``) travels apart from the frames, as a
JSON text message to the viewers that asked for it (a viewer sends
``{"type": "hosts"}``; it gets the shares at once, then again whenever they
change, at most once a second):

    {"type": "hosts", "launch": id, "hosts": [{"host", "queued", "creating", "running", "failed", "ended"}]}

A viewer that never asks gets only the binary frames.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

from channels.layers import get_channel_layer
from django.core.cache import cache
from django.db.models import Q
from django.utils import timezone

from billing.models import UsagePeriod
from billing.selectors import cost_so_far
from console.db import db

from .. import selectors
from ..models import BoardLease, Launch, Sandbox
from .protocol import (
    FAILED,
    PAUSED,
    REQUESTED,
    RUNNING,
    STARTING,
    STOPPED,
    STOPPING,
    Counters,
    delta_section,
    frame,
    section_id,
)
from .wordmark import render

log = logging.getLogger("forkyard.board")
TICK_S = 0.1
OVERLAP_S = 2.0  # rows committed late carry an older updated_at: look back this far
STATE_CODES: dict[str, int] = {  # a row's state -> its pixel's code
    Sandbox.State.QUEUED: REQUESTED,
    Sandbox.State.CREATING: STARTING,
    Sandbox.State.RUNNING: RUNNING,
    Sandbox.State.PAUSED: PAUSED,
    Sandbox.State.FAILED: FAILED,
    Sandbox.State.STOPPING: STOPPING,
    Sandbox.State.STOPPED: STOPPED,
    Sandbox.State.DESTROYED: STOPPED,
}


def group_name(team_id: str) -> str:
    return f"board.{team_id}"


def _seq_key(team_id: str) -> str:
    return f"board-seq:{team_id}"


def layout_section(launch: Launch) -> bytes:
    mark = render(board_text(launch), launch.count)
    return section_id(launch.id) + struct.pack("<HH", mark.width, mark.height) + mark.bits


def board_text(launch: Launch) -> str:
    return str(launch.labels.get("board_text") or "forkyard")


def cost_micro_usd(launch: Launch, now: float | None = None) -> int:
    """What the launch has cost so far, open periods counted up to now: two aggregates over its members' billing."""
    cost = cost_so_far(UsagePeriod.objects.filter(sandbox__launch=launch), now_ms=int((now or time.time()) * 1000))
    return max(0, int(cost * 1_000_000))


def counters_for(launch: Launch, now: float | None = None) -> Counters:
    """Progress by state, elapsed time, and cost so far (open periods counted up to now)."""
    progress = selectors.launch_progress(launch)
    states = selectors.member_states(launch)
    end = launch.ended_at or timezone.now()
    return Counters(
        **progress.counts(),
        paused=states.get(Sandbox.State.PAUSED, 0),
        stopping=states.get(Sandbox.State.STOPPING, 0),
        elapsed_ms=max(0, int((end - launch.created_at).total_seconds() * 1000)),
        cost_micro_usd=cost_micro_usd(launch, now),
    )


def pixel_states(launch: Launch) -> bytearray:
    # Not yet made: requested (0) while the launch starts; once it is torn down they never will be: off.
    states = bytearray([REQUESTED if launch.state == Launch.State.CREATING else STOPPED]) * launch.count
    for index, state in Sandbox.objects.filter(launch=launch).values_list("launch_index", "state").iterator(chunk_size=5000):
        if index is not None and 0 <= index < launch.count:
            states[index] = STATE_CODES.get(state, REQUESTED)
    return states


def snapshot_frames(launch: Launch) -> tuple[bytes, bytes]:
    """Layout and full state of one launch, tagged with the team's current sequence:
    deltas numbered after it are newer than this snapshot."""
    seq = int(cache.get(_seq_key(launch.team_id), 0))
    states = pixel_states(launch)
    return frame(b"L", seq, [layout_section(launch)]), frame(
        b"S", seq, [snapshot_section(launch.id, counters_for(launch), states)]
    )


def snapshot_section(launch_id: str, counters: Counters, states: bytes | bytearray) -> bytes:
    return section_id(launch_id) + counters.pack() + struct.pack("<I", len(states)) + bytes(states)


LEASE_RENEW_S = 1.0
COUNTERS_EVERY_S = 1.0  # counters move on their own (elapsed): sent at least this often; host shares at most
# The cost so far is two aggregates over every member's billing (at 32,752 members, most of what the
# ticker asked of the database each second, on cores a launch keeps busy): read this often, and again
# whenever the launch changes state (so a stopped launch's final cost shows at once).
COST_EVERY_S = 5.0


@dataclass
class _Watched:
    launch_id: str
    team_id: str
    states: bytearray
    last_counters: float = 0.0  # when counters were last sent
    cost: int | None = None  # the cost so far (micro-USD) as last read; the counts come from the pixels (_current)
    last_cost: float = 0.0
    cost_state: str = ""  # the launch's state when the cost was read
    last_seen: float = field(default_factory=time.monotonic)
    last_shares: float = 0.0
    shares: str = ""  # the last host shares sent (JSON)


def _current(watched: _Watched, launch: Launch) -> Counters:
    """Counts from the pixels we hold (exact as of this tick); elapsed now; cost
    from the last database read (it moves slowly, and costs a query)."""
    states = bytes(watched.states)
    end = launch.ended_at or timezone.now()
    paused, stopping = states.count(PAUSED), states.count(STOPPING)
    return Counters(
        requested=launch.count,
        queued=states.count(REQUESTED) if launch.state == Launch.State.CREATING else 0,
        creating=states.count(STARTING),
        running=states.count(RUNNING) + paused,
        failed=states.count(FAILED),
        ended=states.count(STOPPED) + stopping + (0 if launch.state == Launch.State.CREATING else states.count(REQUESTED)),
        paused=paused,
        stopping=stopping,
        elapsed_ms=max(0, int((end - launch.created_at).total_seconds() * 1000)),
        cost_micro_usd=watched.cost or 0,
    )


class Ticker:
    """Publishes board deltas; one ticker per deployment holds the lease at a time."""

    def __init__(self) -> None:
        self.holder = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.watched: dict[str, _Watched] = {}
        self.seq: dict[str, int] = {}
        self.cursor = timezone.now() - timedelta(seconds=OVERLAP_S)
        self.renewed = 0.0

    def lease(self) -> bool:
        """Hold (or take) the deployment's one ticker lease: 3 s, renewed each
        second, not each tick (a write per tick competed with the workers'
        writes on SQLite, and the frames waited for it)."""
        if time.monotonic() - self.renewed < LEASE_RENEW_S:
            return True
        now = timezone.now()
        until = now + timedelta(seconds=3)
        taken = BoardLease.objects.filter(Q(holder=self.holder) | Q(expires_at__lt=now), name="board").update(
            holder=self.holder, expires_at=until
        )
        if not taken:
            _, taken = BoardLease.objects.get_or_create(name="board", defaults={"holder": self.holder, "expires_at": until})
        self.renewed = time.monotonic() if taken else 0.0
        return bool(taken)

    def tick(self) -> dict[str, list[bytes]]:
        """One round: the frames to send to each team that has news, in order."""
        # Everything since the last scan began, and a margin before it: a row
        # committed late carries an updated_at older than its commit.
        scan_started = timezone.now()
        since = self.cursor - timedelta(seconds=OVERLAP_S)
        self.cursor = scan_started
        changed = (
            Sandbox.objects.filter(updated_at__gte=since, launch__isnull=False)
            .values_list("launch_id", "team_id", "launch_index", "state")
            .iterator(chunk_size=5000)
        )
        pending: dict[str, dict[int, int]] = {}
        fresh: set[str] = set()
        for launch_id, team_id, index, state in changed:
            watched = self.watched.get(launch_id)
            if watched is None:
                launch = Launch.objects.filter(pk=launch_id).first()
                if launch is None:
                    continue
                # New to us: loaded whole, and sent whole. A viewer's snapshot
                # may predate this load, and a delta against our copy would
                # never carry what changed in between.
                watched = self.watched[launch_id] = _Watched(launch_id, team_id, pixel_states(launch))
                fresh.add(launch_id)
                pending.setdefault(launch_id, {})
                continue
            code = STATE_CODES.get(state, REQUESTED)
            if index is not None and 0 <= index < len(watched.states) and watched.states[index] != code:
                watched.states[index] = code
                pending.setdefault(launch_id, {})[index] = code
        now = time.monotonic()
        for watched in self.watched.values():
            # Counters move on their own (elapsed, cost): once a second anyway.
            if now - watched.last_counters >= COUNTERS_EVERY_S:
                pending.setdefault(watched.launch_id, {})
        by_team: dict[str, list[bytes]] = {}
        whole: dict[str, list[bytes]] = {}
        for launch_id, changes in pending.items():
            launch = Launch.objects.filter(pk=launch_id).first()
            watched = self.watched[launch_id]
            if launch is None:
                self.watched.pop(launch_id, None)
                continue
            if launch.state != Launch.State.CREATING and watched.states.find(REQUESTED) >= 0:
                # Torn down (or failed) before these were made: they never will be. Off.
                index = watched.states.find(REQUESTED)
                while index >= 0:
                    watched.states[index] = STOPPED
                    changes[index] = STOPPED
                    index = watched.states.find(REQUESTED, index + 1)
            if watched.cost is None or now - watched.last_cost >= COST_EVERY_S or launch.state != watched.cost_state:
                watched.cost = cost_micro_usd(launch)
                watched.last_cost, watched.cost_state = now, launch.state
            watched.last_counters = now
            if changes:
                watched.last_seen = now
            if launch_id in fresh:
                whole.setdefault(watched.team_id, []).append(
                    snapshot_section(launch_id, _current(watched, launch), watched.states)
                )
            else:
                by_team.setdefault(watched.team_id, []).append(delta_section(launch_id, _current(watched, launch), changes))
            if launch.state == Launch.State.STOPPED and now - watched.last_seen > 10:
                self.watched.pop(launch_id, None)  # ended and quiet: stop following it
        frames: dict[str, list[bytes]] = {}
        for kind, sections_by_team in ((b"S", whole), (b"D", by_team)):
            for team_id, sections in sections_by_team.items():
                seq = self.seq[team_id] = self.seq.get(team_id, int(cache.get(_seq_key(team_id), 0))) + 1
                cache.set(_seq_key(team_id), seq, None)
                frames.setdefault(team_id, []).append(frame(kind, seq, sections))
        return frames

    def host_shares(self) -> dict[str, list[str]]:
        """The host shares of watched launches that changed since they were last sent, by team (at most once a
        second per launch: one GROUP BY each)."""
        now = time.monotonic()
        texts: dict[str, list[str]] = {}
        for watched in list(self.watched.values()):
            if now - watched.last_shares < COUNTERS_EVERY_S:
                continue
            watched.last_shares = now
            launch = Launch.objects.filter(pk=watched.launch_id).first()
            if launch is None:
                continue
            text = shares_message(launch)
            if text != watched.shares:
                watched.shares = text
                texts.setdefault(watched.team_id, []).append(text)
        return texts


def shares_message(launch: Launch) -> str:
    """A launch's host shares as the viewers get them (JSON text)."""
    return json.dumps({"type": "hosts", "launch": launch.id, "hosts": selectors.launch_host_shares(launch)})


_running: asyncio.Task[None] | None = None


def ensure_ticker() -> None:
    """Start the ticker in this process if it is not running (the lease decides who ticks)."""
    global _running
    if _running is None or _running.done():
        _running = asyncio.get_running_loop().create_task(_run())


async def _run() -> None:
    ticker = Ticker()
    layer = get_channel_layer()
    assert layer is not None  # settings always configure one (console/settings.py)
    me = asyncio.current_task()
    while True:
        # A cancel is asked once.  Were a call to catch it and raise an error of its own (or return), this loop
        # would tick on, and whatever waits for the task (asyncio.run's shutdown, a server's) would wait for
        # ever: the request is still counted on the task, so end here.
        if me is not None and me.cancelling():
            raise asyncio.CancelledError
        started = time.monotonic()
        try:
            if await db(ticker.lease)():
                for team_id, frames in (await db(ticker.tick)()).items():
                    for data in frames:
                        await layer.group_send(group_name(team_id), {"type": "board.frame", "bytes": data})
                for team_id, texts in (await db(ticker.host_shares)()).items():
                    for text in texts:
                        await layer.group_send(group_name(team_id), {"type": "board.hosts", "text": text})
        except Exception as error:  # noqa: BLE001 - a board outage must not end the ticker
            log.warning("board ticker: %s", error)
            await asyncio.sleep(1)
        await asyncio.sleep(max(0.0, TICK_S - (time.monotonic() - started)))
