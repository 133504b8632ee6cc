"""``/snapshots``: a sandbox's filesystem saved to fork from, listed, read and deleted."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja import Router
from ninja.params.functions import Query

from console.api_base import ERRORS, key_of
from console.db import db
from console.pagination import cursor_after

from .. import selectors
from ..models import Snapshot
from ..schemas import SnapshotCreate, SnapshotList, SnapshotOut
from ..services import snapshots as services
from .answers import page_out, snapshot_out

router = Router(tags=["snapshots"])


@router.post(
    "/sandboxes/{sandbox_id}/snapshot", response={200: SnapshotOut, 202: SnapshotOut, **ERRORS}, summary="Snapshot a sandbox"
)
async def snapshot_sandbox(request: HttpRequest, sandbox_id: str, payload: SnapshotCreate) -> tuple[int, dict[str, Any]]:
    """Save a running or paused sandbox's filesystem as a snapshot to fork from.

    Answers 202 at once with the snapshot `creating`; follow it at
    `GET /snapshots/{id}` until `ready` (or `failed`, with its `error`). The
    sandbox keeps running (a paused one stays paused); `paused_ms` says how
    long it was frozen while its layer was taken. Process memory is not
    saved: list the `services` (a command and a readiness check each) that
    every fork starts, and a fork is running only once they all answer (a
    fork whose service is not ready in its `timeout_s` fails with
    `service_not_ready`). A retry with the same `idempotency_key` answers 200
    with the first snapshot. Saved state is billed per GiB-hour of the
    snapshot's own layer from ready to deleted.
    """
    key = key_of(request)
    sandbox = await db(selectors.sandbox_for)(key.team, sandbox_id)
    snapshot, created = await db(services.snapshot_create)(
        team=key.team,
        key=key,
        sandbox=sandbox,
        name=payload.name,
        labels=payload.labels,
        services=[service.as_engine() for service in payload.services],
        idempotency_key=payload.idempotency_key,
    )
    return (202 if created else 200), await db(snapshot_out)(snapshot)


@router.get("/snapshots", response={200: SnapshotList, **ERRORS}, summary="List snapshots")
async def list_snapshots(
    request: HttpRequest,
    state: str | None = None,
    label: str | None = Query(None, description="key=value or key"),
    limit: int = Query(100, ge=1, le=1000),
    cursor: str | None = None,
    before: str | None = Query(None, description="deprecated: a snapshot id, to list older ones (use `cursor`)"),
) -> dict[str, Any]:
    """The team's snapshots, newest first (deleted ones are not listed); pass `next_cursor` as `cursor` for the next page."""
    key = key_of(request)
    team = key.team
    if before and not cursor:
        cursor = await db(cursor_after)(Snapshot.objects.filter(team=team), before, "snapshot")
    page = await db(selectors.snapshots_page)(team, state=state, label=label, cursor=cursor, limit=limit, labels=key.label_limit)
    return page_out("snapshots", page, snapshot_out)


@router.get("/snapshots/{snapshot_id}", response={200: SnapshotOut, **ERRORS}, summary="Get a snapshot")
async def get_snapshot(request: HttpRequest, snapshot_id: str) -> dict[str, Any]:
    return snapshot_out(await db(selectors.snapshot_for)(key_of(request).team, snapshot_id))


@router.delete("/snapshots/{snapshot_id}", response={200: SnapshotOut, **ERRORS}, summary="Delete a snapshot")
async def delete_snapshot(request: HttpRequest, snapshot_id: str) -> dict[str, Any]:
    """Delete a snapshot nothing uses any more.

    Refused with 409 `snapshot_in_use` (details: `forks_alive`,
    `launches_starting`) while a live sandbox was forked from it or a launch
    from it is still starting: destroy them first. Otherwise it is deleted at
    once: its saved-state billing ends now, new forks are refused, and its
    hosts forget it. Snapshots taken from its forks stay usable (they keep
    the layers they share with it). Answers the snapshot, `deleted`.
    """
    snapshot = await db(selectors.snapshot_for)(key_of(request).team, snapshot_id)
    return await db(snapshot_out)(await db(services.snapshot_delete)(snapshot=snapshot))
