"""``/launches``: many sandboxes in one call (forking a snapshot N times is a launch), their progress, their teardown."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, StreamingHttpResponse
from ninja import Router
from ninja.params.functions import Query

from console.api_base import BUDGETED, ERRORS, QueryTime, key_of
from console.audit import Actor
from console.db import db
from console.pagination import cursor_after

from .. import selectors
from ..models import Launch
from ..schemas import LaunchCreate, LaunchHosts, LaunchList, LaunchOut, SandboxList
from ..services import launches as services
from ..worker import take_down
from .answers import access_of, launch_out, page_out, sandbox_out
from .arrivals import arrivals

router = Router(tags=["launches"])


@router.post("/launches", response={200: LaunchOut, 201: LaunchOut, **BUDGETED}, summary="Launch many sandboxes")
async def create_launch(request: HttpRequest, payload: LaunchCreate) -> tuple[int, dict[str, Any]]:
    """`count` sandboxes from one template or snapshot, spread over hosts in chunks.
    Follow progress at `GET /launches/{id}`; forking a snapshot N times is a launch."""
    key = key_of(request)
    launch, created = await db(services.launch_create)(
        team=key.team,
        key=key,
        spec=payload,
        count=payload.count,
        memory_group_size=payload.memory_group_size,
        memory_group_cpu=payload.memory_group_cpu,
        actor=Actor.of(request),
    )
    return (201 if created else 200), await db(launch_out)(launch)


@router.get("/launches", response={200: LaunchList, **ERRORS}, summary="List launches")
async def list_launches(
    request: HttpRequest,
    limit: int = Query(50, ge=1, le=500),
    cursor: str | None = None,
    before: str | None = Query(None, description="deprecated: a launch id, to list older ones (use `cursor`)"),
) -> dict[str, Any]:
    """Newest first; pass `next_cursor` as `cursor` for the next page."""
    key = key_of(request)
    team = key.team
    if before and not cursor:
        cursor = await db(cursor_after)(Launch.objects.filter(team=team), before, "launch")
    page = await db(selectors.launches_page)(team, cursor=cursor, limit=limit, labels=key.label_limit)
    return await db(page_out)("launches", page, launch_out)


@router.get("/launches/{launch_id}", response={200: LaunchOut, **ERRORS}, summary="A launch and its progress")
async def get_launch(request: HttpRequest, launch_id: str) -> dict[str, Any]:
    launch = await db(selectors.launch_for)(key_of(request).team, launch_id)
    return await db(launch_out)(launch)


@router.get("/launches/{launch_id}/hosts", response={200: LaunchHosts, **ERRORS}, summary="A launch's share on each host")
async def launch_hosts(request: HttpRequest, launch_id: str) -> dict[str, Any]:
    """How many of its sandboxes each host holds, by stage: where a launch was placed, and where a host
    that stopped answering had its unstarted share placed again."""
    launch = await db(selectors.launch_for)(key_of(request).team, launch_id)
    return {"hosts": await db(selectors.launch_host_shares)(launch)}


@router.get("/launches/{launch_id}/sandboxes", response={200: SandboxList, **ERRORS}, summary="A launch's sandboxes")
async def launch_sandboxes(
    request: HttpRequest,
    launch_id: str,
    state: str | None = None,
    ready_since: QueryTime | None = None,
    limit: int = Query(1000, ge=1, le=5000),
    cursor: str | None = None,
) -> dict[str, Any]:
    """In launch order; pass `next_cursor` as `cursor` for the next page. With `ready_since` (a time),
    only those that became ready at or after it, in the order they did: how a caller follows a launch
    (ask again from the last one's `ready_at`, less a moment for late writes)."""
    launch = await db(selectors.launch_for)(key_of(request).team, launch_id)
    page = await db(selectors.launch_members_page)(launch, state=state, ready_since=ready_since, cursor=cursor, limit=limit)
    access = access_of(request)
    return page_out("sandboxes", page, lambda row: sandbox_out(row, access))


@router.get("/launches/{launch_id}/arrivals", response={200: None, **ERRORS}, summary="A launch's sandboxes as they become ready")
async def launch_arrivals(request: HttpRequest, launch_id: str) -> StreamingHttpResponse:
    """Newline-delimited JSON, each member once, pushed as it becomes ready: `{"type": "sandbox",
    "sandbox": {...}}` (as `GET /sandboxes/{id}` shows it); `{"type": "progress", "launch": {...}}`
    whenever the progress moved (and every 2 s at least); once none is queued or creating, the members
    not sent yet (failed, ended), in launch order; then `{"type": "end", "launch": {...}}`. What the
    SDK's `launch.wait()` reads; a caller cut off asks again and skips the ids it has."""
    launch = await db(selectors.launch_for)(key_of(request).team, launch_id)
    return StreamingHttpResponse(arrivals(launch, access_of(request)), content_type="application/x-ndjson")


@router.delete("/launches/{launch_id}", response={200: LaunchOut, **ERRORS}, summary="Tear a launch down")
async def destroy_launch(request: HttpRequest, launch_id: str) -> dict[str, Any]:
    """Every sandbox in it stops, whatever its state, and none is made after: queued ones end at once,
    started ones are destroyed by their hosts."""
    launch = await db(selectors.launch_for)(key_of(request).team, launch_id)
    launch, stopping = await db(services.launch_destroy)(launch=launch, actor=Actor.of(request))
    take_down.take_down_in_background(stopping)
    return await db(launch_out)(launch)
