"""``GET /launches/{id}/arrivals``: a launch's sandboxes pushed to its caller as each becomes ready.

What ``launch.wait()`` reads. Polling the member listing for the ones ready
since the latest seen has to look back a moment for rows written late (a
worker records sandboxes in batches, after the engine stamped them ready),
so every poll sent a launch's recent members again: at a trainer's poll
rate the web server serialised each member of a launch of 1,000 about ten
times over (docs/benchmarks.md). Here the web server does the looking back
itself, reading only the members' ids, and sends each member once:

* ``{"type": "sandbox", "sandbox": {...}}``: a member as ``GET /sandboxes/{id}``
  shows it (with its ``data_path``), running ones in the order they became
  ready; once the launch has settled, every member not sent yet (the failed
  and ended ones, and any a late write kept back), in launch order;
* ``{"type": "progress", "launch": {...}}``: the launch as ``GET /launches/{id}``
  shows it, whenever its progress changed (looked at every ``PROGRESS_S``, and
  as soon as as many members came as the launch has), and at least every
  ``KEEPALIVE_S`` (a reader's read timeout never fires on a slow launch);
* ``{"type": "end", "launch": {...}}``: last; every member was sent.

A caller that is cut off asks again and skips the ids it has: the stream
starts over from the first member.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

from ninja.responses import NinjaJSONEncoder

from console.db import db

from .. import selectors
from ..gateway_access import Access
from ..models import Launch, Sandbox
from ..schemas import LaunchOut, SandboxOut
from .answers import launch_out, sandbox_out

POLL_S = 0.1  # how often the members are looked at while the launch starts
FIRST_POLL_S = 0.02  # until the first member came: what a trainer waits on first is the first sandbox
KEEPALIVE_S = 2.0  # a progress line at least this often
# How often the launch itself (its progress: counts over every member) is read; the ready members are read
# every poll. Reading both every 100 ms was most of the web server's work for a launch.
PROGRESS_S = 0.5
# How far back each look reaches before the latest write seen: a transaction that records members commits
# a little after it stamped them (a batch of 64); one that commits later than this is still sent, at the end.
LATE_WRITES = timedelta(seconds=1)
CHUNK = 500  # members read in full at once


def _line(message: dict[str, Any]) -> bytes:
    return (json.dumps(message, cls=NinjaJSONEncoder) + "\n").encode()


def _launch(launch: Launch) -> dict[str, Any]:
    return LaunchOut.model_validate(launch_out(launch)).model_dump()


def _settled(answer: dict[str, Any]) -> bool:
    progress = answer["progress"]
    return progress["queued"] + progress["creating"] == 0 or answer["state"] in ("stopping", "stopped", "failed")


def _look(launch_id: str) -> dict[str, Any]:
    """The launch as it is now."""
    return _launch(Launch.objects.select_related("snapshot").get(pk=launch_id))


def _members(ids: list[str], access: Access | None) -> list[dict[str, Any]]:
    rows = Sandbox.objects.select_related("host").defer("env").filter(pk__in=ids)
    by_id = {row.pk: row for row in rows}
    return [SandboxOut.model_validate(sandbox_out(by_id[pk], access)).model_dump() for pk in ids if pk in by_id]


async def _send(ids: list[str], access: Access | None) -> AsyncIterator[bytes]:
    """These members' lines, read in full ``CHUNK`` at a time."""
    for start in range(0, len(ids), CHUNK):
        for member in await db(_members)(ids[start : start + CHUNK], access):
            yield _line({"type": "sandbox", "sandbox": member})


async def arrivals(launch: Launch, access: Access | None) -> AsyncIterator[bytes]:
    sent: set[str] = set()
    since = None  # the latest write seen
    last_progress: dict[str, Any] | None = None
    last_line = looked = 0.0
    while True:
        ready = await db(selectors.launch_members_ready)(launch, since - LATE_WRITES if since is not None else None)
        if ready:
            since = max(max(written for _, written in ready), since or ready[0][1])
        fresh = [pk for pk, _ in ready if pk not in sent]
        async for line in _send(fresh, access):
            yield line
        sent.update(fresh)
        if last_progress is None or len(sent) >= launch.count or time.monotonic() - looked >= PROGRESS_S:
            answer = await db(_look)(launch.pk)
            looked = time.monotonic()
            if _settled(answer):
                break
            if answer["progress"] != (last_progress or {}).get("progress") or looked - last_line >= KEEPALIVE_S:
                yield _line({"type": "progress", "launch": answer})
                last_progress, last_line = answer, looked
        await asyncio.sleep(POLL_S if sent else FIRST_POLL_S)
    async for line in _send([pk for pk in await db(selectors.launch_member_ids)(launch) if pk not in sent], access):
        yield line
    yield _line({"type": "end", "launch": answer})
