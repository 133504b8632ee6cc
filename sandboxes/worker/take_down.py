"""Take sandboxes down on a host's engine: the ``ensure_gone`` command.

Each row still alive is destroyed on the engine (idempotent: a sandbox the
engine no longer knows is gone already) and recorded ``destroyed`` at the
engine's own end time, which closes its billing.  A stopping row that never
reached the engine is left to the create in flight, which honours the destroy
when it returns (``transitions.sandboxes_started``); if nothing comes back
for ``FORKYARD_STUCK_AFTER_S``, it never reached the engine and is recorded
destroyed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from console.db import db_background
from sandboxes.engine import errors as engine_errors

from .. import engine_link, transitions
from ..models import Host, Sandbox
from .bring_up import PARALLEL, settle_launches

log = logging.getLogger("forkyard.worker")


def _never_reached(sandbox: Sandbox) -> None:
    """A row with no engine id: left to its create in flight, unless that is stuck."""
    stuck_before = timezone.now() - timedelta(seconds=settings.FORKYARD_STUCK_AFTER_S)
    if sandbox.state == Sandbox.State.STOPPING and sandbox.updated_at < stuck_before:
        transitions.sandbox_ended(sandbox, Sandbox.State.DESTROYED)  # it never reached the engine


def _destroy_each(host: Host, rows: list[Sandbox]) -> list[dict[str, Any]]:
    """An engine from before ``destroy_many``: a destroy each, side by side, answered as ``destroy_many`` answers."""

    def one(row: Sandbox) -> dict[str, Any]:
        try:
            return engine_link.engine(host.engine_socket).destroy(row.engine_id)
        except engine_errors.EngineError as error:
            return {"id": row.engine_id, "error": error.to_dict()}

    with ThreadPoolExecutor(min(PARALLEL, len(rows))) as pool:
        return list(pool.map(one, rows))


def _destroy_on_engine(host: Host, rows: list[Sandbox]) -> list[dict[str, Any]]:
    """Each row's sandbox destroyed on the engine, in one call: its record, or ``{"id", "error"}``."""
    try:
        return engine_link.engine(host.engine_socket).destroy_many([row.engine_id for row in rows])
    except engine_errors.InvalidRequest as error:
        if error.details.get("field") != "op":
            raise
        return _destroy_each(host, rows)


def _recorded(rows: list[Sandbox], answers: list[dict[str, Any]]) -> int:
    """Record what the engine answered for each row (``destroy_many``'s answers, in order), in one
    transaction; settle their launches. Raises the first engine error other than "not found" after
    recording the rest; how many it recorded."""
    destroyed: list[tuple[Sandbox, datetime | None]] = []
    failures: list[engine_errors.EngineError] = []
    for row, answer in zip(rows, answers, strict=True):
        error = answer.get("error")
        if error is None:
            destroyed.append((row, transitions.engine_time(answer, "ended_at")))
        elif error.get("code") == engine_errors.SandboxNotFound.code:
            destroyed.append((row, None))  # gone already: recorded now
        else:
            failures.append(engine_errors.from_dict(error))
    transitions.sandboxes_destroyed(destroyed)
    settle_launches(rows)
    if failures:
        raise failures[0]
    return len(destroyed)


def _live_rows(host_id: int, sandbox_ids: Sequence[str]) -> list[Sandbox]:
    return list(Sandbox.objects.filter(pk__in=list(sandbox_ids), host_id=host_id, state__in=Sandbox.LIVE))


def take_down(host: Host, sandbox_ids: list[str]) -> int:
    """Ensure these sandboxes are gone from this host; how many the engine destroyed.

    The engine destroys them all in one call (``destroy_many``, side by
    side there); what they ended is recorded in one transaction
    (``transitions.sandboxes_destroyed``), not a write each: on SQLite many
    writers would queue on the file lock.  A sandbox the engine no longer
    knows is gone already.  A worker that dies between the two leaves rows
    the engine has ended; the command's replay (or reconciliation) finds
    the engine's tombstones and records them.  Another error of the engine's
    fails the command after the rest are recorded, and its retry tries
    again."""
    rows = list(Sandbox.objects.filter(pk__in=sandbox_ids, host=host, state__in=Sandbox.LIVE))
    for row in rows:
        if not row.engine_id:
            _never_reached(row)
    on_engine = [row for row in rows if row.engine_id]
    destroyed = _recorded(on_engine, _destroy_on_engine(host, on_engine)) if on_engine else 0
    settled = {row.launch_id for row in on_engine}  # by _recorded
    settle_launches(row for row in rows if row.launch_id not in settled)  # those ended above, of other launches
    return destroyed


async def take_down_directly(stopping: Mapping[int, Sequence[str]]) -> int:
    """The API's fast path for a teardown (a launch's, a kill by label): the web server asks each
    host's engine itself, as it does for exec, instead of waiting for the host's worker to take
    the command. The commands are queued all the same, first (the caller's ``on_commit``): they
    are the safety net for whatever this does not finish (the web server dies, an engine does not
    answer), and a worker that takes one finds these rows ended and does nothing twice (destroys
    are idempotent on the engine, transitions conditional in the database). How many it
    recorded; failures are logged and left to the commands."""

    async def one_host(host_id: int, sandbox_ids: Sequence[str]) -> int:
        host = await db_background(Host.objects.filter(pk=host_id).first)()
        if host is None:
            return 0
        # The host's worker takes the commands' chunks (the same chunks) from the first; this path takes
        # them from the last, and reads each chunk's rows only when its turn comes: on a big teardown
        # the two meet in the middle instead of destroying and recording every chunk twice over.
        size = settings.FORKYARD_LAUNCH_CHUNK
        chunks = [list(sandbox_ids[start : start + size]) for start in range(0, len(sandbox_ids), size)][::-1]
        # Two chunks in flight: the engine destroys one while the database records the other.
        gate = asyncio.Semaphore(2)

        async def one_chunk(ids: list[str]) -> int:
            async with gate:
                part = [row for row in await db_background(_live_rows)(host_id, ids) if row.engine_id]
                if not part:
                    return 0
                async with engine_link.async_pool(host.engine_socket).client() as client:
                    answers = await client.destroy_many([row.engine_id for row in part])
            return int(await db_background(_recorded)(part, answers))

        return sum(await asyncio.gather(*(one_chunk(ids) for ids in chunks)))

    outcomes = await asyncio.gather(*(one_host(host_id, ids) for host_id, ids in stopping.items() if ids), return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            log.warning("direct teardown: %s; the hosts' commands finish it", outcome)
    return sum(outcome for outcome in outcomes if isinstance(outcome, int))


_background: set[asyncio.Task[int]] = set()


def take_down_in_background(stopping: Mapping[int, Sequence[str]]) -> None:
    """Start :func:`take_down_directly` on the running loop, without waiting for it (a teardown
    answers at once); the task is held until it ends."""
    if any(stopping.values()):
        task = asyncio.get_running_loop().create_task(take_down_directly(stopping))
        _background.add(task)
        task.add_done_callback(_background.discard)
