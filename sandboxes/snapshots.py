"""Writes about snapshots: take one (API, then the owning host's worker), delete one, keep the record honest.

A snapshot is taken by the engine of the host that runs its source sandbox:
the API records the row (``creating``) and queues ``ensure_snapshot_saved``
on that host's queue; the worker asks the engine (``snapshots.create``, named
by the row's id, idempotent) and records the outcome.  In the engine a
snapshot is a template, so forking it is an ordinary create naming it.

Deleting follows one rule: refused (409 ``snapshot_in_use``) while any live
sandbox was forked from it or a launch from it is still starting; otherwise
the row is ``deleted`` and its saved-state billing closes at once, and each
host that holds it forgets it (``ensure_snapshot_gone``).  Child snapshots do
not hold a parent: the engine keeps the layers they share for as long as
anything uses them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import timedelta
from decimal import Decimal
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from billing.services import saved_state_transition
from console.errors import ApiError, unavailable
from console.models import ApiKey, Team
from sandboxes.engine import errors as engine_errors

from .engine_link import engine
from .models import Host, Launch, Sandbox, Snapshot

log = logging.getLogger("forkyard.snapshots")
GIB = Decimal(2**30)
GIB_QUANTUM = Decimal("0.000001")  # UsagePeriod.quantity_gib keeps six places
# A snapshot still "creating" this long after its worker last touched it lost
# its command (a worker or broker died): it is queued again.  Longer than the
# sandbox threshold, because taking a large snapshot is slow, not stuck.
STUCK_AFTER = timedelta(minutes=2)


def gib_of(size_bytes: int) -> Decimal:
    return (Decimal(size_bytes) / GIB).quantize(GIB_QUANTUM)


# --- the API's side -------------------------------------------------------------------


def _enqueue_take(host: Host, snapshot_id: str) -> None:
    from .tasks import ensure_snapshot_saved

    ensure_snapshot_saved.apply_async(args=(host.name, snapshot_id), queue=host.queue, expires=600)


def _enqueue_forget(host: Host, snapshot_id: str) -> None:
    from .tasks import ensure_snapshot_gone

    ensure_snapshot_gone.apply_async(args=(host.name, snapshot_id), queue=host.queue, expires=3600)


def snapshot_create(
    *,
    team: Team,
    key: ApiKey | None,
    sandbox: Sandbox,
    name: str,
    labels: dict[str, str],
    services: list[dict[str, Any]],
    idempotency_key: str | None = None,
) -> tuple[Snapshot, bool]:
    """Record a snapshot of a running or paused sandbox and queue it on the sandbox's host; (snapshot, created).

    ``services`` are already validated (``schemas.ServiceIn``). A repeated
    ``idempotency_key`` returns the first snapshot (a unique constraint decides).
    """
    if idempotency_key:
        existing = Snapshot.objects.filter(team=team, idempotency_key=idempotency_key).first()
        if existing is not None:
            return existing, False
    if sandbox.state not in (Sandbox.State.RUNNING, Sandbox.State.PAUSED) or not sandbox.engine_id or sandbox.host is None:
        raise ApiError(
            "sandbox_not_running",
            f"sandbox {sandbox.id} is {sandbox.state}: only a running or paused sandbox can be snapshotted",
            status=409,
            details={"state": sandbox.state},
        )
    host = sandbox.host
    try:
        with transaction.atomic():
            snapshot = Snapshot.objects.create(
                team=team,
                api_key=key,
                name=name,
                labels=labels,
                source_sandbox=sandbox,
                # A fork of a snapshot, snapshotted again: the new layer sits on that one.
                parent_id=sandbox.snapshot_id,
                template=sandbox.template,
                host=host,
                services=services,
                idempotency_key=idempotency_key or None,
            )
    except IntegrityError:
        existing = Snapshot.objects.filter(team=team, idempotency_key=idempotency_key).first()
        if existing is None:
            raise
        return existing, False
    try:
        _enqueue_take(host, snapshot.id)
    except Exception as error:
        # Whatever the broker raised, the command is not queued: fail now rather than later behind the caller's back.
        log.warning("could not queue snapshot %s: %r", snapshot.id, error)
        _fail(snapshot, "broker_unavailable", "the command could not be queued")
        raise unavailable("the task broker is unavailable; try again shortly", code="broker_unavailable") from error
    snapshot.refresh_from_db()
    return snapshot, True


def users_of(snapshot: Snapshot) -> dict[str, int]:
    """What keeps a snapshot from being deleted: live forks, and launches from it still starting."""
    return {
        "forks_alive": Sandbox.objects.filter(snapshot=snapshot, state__in=Sandbox.LIVE).count(),
        "launches_starting": Launch.objects.filter(snapshot=snapshot, state=Launch.State.CREATING).count(),
    }


def snapshot_delete(*, snapshot: Snapshot) -> Snapshot:
    """Delete a snapshot nothing uses; 409 ``snapshot_in_use`` otherwise.  Idempotent."""
    with transaction.atomic():
        # Creates and launches from a snapshot lock its row too (``lock_ready``), so a
        # fork cannot slip in between this count and the delete.
        locked = Snapshot.objects.select_for_update().get(pk=snapshot.pk)
        if locked.state == Snapshot.State.DELETED:
            return locked
        users = users_of(locked)
        if any(users.values()):
            raise ApiError(
                "snapshot_in_use",
                f"snapshot {locked.id} is in use by {users['forks_alive']} live sandboxes and "
                f"{users['launches_starting']} starting launches: destroy them first",
                status=409,
                details=users,
            )
        now = timezone.now()
        locked.state, locked.deleted_at, locked.updated_at = Snapshot.State.DELETED, now, now
        locked.save(update_fields=["state", "deleted_at", "updated_at"])
        saved_state_transition(snapshot=locked, gib=None, at=now)
        hosts = set(locked.hosts.all())
        if locked.host is not None:
            hosts.add(locked.host)

        def enqueue() -> None:
            for host in hosts:
                try:
                    _enqueue_forget(host, locked.id)
                except Exception as error:  # noqa: BLE001 - the host agent's sweep forgets it later
                    log.warning("could not queue forgetting %s on %s: %r", locked.id, host.name, error)

        transaction.on_commit(enqueue)
    return locked


def lock_ready(snapshot: Snapshot | None) -> None:
    """Inside a create's transaction: the snapshot is still ready, and stays so until it commits."""
    if snapshot is None:
        return
    if not Snapshot.objects.select_for_update().filter(pk=snapshot.pk, state=Snapshot.State.READY).exists():
        raise ApiError("snapshot_not_found", f"no ready snapshot {snapshot.id!r}", status=404, field="snapshot")


# --- the host's worker ----------------------------------------------------------------


def _fail(snapshot: Snapshot, code: str, message: str) -> None:
    Snapshot.objects.filter(pk=snapshot.pk, state=Snapshot.State.CREATING).update(
        state=Snapshot.State.FAILED, error_code=code[:64], error=message[:255], updated_at=timezone.now()
    )


def _engine_forget(host: Host, snapshot_id: str) -> bool:
    try:
        engine(host.engine_socket).call("templates.delete", name=snapshot_id)
    except engine_errors.TemplateNotFound:
        pass
    except engine_errors.Unavailable:
        raise
    except engine_errors.EngineError as error:
        log.warning("engine of %s would not forget snapshot %s: %s", host.name, snapshot_id, error)
        return False
    return True


def snapshot_take(host: Host, snapshot_id: str) -> str:
    """Ensure a ``creating`` snapshot is taken by this host's engine and recorded; returns its state.

    Safe to replay: the engine's ``snapshots.create`` is idempotent on the name
    (the row's id), and the row moves with conditional updates.
    """
    snapshot = Snapshot.objects.select_related("source_sandbox").filter(pk=snapshot_id, host=host).first()
    if snapshot is None:
        return "missing"
    if snapshot.state != Snapshot.State.CREATING:
        return snapshot.state
    Snapshot.objects.filter(pk=snapshot.pk, state=Snapshot.State.CREATING).update(updated_at=timezone.now())
    source = snapshot.source_sandbox
    if source is None or source.state not in (Sandbox.State.RUNNING, Sandbox.State.PAUSED) or not source.engine_id:
        state = source.state if source is not None else "gone"
        _fail(
            snapshot, "sandbox_not_running", f"the source sandbox is {state}: only a running or paused sandbox can be snapshotted"
        )
        return Snapshot.State.FAILED
    try:
        record = engine(host.engine_socket).call(
            "snapshots.create", sandbox=source.engine_id, name=snapshot.id, services=snapshot.services
        )
    except engine_errors.Unavailable:
        raise  # retried: the engine's create is idempotent on the name
    except engine_errors.EngineError as error:
        _fail(snapshot, error.code, error.message)
        return Snapshot.State.FAILED
    now = timezone.now()
    size_bytes = int(record.get("size_bytes") or 0)
    layers = record.get("layers") or [""]
    # What forks start: the engine's list, which adds those of the snapshot the sandbox came from.
    services = record.get("services") if isinstance(record.get("services"), list) else snapshot.services
    with transaction.atomic():
        moved = Snapshot.objects.filter(pk=snapshot.pk, state=Snapshot.State.CREATING).update(
            state=Snapshot.State.READY,
            layer_id=str(record.get("layer") or layers[0])[:80],
            services=services,
            size_bytes=size_bytes,
            total_bytes=int(record.get("total_bytes") or size_bytes),
            paused_ms=record.get("paused_ms"),
            ready_at=now,
            updated_at=now,
        )
        if moved:
            snapshot.refresh_from_db()
            snapshot.hosts.add(host)
            saved_state_transition(snapshot=snapshot, gib=gib_of(size_bytes), at=now)
    if moved:
        return Snapshot.State.READY
    current = Snapshot.objects.get(pk=snapshot.pk)
    if current.state == Snapshot.State.DELETED:
        _engine_forget(host, snapshot.id)  # deleted while it was being taken
    return current.state


def snapshot_forget(host: Host, snapshot_id: str) -> bool:
    """Ensure this host's engine no longer holds a deleted snapshot."""
    snapshot = Snapshot.objects.filter(pk=snapshot_id).first()
    if snapshot is None or snapshot.state != Snapshot.State.DELETED:
        return False
    if not _engine_forget(host, snapshot_id):
        return False
    snapshot.hosts.remove(host)
    return True


def sync_host(host: Host, engine_snapshots: Iterable[str]) -> dict[str, int]:
    """From the host agent: the snapshots this host's engine holds, against the rows.

    A ready row gains the host; a deleted one is forgotten by the engine (its
    ``ensure_snapshot_gone`` was lost).  An engine snapshot no row names is not
    ours to remove: it is left alone.
    """
    names = set(engine_snapshots)
    counts = {"held": 0, "forgotten": 0}
    for snapshot in Snapshot.objects.filter(pk__in=names):
        if snapshot.state == Snapshot.State.READY:
            snapshot.hosts.add(host)
            counts["held"] += 1
        elif snapshot.state == Snapshot.State.DELETED and snapshot_forget(host, snapshot.id):
            counts["forgotten"] += 1
    return counts


def requeue_stuck(host: Host) -> int:
    """Snapshots of this host still ``creating`` long after their worker last touched them: queue them again."""
    before = timezone.now() - STUCK_AFTER
    stuck = list(
        Snapshot.objects.filter(host=host, state=Snapshot.State.CREATING, updated_at__lt=before).values_list("id", flat=True)[
            :100
        ]
    )
    for snapshot_id in stuck:
        Snapshot.objects.filter(pk=snapshot_id).update(updated_at=timezone.now())
        _enqueue_take(host, snapshot_id)
    return len(stuck)
