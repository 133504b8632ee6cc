"""The public API's account endpoints: who am I, and API keys."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.http import HttpRequest
from ninja import Router, Schema
from pydantic import Field

from console.db import db

from .api_base import key_of
from .errors import ApiError, not_found
from .keys import api_key_create, api_key_revoke
from .models import ApiKey, Role

router = Router(tags=["account"])


class ErrorOut(Schema):
    error: dict[str, Any]


ERRORS: dict[int, Any] = {400: ErrorOut, 401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 429: ErrorOut, 503: ErrorOut}


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
    limits: LimitsOut


class KeyOut(Schema):
    id: str
    name: str
    prefix: str
    role: str
    created_at: datetime
    last_used_at: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None


class KeyCreate(Schema):
    name: str = Field(..., min_length=1, max_length=100)
    role: str = Field(Role.MEMBER, description="member: sandboxes only; admin: also manages keys")
    expires_at: datetime | None = None


class KeyCreated(KeyOut):
    secret: str = Field(..., description="shown once: store it now")


def _key_out(key: ApiKey) -> dict[str, Any]:
    return {
        "id": key.id,
        "name": key.name,
        "prefix": key.prefix,
        "role": key.role,
        "created_at": key.created_at,
        "last_used_at": key.last_used_at,
        "expires_at": key.expires_at,
        "revoked_at": key.revoked_at,
    }


def _require_admin(key: ApiKey) -> None:
    if key.role not in (Role.ADMIN, Role.OWNER):
        raise ApiError("forbidden", "this key's role cannot manage keys: use an admin key", status=403)


@router.get("/me", response={200: WhoAmI, **ERRORS}, summary="The calling key, its team and its limits")
async def whoami(request: HttpRequest) -> dict[str, Any]:
    key = key_of(request)
    limits = key.team.limits
    return {
        "team": key.team_id,
        "team_name": key.team.name,
        "key": key.id,
        "key_name": key.name,
        "role": key.role,
        "limits": {
            "requests_per_second": limits.requests_per_second,
            "max_sandboxes": limits.max_sandboxes,
            "max_launch_count": limits.max_launch_count,
            "max_ttl_s": limits.max_ttl_s,
        },
    }


@router.get("/keys", response={200: list[KeyOut], **ERRORS}, summary="List the team's API keys")
async def list_keys(request: HttpRequest) -> list[dict[str, Any]]:
    team = key_of(request).team
    return await db(lambda: [_key_out(key) for key in ApiKey.objects.filter(team=team).order_by("-created_at")])()


@router.post("/keys", response={201: KeyCreated, **ERRORS}, summary="Create an API key (its secret is shown once)")
async def create_key(request: HttpRequest, payload: KeyCreate) -> tuple[int, dict[str, Any]]:
    caller = key_of(request)
    _require_admin(caller)
    if payload.role not in Role.values:
        raise ApiError("invalid_request", f"role must be one of {', '.join(Role.values)}", field="role")
    if payload.role == Role.OWNER:
        raise ApiError("invalid_request", "keys cannot be owners", field="role")
    new = await db(api_key_create)(team=caller.team, name=payload.name, role=payload.role, expires_at=payload.expires_at)
    return 201, {**_key_out(new.key), "secret": new.secret}


@router.delete("/keys/{key_id}", response={200: KeyOut, **ERRORS}, summary="Revoke an API key")
async def revoke_key(request: HttpRequest, key_id: str) -> dict[str, Any]:
    caller = key_of(request)
    _require_admin(caller)

    def act() -> dict[str, Any]:
        key = ApiKey.objects.filter(team=caller.team, pk=key_id).first()
        if key is None:
            raise not_found("key", key_id)
        return _key_out(api_key_revoke(key=key))

    return await db(act)()
