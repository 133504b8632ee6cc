"""Writes about snapshots: take one, delete one.

A snapshot is taken by the engine of the host that runs its source sandbox:
the row is recorded ``creating`` and ``ensure_snapshot_saved`` queued on that
host's lane; the worker asks the engine and records the outcome
(``worker.snapshots``).  In the engine a snapshot is a template named by the
row's id, so forking it is an ordinary create naming it.

An uploaded image (an OCI archive, a ``docker save`` or a root filesystem's
tarball) becomes a snapshot too, of no parent and no source sandbox: the API
streams it to one host's engine (``templates.upload``), which imports it
under the row's id; from then on it is forked, built on (``snapshot:<id>``),
copied to other hosts and deleted as any snapshot is.

Deleting follows one rule: refused (``snapshot_in_use``) while any live
sandbox was forked from it or a launch from it is still starting; otherwise
the row is ``deleted`` and its saved-state billing closes at once, and each
host that holds it forgets it.  Child snapshots do not hold a parent: the
engine keeps the layers they share for as long as anything uses them.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction
from django.utils import timezone

from console.errors import Conflict, Unavailable
from console.models import ApiKey, Team
from console.permissions import labels_for_create

from .. import commands, placement, selectors, transitions
from ..models import Host, Sandbox, Snapshot
from ..models import snapshot_id as new_snapshot_id
from .idempotency import insert_once, replay_of

log = logging.getLogger("forkyard.snapshots")


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
    existing = replay_of(Snapshot, team, idempotency_key)
    if existing is not None:
        return existing, False
    selectors.require_started(sandbox, doing="be snapshotted")
    labels = labels_for_create(key, labels)
    host = sandbox.host
    assert host is not None  # a started sandbox has a host
    snapshot, inserted = insert_once(
        Snapshot,
        team=team,
        idempotency_key=idempotency_key,
        api_key=key,
        name=name,
        labels=labels,
        source_sandbox=sandbox,
        # A fork of a snapshot, snapshotted again: the new layer sits on that one.
        parent_id=sandbox.snapshot_id,
        template=sandbox.template,
        host=host,
        services=services,
    )
    if not inserted:
        return snapshot, False
    try:
        commands.ensure_snapshot_saved(host, snapshot.pk)
    except Exception as error:
        # Whatever the broker raised, the command is not queued: fail now rather than later behind the caller's back.
        log.warning("could not queue snapshot %s: %r", snapshot.pk, error)
        transitions.snapshot_failed(snapshot, code="broker_unavailable", message="the command could not be queued")
        raise Unavailable("broker_unavailable", "the task broker is unavailable; try again shortly") from error
    snapshot.refresh_from_db()
    return snapshot, True


def image_begin(*, team: Team, key: ApiKey | None, name: str, labels: dict[str, str]) -> tuple[Snapshot, Host]:
    """An uploaded image's snapshot, recorded ``creating`` on the live host that takes the upload (the one
    with the most free memory: any host can, and forks elsewhere get it copied as any snapshot's are).
    Its root is itself (``template`` is its own id): it has no parent and no source sandbox."""
    hosts = placement.live_hosts()
    if not hosts:
        raise Unavailable("no_host", "no host is up to take the image; try again shortly")
    host = max(hosts, key=lambda row: (row.memory_mib or 0, row.name))
    snapshot_id = new_snapshot_id()
    snapshot = Snapshot.objects.create(
        id=snapshot_id,
        team=team,
        api_key=key,
        name=name,
        labels=labels_for_create(key, labels),
        template=snapshot_id,
        host=host,
    )
    return snapshot, host


def image_touched(snapshot: Snapshot) -> None:
    """An upload still arriving: not stuck (``worker.snapshots.requeue_stuck_snapshots``)."""
    Snapshot.objects.filter(pk=snapshot.pk, state=Snapshot.State.CREATING).update(updated_at=timezone.now())


def image_ended(snapshot: Snapshot, host: Host, *, record: dict[str, Any] | None, code: str = "", message: str = "") -> Snapshot:
    """The engine's answer to an upload: ready (its record), or failed with the error's code and message."""
    if record is not None:
        transitions.snapshot_ready(snapshot, host, record=record)
    else:
        transitions.snapshot_failed(snapshot, code=code, message=message)
    snapshot.refresh_from_db()
    return snapshot


def snapshot_delete(*, snapshot: Snapshot) -> Snapshot:
    """Delete a snapshot nothing uses; ``snapshot_in_use`` otherwise.  Idempotent."""
    with transaction.atomic():
        # Creates and launches from a snapshot lock its row too (``selectors.ready_snapshot_locked``),
        # so a fork cannot slip in between this count and the delete.
        locked = Snapshot.objects.select_for_update().get(pk=snapshot.pk)
        if locked.state == Snapshot.State.DELETED:
            return locked
        users = selectors.snapshot_users(locked)
        if any(users.values()):
            raise Conflict(
                "snapshot_in_use",
                f"snapshot {locked.pk} is in use by {users['forks_alive']} live sandboxes, "
                f"{users['launches_starting']} starting launches and {users['templates']} templates: "
                "destroy or delete them first",
                details=users,
            )
        transitions.snapshot_deleted(locked)
        hosts = set(locked.hosts.all())
        if locked.host is not None:
            hosts.add(locked.host)

        def queue() -> None:
            for host in hosts:
                try:
                    commands.ensure_snapshot_gone(host, locked.pk)
                except Exception as error:  # noqa: BLE001 - the host agent's sweep forgets it later
                    log.warning("could not queue forgetting %s on %s: %r", locked.pk, host.name, error)

        transaction.on_commit(queue)
    locked.refresh_from_db()
    return locked
