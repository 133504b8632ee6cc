"""``/network-policies``: where a team's sandboxes may connect."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja import Router
from ninja.params.functions import Query

from console.api_base import ERRORS, key_of
from console.audit import Actor
from console.db import db

from .. import selectors
from ..schemas import Deleted, NetworkPolicyIn, NetworkPolicyList, NetworkPolicyOut
from ..services import policies as services
from .answers import page_out, policy_out

router = Router(tags=["network policies"])


@router.get("/network-policies", response={200: NetworkPolicyList, **ERRORS}, summary="List network policies")
async def list_policies(
    request: HttpRequest, limit: int = Query(100, ge=1, le=1000), cursor: str | None = None
) -> dict[str, Any]:
    """By name; pass `next_cursor` as `cursor` for the next page."""
    page = await db(selectors.policies_page)(key_of(request).team, cursor=cursor, limit=limit)
    return page_out("network_policies", page, policy_out)


@router.post("/network-policies", response={201: NetworkPolicyOut, **ERRORS}, summary="Create a network policy")
async def create_policy(request: HttpRequest, payload: NetworkPolicyIn) -> tuple[int, dict[str, Any]]:
    """Needs an admin key."""
    key = key_of(request)
    egress = [rule.dict() for rule in payload.egress]
    policy = await db(services.policy_save)(
        team=key.team,
        policy=None,
        name=payload.name,
        description=payload.description,
        egress=egress,
        same_launch=payload.same_launch,
        actor=Actor.of(request),
    )
    return 201, policy_out(policy)


@router.get("/network-policies/{policy_id}", response={200: NetworkPolicyOut, **ERRORS}, summary="Get a network policy")
async def get_policy(request: HttpRequest, policy_id: str) -> dict[str, Any]:
    return policy_out(await db(selectors.policy_for)(key_of(request).team, policy_id))


@router.put("/network-policies/{policy_id}", response={200: NetworkPolicyOut, **ERRORS}, summary="Replace a network policy")
async def update_policy(request: HttpRequest, policy_id: str, payload: NetworkPolicyIn) -> dict[str, Any]:
    """Needs an admin key. The new rules apply to the policy's running and paused sandboxes before this
    answers (`applied_to`); those whose host could not take them are named in `apply_failed`."""
    team = key_of(request).team
    policy = await db(selectors.policy_for)(team, policy_id)
    egress = [rule.dict() for rule in payload.egress]
    policy = await db(services.policy_save)(
        team=team,
        policy=policy,
        name=payload.name,
        description=payload.description,
        egress=egress,
        same_launch=payload.same_launch,
        actor=Actor.of(request),
    )
    applied = await db(services.policy_apply)(policy=policy)
    return {**policy_out(policy), "applied_to": applied.sandboxes, "apply_failed": applied.failed}


@router.delete("/network-policies/{policy_id}", response={200: Deleted, **ERRORS}, summary="Delete a network policy")
async def delete_policy(request: HttpRequest, policy_id: str) -> dict[str, Any]:
    """Needs an admin key."""
    policy = await db(selectors.policy_for)(key_of(request).team, policy_id)
    await db(services.policy_delete)(policy=policy, actor=Actor.of(request))
    return {"id": policy_id, "deleted": True}
