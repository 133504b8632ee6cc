"""``/templates``: the root filesystems sandboxes start from (the shared ones and the team's own)."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja import Router
from ninja.params.functions import Query

from console.api_base import ERRORS, key_of
from console.db import db

from .. import selectors
from ..schemas import TemplateList, TemplateOut
from .answers import page_out, template_out

router = Router(tags=["templates"])


@router.get("/templates", response={200: TemplateList, **ERRORS}, summary="List templates")
async def list_templates(
    request: HttpRequest, limit: int = Query(100, ge=1, le=1000), cursor: str | None = None
) -> dict[str, Any]:
    """By name, each with the hosts that hold it; pass `next_cursor` as `cursor` for the next page."""
    page = await db(selectors.templates_page)(key_of(request).team, cursor=cursor, limit=limit)
    return await db(page_out)("templates", page, template_out)


@router.get("/templates/{name}", response={200: TemplateOut, **ERRORS}, summary="Get a template")
async def get_template(request: HttpRequest, name: str) -> dict[str, Any]:
    return template_out(await db(selectors.template_for)(key_of(request).team, name))
