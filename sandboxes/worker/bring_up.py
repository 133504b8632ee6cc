"""Bring sandboxes up on a host's engine: the ``ensure_running`` command, and the API's direct path for one.

1. Claim the rows (``queued -> creating``); only rows still creating are made.
2. Make sure the host holds every snapshot they fork (``snapshot_copy``).
3. Ask the engine to create each, in parallel (at most ``CREATES_IN_FLIGHT``
   per worker process), with the row's id as the engine's idempotency key:
   a replayed command gets the same engine sandbox back.
4. Record the outcomes in batches (``transitions.sandboxes_started``): a few
   transactions per hundred sandboxes, not several each.  A sandbox whose
   destroy arrived meanwhile is destroyed at once, never recorded running.
5. Settle the launches they belong to.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from console.db import db, one_writer
from console.errors import Unavailable
from sandboxes.engine import errors as engine_errors

from .. import commands, engine_link, transitions
from ..models import Host, Launch, Sandbox
from .snapshot_copy import snapshots_missing

PARALLEL = 16
BATCH = 64  # sandboxes recorded running per transaction, at most
# A started sandbox waits at most this long for others to share its transaction.
# Each transaction costs the database a few queries and a commit: at 5 ms a
# launch of 1,000 wrote in ~1,000 of them (6.1 s on PostgreSQL), at 100 ms in
# ~150 (see docs/benchmarks.md); the board shows a pixel that much later at most.
BATCH_WAIT_S = 0.1
# Creates this worker has in flight at once, whatever the number of chunks it
# runs: an engine makes a few hundred a second, and a deeper queue in front of
# it only makes each sandbox wait longer between ready and recorded.
CREATES_IN_FLIGHT = 32
_in_flight = threading.BoundedSemaphore(CREATES_IN_FLIGHT)

# Rows this process's bring_up calls are at, so that its own reconciliation leaves them alone.
_at_work: Counter[str] = Counter()
_at_work_lock = threading.Lock()


@contextmanager
def at_work(sandbox_ids: Iterable[str]) -> Iterator[None]:
    ids = list(sandbox_ids)
    with _at_work_lock:
        _at_work.update(ids)
    try:
        yield
    finally:
        with _at_work_lock:
            _at_work.subtract(ids)
            for sandbox_id in ids:
                if _at_work[sandbox_id] <= 0:
                    del _at_work[sandbox_id]


def is_at_work(sandbox_id: str) -> bool:
    """True while a bring_up in this process is creating it."""
    return sandbox_id in _at_work


def create_args(sandbox: Sandbox) -> dict[str, Any]:
    """The engine's create for a row: idempotent on the row's id; the size's name and its shape (the engine
    serves it from a warm pool of that size only if its own shape for the name is the same)."""
    args: dict[str, Any] = {
        # In the engine a snapshot is a template named by the snapshot's id.
        "template": sandbox.snapshot_id or sandbox.template,
        "ttl_s": sandbox.ttl_s,
        "env": sandbox.env,
        "labels": dict(sandbox.labels),
        "key": sandbox.pk,
        "cpu": sandbox.cpu,
        "memory_mib": sandbox.memory_mib,
    }
    if sandbox.size:
        args["size"] = sandbox.size
    if sandbox.disk_mib:
        args["disk_mib"] = sandbox.disk_mib
    if sandbox.idle_timeout_s:
        args["idle_timeout_s"] = sandbox.idle_timeout_s
    if sandbox.memory_group:
        args["memory_group"] = {"id": sandbox.memory_group, "memory_mib": sandbox.memory_group_mib}
        if sandbox.memory_group_cpu:
            args["memory_group"]["cpu"] = sandbox.memory_group_cpu
    if sandbox.network_policy_id:
        # The rules as they are now (a later PUT reaches it through services.policies.policy_apply).
        assert sandbox.network_policy is not None
        args["network"] = sandbox.network_policy.engine_network(sandbox.launch_id)
    return args


def record_started(host: Host, started: list[tuple[Sandbox, dict[str, Any]]]) -> transitions.Started:
    """Record engine sandboxes that came back running; destroy at once those nobody wants any more."""
    outcome = transitions.sandboxes_started(started)
    for sandbox, engine_id in outcome.to_destroy:
        try:
            engine_link.engine(host.engine_socket).destroy(engine_id)
        except engine_errors.SandboxNotFound:
            pass
        transitions.sandbox_ended(sandbox, Sandbox.State.DESTROYED, only_from={Sandbox.State.STOPPING})
    return outcome


def _create(host: Host, sandbox: Sandbox, missing: dict[str, engine_errors.EngineError]) -> tuple[str, dict[str, Any]]:
    """One engine create, in a pool thread: ("started", record), or an outcome already recorded."""
    unavailable = missing.get(sandbox.snapshot_id or "")
    if unavailable is not None:
        return transitions.sandbox_failed(sandbox, code=unavailable.code, message=unavailable.message), {}
    try:
        with _in_flight:
            record = engine_link.engine(host.engine_socket).create(**create_args(sandbox))
    except engine_errors.Unavailable:
        raise  # the whole chunk is retried: creates are idempotent on the key
    except engine_errors.EngineError as error:
        return transitions.sandbox_failed(sandbox, code=error.code, message=error.message), {}
    if record["state"] != "running":
        transitions.sandbox_ended(sandbox, Sandbox.State.DESTROYED, at=transitions.engine_time(record, "ended_at"))
        return Sandbox.State.DESTROYED, {}
    return "started", record


def _heartbeat(sandbox_ids: list[str]) -> None:
    """A sign of life on rows still waiting for the engine (reconciliation takes a silent one for lost)."""
    with one_writer():
        for start in range(0, len(sandbox_ids), 500):
            chunk = sandbox_ids[start : start + 500]
            Sandbox.objects.filter(pk__in=chunk, state=Sandbox.State.CREATING).update(updated_at=timezone.now())


def bring_up(host: Host, sandbox_ids: list[str]) -> dict[str, int]:
    """Ensure these sandboxes run on this host; how many ended up running, failed, destroyed."""
    transitions.sandboxes_claimed(sandbox_ids, host)
    rows = list(
        Sandbox.objects.filter(pk__in=sandbox_ids, host=host, state=Sandbox.State.CREATING).select_related("network_policy")
    )
    # Every row read back creating (a launch's chunk, as a rule): none can have been torn down unmade.
    unmade = _ended_unmade(host, sandbox_ids) if len(rows) < len(set(sandbox_ids)) else []
    missing = snapshots_missing(host, rows)
    counts = {"running": 0, "failed": 0, "destroyed": 0}
    # Reconciliation takes a creating row whose engine sandbox runs but which no
    # worker recorded for FORKYARD_STUCK_AFTER_S as lost with its worker, and
    # adopts it. Rows of a big chunk wait longer than that on a busy host, so
    # this process tells its own reconciliation which rows it is still at
    # (at_work), and other processes by a heartbeat on the waiting rows.
    heartbeat_s = settings.FORKYARD_STUCK_AFTER_S / 4
    last_beat = time.monotonic()
    with at_work(row.pk for row in rows), ThreadPoolExecutor(min(PARALLEL, max(1, len(rows)))) as pool:
        pending = {pool.submit(_create, host, row, missing): row for row in rows}
        batch: list[tuple[Sandbox, dict[str, Any]]] = []
        batch_opened = 0.0
        while pending:
            if time.monotonic() - last_beat >= heartbeat_s:
                _heartbeat([row.pk for row in pending.values()])
                last_beat = time.monotonic()
            left = BATCH_WAIT_S - (time.monotonic() - batch_opened) if batch else heartbeat_s
            done, _ = wait(pending, timeout=max(0.0, left), return_when=FIRST_COMPLETED)
            for future in done:
                row = pending.pop(future)
                outcome, record = future.result()
                if outcome != "started":
                    counts[outcome] += 1
                    continue
                if not batch:
                    batch_opened = time.monotonic()
                batch.append((row, record))
            if batch and (len(batch) >= BATCH or not pending or time.monotonic() - batch_opened >= BATCH_WAIT_S):
                started = record_started(host, batch)
                counts["running"] += len(started.running) + len(started.recorded_before)
                counts["destroyed"] += len(started.to_destroy)
                batch = []
    settle_launches(rows + unmade)
    return counts


def _ended_unmade(host: Host, sandbox_ids: list[str]) -> list[Sandbox]:
    """Rows torn down between their claim and now (``stopping``, no engine sandbox), that no create
    of this process is at: nobody will make them, so they end now, destroyed, instead of waiting
    for a create that never comes. A create elsewhere that does come back finds its row ended and
    destroys what it made (``transitions.sandboxes_started``)."""
    unmade = [
        row
        for row in Sandbox.objects.filter(pk__in=sandbox_ids, host=host, state=Sandbox.State.STOPPING, engine_id="")
        if not is_at_work(row.pk)
    ]
    transitions.sandboxes_destroyed([(row, None) for row in unmade])
    return unmade


def settle_launches(rows: Iterable[Sandbox]) -> None:
    for launch_id in sorted({row.launch_id for row in rows if row.launch_id}):
        launch = Launch.objects.filter(pk=launch_id).first()
        if launch is not None:
            transitions.launch_settled(launch)


async def start_directly(sandbox: Sandbox) -> Sandbox:
    """The API's fast path for one create: the web server asks the host's engine itself (as it does
    for exec), skipping the broker and the worker's pickup.

    The engine's create is idempotent on the sandbox's id, and every outcome
    is recorded as ``bring_up`` records it. If the engine cannot be reached,
    the command goes to the host's lane after all, and if the broker refuses
    it too, the sandbox fails now (``broker_unavailable``) rather than start
    later behind its caller's back. If the outcome cannot be recorded, the
    engine's sandbox is destroyed before the error goes on: a replay of the
    create (reconciliation's) then gets the engine's tombstone, never a
    sandbox its caller was told failed. If this process dies half way, the
    row stays ``creating`` and reconciliation finishes it (the engine answers
    the replay with the same sandbox).
    """
    assert sandbox.host is not None
    host = sandbox.host
    try:
        async with engine_link.async_pool(host.engine_socket).client() as client:
            record = await client.create(**create_args(sandbox))
    except engine_errors.Unavailable:
        try:
            await db(commands.ensure_running)(host, [sandbox.pk], interactive=True)
        except Exception as error:  # whatever the broker raised, the command is not queued
            await db(transitions.sandbox_failed)(sandbox, code="broker_unavailable", message="the command could not be queued")
            raise Unavailable("broker_unavailable", "the task broker is unavailable; try again shortly") from error
        return sandbox
    except engine_errors.EngineError as error:
        await db(transitions.sandbox_failed)(sandbox, code=error.code, message=error.message)
        return await db(Sandbox.objects.select_related("host").get)(pk=sandbox.pk)

    def record_outcome() -> Sandbox:
        if record["state"] != "running":
            transitions.sandbox_ended(sandbox, Sandbox.State.DESTROYED, at=transitions.engine_time(record, "ended_at"))
        else:
            record_started(host, [(sandbox, record)])
        return Sandbox.objects.select_related("host").get(pk=sandbox.pk)

    try:
        return await db(transaction.atomic(record_outcome))()
    except Exception:
        if record["state"] == "running":
            try:
                async with engine_link.async_pool(host.engine_socket).client() as client:
                    await client.destroy(record["id"])
            except engine_errors.EngineError:
                pass  # gone already, or its host is down: reconciliation ends it once the row is not live
        raise
