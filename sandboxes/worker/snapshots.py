"""Snapshots on a host's engine: take one (``ensure_snapshot_saved``), forget a deleted one
(``ensure_snapshot_gone``), and keep the rows in step with what the engine holds.

Taking is safe to replay: the engine's ``snapshots.create`` is idempotent on
the name (the row's id), and the row moves with a conditional update.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import timedelta

from django.db.models import F, Q
from django.utils import timezone

from sandboxes.engine import errors as engine_errors

from .. import commands, engine_link, transitions
from ..models import Host, Snapshot

log = logging.getLogger("forkyard.snapshots")
# A snapshot still "creating" this long after its worker last touched it lost
# its command (a worker or broker died): it is queued again.  Longer than the
# sandbox threshold, because taking a large snapshot is slow, not stuck.
STUCK_AFTER = timedelta(minutes=2)
# An uploaded image's row (services/snapshots.image_begin): no source sandbox, and its own root.
UPLOADS = Q(source_sandbox__isnull=True, template=F("pk"))


def _engine_forget(host: Host, snapshot_id: str) -> bool:
    try:
        engine_link.engine(host.engine_socket).call("templates.delete", name=snapshot_id)
    except engine_errors.TemplateNotFound:
        pass
    except engine_errors.Unavailable:
        raise
    except engine_errors.EngineError as error:
        log.warning("engine of %s would not forget snapshot %s: %s", host.name, snapshot_id, error)
        return False
    return True


def snapshot_take(host: Host, snapshot_id: str) -> str:
    """Ensure a ``creating`` snapshot is taken by this host's engine and recorded; its state now."""
    snapshot = Snapshot.objects.select_related("source_sandbox").filter(pk=snapshot_id, host=host).first()
    if snapshot is None:
        return "missing"
    if snapshot.state != Snapshot.State.CREATING:
        return snapshot.state
    Snapshot.objects.filter(pk=snapshot.pk, state=Snapshot.State.CREATING).update(updated_at=timezone.now())
    source = snapshot.source_sandbox
    if source is None or not source.reachable:
        state = source.state if source is not None else "gone"
        message = f"the source sandbox is {state}: only a running or paused sandbox can be snapshotted"
        transitions.snapshot_failed(snapshot, code="sandbox_not_running", message=message)
        return Snapshot.State.FAILED
    try:
        extra = {"defaults": snapshot.defaults} if snapshot.defaults else {}
        record = engine_link.engine(host.engine_socket).call(
            "snapshots.create", sandbox=source.engine_id, name=snapshot.pk, services=snapshot.services, **extra
        )
    except engine_errors.Unavailable:
        raise  # retried: the engine's create is idempotent on the name
    except engine_errors.EngineError as error:
        transitions.snapshot_failed(snapshot, code=error.code, message=error.message)
        return Snapshot.State.FAILED
    if transitions.snapshot_ready(snapshot, host, record=record):
        return Snapshot.State.READY
    current = Snapshot.objects.get(pk=snapshot.pk)
    if current.state == Snapshot.State.DELETED:
        _engine_forget(host, snapshot.pk)  # deleted while it was being taken
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
        elif snapshot.state == Snapshot.State.DELETED and snapshot_forget(host, snapshot.pk):
            counts["forgotten"] += 1
    return counts


def requeue_stuck_snapshots(host: Host) -> int:
    """Snapshots of this host still ``creating`` long after their worker last touched them: queue them again."""
    before = timezone.now() - STUCK_AFTER
    rows = Snapshot.objects.filter(host=host, state=Snapshot.State.CREATING, updated_at__lt=before)
    # An image upload is touched while it arrives: one silent this long lost its web server.
    for upload in rows.filter(UPLOADS):
        transitions.snapshot_failed(upload, code="upload_interrupted", message="the upload stopped before the image was in")
    stuck = list(rows.exclude(UPLOADS).values_list("pk", flat=True)[:100])
    for snapshot_id in stuck:
        Snapshot.objects.filter(pk=snapshot_id).update(updated_at=timezone.now())
        commands.ensure_snapshot_saved(host, snapshot_id)
    return len(stuck)
