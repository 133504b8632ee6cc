"""``/snapshots``: a sandbox's filesystem saved to fork from, listed, read and deleted."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from django.http import HttpRequest
from ninja import Router
from ninja.params.functions import Query

from console.api_base import ERRORS, key_of
from console.db import db
from console.errors import Failed
from console.pagination import cursor_after
from sandboxes.engine.errors import EngineError

from .. import engine_link, selectors
from ..engine_link import stream_call
from ..models import Snapshot
from ..schemas import SnapshotCreate, SnapshotList, SnapshotOut
from ..services import snapshots as services
from .answers import page_out, snapshot_out
from .data import body_chunks

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


@router.post("/snapshots/import", response={201: SnapshotOut, **ERRORS}, summary="Import an image as a snapshot")
async def import_image(
    request: HttpRequest,
    name: str = Query(..., min_length=1, max_length=100, description="for people; forks and builds name its id"),
    kind: Literal["auto", "oci", "tar"] = Query("auto", description="oci: an OCI or docker/podman save archive; tar: a root filesystem"),
    user: str | None = Query(None, max_length=32, description="whom its commands run as by default (else the image's User, else root)"),
) -> tuple[int, dict[str, Any]]:
    """The request body is an image archive: `podman save --format oci-archive`, `docker save`, an OCI
    image layout as a tar, or a root filesystem's tarball (at most `FORKYARD_MAX_IMAGE_BYTES`, 16 GiB by
    default). It is streamed to one host and imported there as a snapshot of the team's, its layers
    flattened into one (whiteouts applied), its `Env`, `WorkingDir` and `User` kept as its forks'
    defaults. Answers once it is in: 201 with the snapshot `ready`. Fork it (`snapshot` on a create or
    launch), or build on it (`base: "snapshot:<id>"` in `POST /templates`); other hosts get it copied
    on first use, and saved state is billed per GiB-hour as any snapshot's. An archive that is no image
    is 400 `invalid_image` (what it lacks in its message), and the snapshot `failed` with that error.
    """
    key = key_of(request)
    snapshot, host = await db(services.image_begin)(team=key.team, key=key, name=name, labels={})
    args: dict[str, Any] = {"name": snapshot.pk, "kind": kind}
    if user is not None:
        args["user"] = user
    try:
        async for event, record in stream_call(host.engine_socket, "templates.upload", args, body=_kept_alive(request, snapshot)):
            if event == "result":
                ended = await db(services.image_ended)(snapshot, host, record=record)
                return 201, await db(snapshot_out)(ended)
    except EngineError as error:
        await db(services.image_ended)(snapshot, host, record=None, code=error.code, message=error.message)
        raise engine_link.refusal(error) from None
    except BaseException:
        await db(services.image_ended)(snapshot, host, record=None, code="upload_interrupted", message="the upload stopped")
        raise
    raise Failed("internal_error", "the engine gave no answer")


async def _kept_alive(request: HttpRequest, snapshot: Snapshot) -> AsyncIterator[bytes]:
    """The body as it arrives, the snapshot touched every half minute meanwhile (it is not stuck)."""
    touched = time.monotonic()
    async for chunk in body_chunks(request):
        if time.monotonic() - touched > 30:
            touched = time.monotonic()
            await db(services.image_touched)(snapshot)
        yield chunk


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
