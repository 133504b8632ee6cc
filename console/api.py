"""The public API's account endpoints: who am I, and API keys."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.http import HttpRequest
from ninja import Router, Schema
from ninja.params.functions import Query
from pydantic import ConfigDict, Field

from console.db import db

from . import selectors
from .api_base import ERRORS, QueryTime, key_of
from .audit import Actor, audit_page
from .errors import Forbidden, invalid
from .keys import api_key_create, api_key_delete, api_key_rename, api_key_revoke, api_key_rotate
from .models import ApiKey, AuditEntry, Role
from .permissions import Access, Resource, parse_label_limit, parse_scopes, scope_allows
from .selectors import limits_of

router = Router(tags=["account"])


class LimitsOut(Schema):
    requests_per_second: int
    max_sandboxes: int
    max_launch_count: int
    max_ttl_s: int


class WhoAmI(Schema):
    team: str
    team_name: str
    key: str
    key_name: str
    role: str
    scopes: list[str]
    label_limit: dict[str, str]
    limits: LimitsOut


class KeyOut(Schema):
    id: str
    name: str
    prefix: str
    role: str
    scopes: list[str] = Field(description="the resources it may use (`<resource>` or `<resource>:read`); empty: all its role allows")
    label_limit: dict[str, str] = Field(description="only sandboxes, launches and snapshots with these labels; empty: any")
    created_at: datetime
    last_used_at: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None
    rotated_at: datetime | None


class KeyList(Schema):
    keys: list[KeyOut]
    next_cursor: str | None


class KeyCreate(Schema):
    model_config = ConfigDict(extra="forbid")  # a field it does not name is an error, never ignored

    name: str = Field(..., min_length=1, max_length=100)
    role: str = Field(Role.MEMBER, description="member: sandboxes only; admin: also manages keys")
    expires_at: datetime | None = None
    scopes: list[str] = Field(
        default_factory=list,
        max_length=32,
        description=f"narrower than its role: any of {', '.join(resource.value for resource in Resource)} or `*`, "
        "each optionally `:read` (e.g. `[\"sandboxes\", \"launches\"]`, `[\"*:read\"]`, `[\"inference\"]`); empty: all",
    )
    label_limit: dict[str, str] = Field(
        default_factory=dict, description="only objects carrying these labels; its creates are given them"
    )


class KeyPatch(Schema):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., min_length=1, max_length=100)


class KeyCreated(KeyOut):
    secret: str = Field(..., description="shown once: store it now")


class AuditEntryOut(Schema):
    id: str
    at: datetime
    action: str
    actor: str = Field(description="who: `user <name>`, `key <name> (<id>)`, or `forkyard`")
    actor_key: str | None
    target_type: str
    target_id: str
    target: str
    details: dict[str, Any]
    address: str


class AuditList(Schema):
    entries: list[AuditEntryOut]
    next_cursor: str | None


def _key_out(key: ApiKey) -> dict[str, Any]:
    return {
        "id": key.id,
        "name": key.name,
        "prefix": key.prefix,
        "role": key.role,
        "scopes": list(key.scopes or []),
        "label_limit": dict(key.label_limit or {}),
        "created_at": key.created_at,
        "last_used_at": key.last_used_at,
        "expires_at": key.expires_at,
        "revoked_at": key.revoked_at,
        "rotated_at": key.rotated_at,
    }


@router.get("/me", response={200: WhoAmI, **ERRORS}, summary="The calling key, its team and its limits")
async def whoami(request: HttpRequest) -> dict[str, Any]:
    key = key_of(request)
    limits = limits_of(key.team)
    return {
        "team": key.team_id,
        "team_name": key.team.name,
        "key": key.id,
        "key_name": key.name,
        "role": key.role,
        "scopes": list(key.scopes or []),
        "label_limit": dict(key.label_limit or {}),
        "limits": {
            "requests_per_second": limits.requests_per_second,
            "max_sandboxes": limits.max_sandboxes,
            "max_launch_count": limits.max_launch_count,
            "max_ttl_s": limits.max_ttl_s,
        },
    }


@router.get("/keys", response={200: KeyList, **ERRORS}, summary="List the team's API keys")
async def list_keys(request: HttpRequest, limit: int = Query(100, ge=1, le=1000), cursor: str | None = None) -> dict[str, Any]:
    """Newest first; pass `next_cursor` as `cursor` for the next page."""
    page = await db(selectors.keys_page)(key_of(request).team, cursor=cursor, limit=limit)
    return {"keys": [_key_out(key) for key in page.rows], "next_cursor": page.next_cursor}


def _no_wider_than(caller: ApiKey, scopes: list[str], label_limit: dict[str, str]) -> None:
    """A key makes no key that may do more than itself: every scope within its own, its label limit kept."""
    own = list(caller.scopes or [])
    if own:
        if not scopes:
            raise Forbidden("out_of_scope", "a scoped key makes only keys scoped within its own scopes", field="scopes")
        for scope in scopes:
            name, _, access = scope.partition(":")
            resources = list(Resource) if name == "*" else [Resource(name)]
            wanted = Access.READ if access == "read" else Access.WRITE
            if not all(scope_allows(own, resource, wanted) for resource in resources):
                raise Forbidden("out_of_scope", f"this key cannot grant {scope!r}: it is beyond its own scopes", field="scopes")
    for name, value in (caller.label_limit or {}).items():
        if label_limit.get(name) != value:
            raise Forbidden("out_of_scope", f"a key limited to {name}={value} makes keys limited to it too", field="label_limit")


@router.post("/keys", response={201: KeyCreated, **ERRORS}, summary="Create an API key (its secret is shown once)")
async def create_key(request: HttpRequest, payload: KeyCreate) -> tuple[int, dict[str, Any]]:
    """Needs an admin key; a scoped key makes keys within its own scopes only."""
    caller = key_of(request)
    if payload.role not in Role.values:
        raise invalid(f"role must be one of {', '.join(Role.values)}", field="role")
    if payload.role == Role.OWNER:
        raise invalid("keys cannot be owners", field="role")
    scopes, label_limit = parse_scopes(payload.scopes), parse_label_limit(payload.label_limit)
    _no_wider_than(caller, scopes, label_limit)
    new = await db(api_key_create)(
        team=caller.team,
        name=payload.name,
        role=payload.role,
        expires_at=payload.expires_at,
        scopes=scopes,
        label_limit=label_limit,
        actor=Actor.of(request),
    )
    return 201, {**_key_out(new.key), "secret": new.secret}


@router.patch("/keys/{key_id}", response={200: KeyOut, **ERRORS}, summary="Rename an API key")
async def rename_key(request: HttpRequest, key_id: str, payload: KeyPatch) -> dict[str, Any]:
    key = await db(selectors.key_for)(key_of(request).team, key_id)
    return _key_out(await db(api_key_rename)(key=key, name=payload.name, actor=Actor.of(request)))


@router.post("/keys/{key_id}/rotate", response={200: KeyCreated, **ERRORS}, summary="Rotate an API key's secret")
async def rotate_key(request: HttpRequest, key_id: str) -> dict[str, Any]:
    """The same key (id, name, role, scopes, usage) with a new secret, shown once; the old secret stops working now."""
    key = await db(selectors.key_for)(key_of(request).team, key_id)
    new = await db(api_key_rotate)(key=key, actor=Actor.of(request))
    return {**_key_out(new.key), "secret": new.secret}


@router.delete("/keys/{key_id}", response={200: KeyOut, **ERRORS}, summary="Revoke an API key (or delete it)")
async def revoke_key(
    request: HttpRequest, key_id: str, delete: bool = Query(False, description="remove it for good, not only revoke it")
) -> dict[str, Any]:
    """Revoked: it no longer authenticates and stays listed. With `delete=true` it is gone from the list too
    (what it was used for stays in usage, as a deleted key's)."""
    key = await db(selectors.key_for)(key_of(request).team, key_id)
    if delete:
        return _key_out(await db(api_key_delete)(key=key, actor=Actor.of(request)))
    return _key_out(await db(api_key_revoke)(key=key, actor=Actor.of(request)))


def _entry_out(entry: AuditEntry) -> dict[str, Any]:
    return {
        "id": entry.id,
        "at": entry.at,
        "action": entry.action,
        "actor": entry.actor,
        "actor_key": entry.actor_key_id,
        "target_type": entry.target_type,
        "target_id": entry.target_id,
        "target": entry.target,
        "details": entry.details,
        "address": entry.address,
    }


@router.get("/audit", response={200: AuditList, **ERRORS}, summary="The team's audit log (admin keys)")
async def audit_log(
    request: HttpRequest,
    action: str | None = Query(None, description="an action (`key.created`) or a family (`key`)"),
    actor: str | None = Query(None, description="part of who acted: a username, a key's name or id"),
    target: str | None = Query(None, description="an object's id, or part of its name"),
    since: QueryTime | None = None,
    until: QueryTime | None = None,
    limit: int = Query(100, ge=1, le=1000),
    cursor: str | None = None,
) -> dict[str, Any]:
    """Who (a member or a key) did what to which object, when and from where; newest first."""
    page = await db(audit_page)(
        key_of(request).team, cursor=cursor, limit=limit, action=action, actor=actor, target=target, since=since, until=until
    )
    return {"entries": [_entry_out(entry) for entry in page.rows], "next_cursor": page.next_cursor}
