"""``/leases``: sandboxes that live only while their client does (it heartbeats; when it stops, they go)."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja import Router
from ninja.params.functions import Query

from console.api_base import ERRORS, key_of
from console.db import db

from .. import selectors
from ..schemas import LeaseIn, LeaseList, LeaseOut
from ..services import leases as services
from .answers import lease_out, page_out

router = Router(tags=["leases"])


@router.post("/leases", response={201: LeaseOut, **ERRORS}, summary="Take a lease")
async def create_lease(request: HttpRequest, payload: LeaseIn) -> tuple[int, dict[str, Any]]:
    """A lease for sandboxes that should live only while their client does. Name it (`lease`) when
    creating sandboxes or launches, and heartbeat it (`POST /leases/{id}/heartbeat`) more often than
    every `grace_s` (every `grace_s / 3` leaves room for a late one): once no heartbeat has come for
    `grace_s` it expires, and every sandbox and launch named with it is destroyed. Ending it
    (`DELETE`) does the same at once."""
    key = key_of(request)
    return 201, lease_out(await db(services.lease_create)(team=key.team, key=key, grace_s=payload.grace_s))


@router.get("/leases", response={200: LeaseList, **ERRORS}, summary="List leases")
async def list_leases(
    request: HttpRequest, state: str | None = None, limit: int = Query(100, ge=1, le=1000), cursor: str | None = None
) -> dict[str, Any]:
    """Newest first; pass `next_cursor` as `cursor` for the next page."""
    key = key_of(request)
    mine = key.pk if key.label_limit else None  # a label-limited key sees its own leases only
    page = await db(selectors.leases_page)(key.team, state=state, cursor=cursor, limit=limit, key_id=mine)
    return page_out("leases", page, lease_out)


@router.get("/leases/{lease_id}", response={200: LeaseOut, **ERRORS}, summary="Get a lease")
async def get_lease(request: HttpRequest, lease_id: str) -> dict[str, Any]:
    return lease_out(await db(selectors.lease_for)(key_of(request).team, lease_id))


@router.post("/leases/{lease_id}/heartbeat", response={200: LeaseOut, **ERRORS}, summary="Keep a lease alive")
async def heartbeat_lease(request: HttpRequest, lease_id: str) -> dict[str, Any]:
    """Moves its expiry `grace_s` from now. A lease that expired (or was ended) cannot be revived:
    409 `lease_expired` (or `lease_ended`); its sandboxes are gone or going."""
    lease = await db(selectors.lease_for)(key_of(request).team, lease_id)
    return lease_out(await db(services.lease_heartbeat)(lease=lease))


@router.delete("/leases/{lease_id}", response={200: LeaseOut, **ERRORS}, summary="End a lease")
async def end_lease(request: HttpRequest, lease_id: str) -> dict[str, Any]:
    """Its client is done: every sandbox and launch named with it is destroyed now. Idempotent."""
    lease = await db(selectors.lease_for)(key_of(request).team, lease_id)
    return lease_out(await db(services.lease_end)(lease=lease))
