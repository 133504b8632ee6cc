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
    counters = requested, queued, creating, running, failed, ended: u32 each |
               elapsed_ms u32 | cost so far in micro-USD u64

Pixel states: 0 requested, 1 starting, 2 running, 3 failed, 4 stopped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal

from django.core.cache import cache
from django.db.models import Count, Q, Sum
from django.utils import timezone

from .board_protocol import (
    FAILED,
    REQUESTED,
    RUNNING,
    STARTING,
    STOPPED,
    Counters,
    delta_section,
    frame,
    section_id,
)
from .models import Launch, Sandbox
from .wordmark import render

log = logging.getLogger("forkyard.board")
TICK_S = 0.1
OVERLAP_S = 2.0  # rows committed late carry an older updated_at: look back this far
STATE_CODES: dict[str, int] = {  # a row's state -> its pixel's code
    Sandbox.State.QUEUED: REQUESTED,
    Sandbox.State.CREATING: STARTING,
    Sandbox.State.RUNNING: RUNNING,
    Sandbox.State.PAUSED: RUNNING,
    Sandbox.State.FAILED: FAILED,
    Sandbox.State.STOPPING: STOPPED,
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


def counters_for(launch: Launch, now: float | None = None) -> Counters:
    """Progress by state, elapsed time, and cost so far at the per-second price."""
    from billing.models import UsagePeriod

    states = dict(Sandbox.objects.filter(launch=launch).values_list("state").annotate(n=Count("id")).values_list("state", "n"))
    made = sum(states.values())
    end = launch.ended_at or timezone.now()
    periods = UsagePeriod.objects.filter(sandbox__launch=launch)
    closed = periods.filter(ended_at__isnull=False).aggregate(total=Sum("amount"))["total"] or Decimal(0)
    cost = Decimal(closed)
    now_ms = int((now or time.time()) * 1000)
    for unit_price, open_count, started_sum in (
        periods.filter(ended_at__isnull=True)
        .values("unit_price")
        .annotate(n=Count("id"), started=Sum("started_ms"))
        .values_list("unit_price", "n", "started")
    ):
        running_ms = open_count * now_ms - int(started_sum or 0)
        cost += Decimal(running_ms) * Decimal(unit_price) / Decimal(3_600_000)
    return Counters(
        requested=launch.count,
        queued=states.get(Sandbox.State.QUEUED, 0) + max(0, launch.count - made),
        creating=states.get(Sandbox.State.CREATING, 0),
        running=states.get(Sandbox.State.RUNNING, 0) + states.get(Sandbox.State.PAUSED, 0),
        failed=states.get(Sandbox.State.FAILED, 0),
        ended=sum(states.get(state, 0) for state in (Sandbox.State.STOPPING, Sandbox.State.STOPPED, Sandbox.State.DESTROYED)),
        elapsed_ms=max(0, int((end - launch.created_at).total_seconds() * 1000)),
        cost_micro_usd=max(0, int(cost * 1_000_000)),
    )


def pixel_states(launch: Launch) -> bytearray:
    states = bytearray(launch.count)  # not yet made: requested (0)
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
COUNTERS_EVERY_S = 1.0  # the cost so far is an aggregate over the whole launch: not every tick


@dataclass
class _Watched:
    launch_id: str
    team_id: str
    states: bytearray
    last_counters: float = 0.0
    counters: Counters | None = None
    last_seen: float = field(default_factory=time.monotonic)


def _current(watched: _Watched, launch: Launch) -> Counters:
    """Counts from the pixels we hold (exact as of this tick); elapsed now; cost
    from the last database read (it moves slowly, and costs a query)."""
    states = bytes(watched.states)
    base = watched.counters or Counters()
    end = launch.ended_at or timezone.now()
    return Counters(
        requested=launch.count,
        queued=states.count(REQUESTED),
        creating=states.count(STARTING),
        running=states.count(RUNNING),
        failed=states.count(FAILED),
        ended=states.count(STOPPED),
        elapsed_ms=max(0, int((end - launch.created_at).total_seconds() * 1000)),
        cost_micro_usd=base.cost_micro_usd,
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
        from .models import BoardLease

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
            if now - watched.last_counters >= 1.0:
                pending.setdefault(watched.launch_id, {})
        by_team: dict[str, list[bytes]] = {}
        whole: dict[str, list[bytes]] = {}
        for launch_id, changes in pending.items():
            launch = Launch.objects.filter(pk=launch_id).first()
            watched = self.watched[launch_id]
            if launch is None:
                self.watched.pop(launch_id, None)
                continue
            if watched.counters is None or now - watched.last_counters >= COUNTERS_EVERY_S:
                watched.counters, watched.last_counters = counters_for(launch), now
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


_running: asyncio.Task[None] | None = None


def ensure_ticker() -> None:
    """Start the ticker in this process if it is not running (the lease decides who ticks)."""
    global _running
    if _running is None or _running.done():
        _running = asyncio.get_running_loop().create_task(_run())


async def _run() -> None:
    from channels.layers import get_channel_layer

    from console.db import db

    ticker = Ticker()
    layer = get_channel_layer()
    assert layer is not None  # settings always configure one (console/settings.py)
    while True:
        started = time.monotonic()
        try:
            if await db(ticker.lease)():
                for team_id, frames in (await db(ticker.tick)()).items():
                    for data in frames:
                        await layer.group_send(group_name(team_id), {"type": "board.frame", "bytes": data})
        except Exception as error:  # noqa: BLE001 - a board outage must not end the ticker
            log.warning("board ticker: %s", error)
            await asyncio.sleep(1)
        await asyncio.sleep(max(0.0, TICK_S - (time.monotonic() - started)))
