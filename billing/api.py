"""GET /api/v1/usage: what the team used and what it costs."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.http import HttpRequest
from django.utils import timezone
from ninja import Router, Schema

from console.api_base import key_of
from console.db import db
from console.errors import ApiError

from .selectors import usage

router = Router(tags=["usage"])


class UsageLine(Schema):
    group: str
    seconds: float
    amount: str
    periods: int


class UsageOut(Schema):
    start: datetime
    end: datetime
    group_by: str
    currency: str
    total: str
    lines: list[UsageLine]


class ErrorOut(Schema):
    error: dict[str, Any]


@router.get(
    "/usage", response={200: UsageOut, 400: ErrorOut, 401: ErrorOut, 429: ErrorOut, 503: ErrorOut}, summary="Usage and cost"
)
async def get_usage(
    request: HttpRequest, start: datetime | None = None, end: datetime | None = None, group_by: str = "size"
) -> dict[str, Any]:
    """Sandbox-seconds and cost in [start, end) (default: the last 24 hours), grouped by
    `size`, `key`, `day` or `label:<key>`. Amounts are decimal strings in USD."""
    key = key_of(request)
    end = end or timezone.now()
    start = start or end - timedelta(days=1)
    if start >= end:
        raise ApiError("invalid_request", "start must be before end", field="start")
    if group_by not in ("size", "key", "day", "all") and not group_by.startswith("label:"):
        raise ApiError("invalid_request", "group_by is size, key, day, all or label:<key>", field="group_by")
    return await db(usage)(key.team, start, end, group_by)
