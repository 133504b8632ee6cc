"""A snapshot to a host that lacks it, copied once from a host that holds it, before forks of it start there.

A host's engine holds a snapshot as a template named by its id.  A host that
does not hold it asks a live holder's engine for ``snapshots.export`` (only
the layers this host lacks) and streams it straight into its own
``snapshots.import``, which checks each layer against its content address.
Chunks of a launch landing on this host at once wait for the one copy (a
lock file per snapshot and host).
"""

from __future__ import annotations

import fcntl
import logging
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.utils import timezone

from sandboxes.engine import errors as engine_errors

from .. import engine_link
from ..models import Host, Sandbox, Snapshot

log = logging.getLogger("forkyard.snapshots")


class SnapshotNotOnHost(engine_errors.EngineError):
    code = "snapshot_unavailable"
    status = 503


def _holds(client: Any, snapshot: Snapshot) -> bool:
    try:
        client.call("templates.get", name=snapshot.pk)
    except engine_errors.TemplateNotFound:
        return False
    return True


def ensure_snapshot_on_host(host: Host, snapshot: Snapshot) -> None:
    """Make sure this host's engine holds ``snapshot``; ``SnapshotNotOnHost`` if no holder could send it.

    Raises ``Unavailable`` if this host's engine does not answer.
    """
    local = engine_link.engine(host.engine_socket)
    if _holds(local, snapshot):
        snapshot.hosts.add(host)
        return
    lock_path = Path(tempfile.gettempdir()) / f"forkyard-copy-{host.name}-{snapshot.pk}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _holds(local, snapshot):  # another chunk copied it while we waited
            snapshot.hosts.add(host)
            return
        have = sorted({layer for template in local.call("templates.list")["templates"] for layer in template["layers"]})
        failures = []
        fresh = timezone.now() - timedelta(seconds=settings.FORKYARD_HOST_STALE_S)
        for source in snapshot.hosts.exclude(pk=host.pk).filter(last_heartbeat__gte=fresh):
            started = time.monotonic()
            try:
                _, chunks = engine_link.engine(source.engine_socket).stream(
                    "snapshots.export", {"name": snapshot.pk, "have": have}
                )
                local.call("snapshots.import", body=chunks or [])
            except engine_errors.EngineError as error:
                failures.append(f"{source.name}: {error}")
                log.warning("copying snapshot %s from %s to %s failed: %s", snapshot.pk, source.name, host.name, error)
                continue
            snapshot.hosts.add(host)
            log.info("copied snapshot %s from %s to %s in %.2fs", snapshot.pk, source.name, host.name, time.monotonic() - started)
            return
    raise SnapshotNotOnHost(
        f"host {host.name} does not hold snapshot {snapshot.pk}, and no host that does could send it"
        + (f" ({'; '.join(failures)})" if failures else ""),
        snapshot=snapshot.pk,
        host=host.name,
    )


def snapshots_missing(host: Host, rows: list[Sandbox]) -> dict[str, engine_errors.EngineError]:
    """Ensure every snapshot these rows fork is on this host; the ones that cannot be, with why."""
    missing: dict[str, engine_errors.EngineError] = {}
    for snapshot in Snapshot.objects.filter(pk__in={row.snapshot_id for row in rows if row.snapshot_id}):
        try:
            ensure_snapshot_on_host(host, snapshot)
        except engine_errors.Unavailable:
            raise  # the whole chunk is retried
        except engine_errors.EngineError as error:
            missing[snapshot.pk] = error
    return missing
