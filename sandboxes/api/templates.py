"""``/templates``: the root filesystems sandboxes start from (the shared ones and the team's own), and the
builds of the team's own."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from django.http import HttpRequest, StreamingHttpResponse
from ninja import Router
from ninja.params.functions import Query
from ninja.responses import NinjaJSONEncoder

from console.api_base import ERRORS, key_of
from console.db import db
from console.errors import not_found

from .. import selectors
from ..models import Template, TemplateBuild
from ..schemas import Deleted, TemplateBuildIn, TemplateBuildOut, TemplateList, TemplateOut
from ..services import templates as services
from .answers import build_out, page_out, template_out

router = Router(tags=["templates"])
LOG_POLL_S = 0.25  # how often a followed build is looked at
LOG_KEEPALIVE_S = 10.0


@router.post("/templates", response={202: TemplateBuildOut, **ERRORS}, summary="Build a template")
async def build_template(request: HttpRequest, payload: TemplateBuildIn) -> tuple[int, dict[str, Any]]:
    """Build one of the team's templates from a spec: a `base` (a template's name, or `snapshot:<id>`), then
    `steps`, each one of `apt`, `pip`, `npm` (packages), `run` (a command), `file` (a file written),
    `env`, `workdir`, `user` (what later steps and every sandbox of it get by default), then the
    `services` its sandboxes start.

    The build runs in sandboxes of the team (paid as any sandbox), under `network_policy` (by default
    none, or, when a step installs packages, the team's `package-indexes` policy: Debian's archive, PyPI,
    npm's registry). Each step's result is saved as a snapshot: a step that an earlier build of the team
    already ran from the same base with the same steps before it is not run again (`cached`), so a
    rebuild of the same spec is ready at once. Answers 202 with the build; follow it at
    `GET /templates/{name}/build`, or its output at `GET /templates/{name}/build/logs`. A rebuild keeps
    the template's last good build in use until it is ready.
    """
    key = key_of(request)
    build = await db(services.template_build_create)(team=key.team, key=key, spec=payload)
    return 202, await db(build_out)(build)


@router.get("/templates", response={200: TemplateList, **ERRORS}, summary="List templates")
async def list_templates(
    request: HttpRequest, limit: int = Query(100, ge=1, le=1000), cursor: str | None = None
) -> dict[str, Any]:
    """By name, each with the hosts that hold it; pass `next_cursor` as `cursor` for the next page."""
    page = await db(selectors.templates_page)(key_of(request).team, cursor=cursor, limit=limit)
    return await db(page_out)("templates", page, template_out)


@router.get("/templates/{name}", response={200: TemplateOut, **ERRORS}, summary="Get a template")
async def get_template(request: HttpRequest, name: str) -> dict[str, Any]:
    return await db(template_out)(await db(selectors.template_for)(key_of(request).team, name))


@router.delete("/templates/{name}", response={200: Deleted, **ERRORS}, summary="Delete a template")
async def delete_template(request: HttpRequest, name: str) -> dict[str, Any]:
    """Delete one of the team's templates. Refused with 409 `template_in_use` (details: `forks_alive`,
    `launches_starting`, `snapshots`, `builds_running`) while anything made from it lives; a public
    template is the operator's (409 `template_public`). The snapshots of its build's steps stay."""
    await db(services.template_delete)(team=key_of(request).team, name=name)
    return {"id": name, "deleted": True}


def _last_build(team: Any, name: str) -> TemplateBuild:
    template = Template.objects.filter(team=team, name=name).first()
    if template is None:
        raise not_found("template", name)
    build = selectors.last_build(template)
    if build is None:
        raise not_found("template_build", name)
    return build


@router.get("/templates/{name}/build", response={200: TemplateBuildOut, **ERRORS}, summary="A template's last build")
async def get_build(request: HttpRequest, name: str) -> dict[str, Any]:
    """Its steps (each `pending`, `cached`, `running`, `done` or `failed`, with its seconds and snapshot), and
    once failed, the step that failed, its `error` and its output's tail (`error_output`)."""
    return await db(build_out)(await db(_last_build)(key_of(request).team, name))


@router.get("/templates/{name}/build/logs", response={200: None, **ERRORS}, summary="Follow a template's build")
async def follow_build(request: HttpRequest, name: str) -> StreamingHttpResponse:
    """Newline-delimited JSON until the build ends: `{"type": "log", "text"}` with its output as it comes,
    `{"type": "build", "build"}` whenever a step moves, and last `{"type": "end", "build"}`. The output is
    kept while the build runs and two minutes after (for a follower that comes late), then cleared; a
    failed step's tail stays in the build's `error_output`."""
    build = await db(_last_build)(key_of(request).team, name)
    return StreamingHttpResponse(_follow(build.pk), content_type="application/x-ndjson")


def _line(message: dict[str, Any]) -> bytes:
    return (json.dumps(message, cls=NinjaJSONEncoder) + "\n").encode()


async def _follow(build_id: str) -> AsyncIterator[bytes]:
    sent = 0  # of the log's characters, counted from its start (the row keeps its tail)
    steps: Any = None
    quiet = 0.0
    while True:
        build = await db(TemplateBuild.objects.select_related("template").get)(pk=build_id)
        if build.log_total > sent and build.log:
            yield _line({"type": "log", "text": build.log[-min(build.log_total - sent, len(build.log)) :]})
            sent, quiet = build.log_total, 0.0
        if build.state in (TemplateBuild.State.READY, TemplateBuild.State.FAILED):
            yield _line({"type": "end", "build": await db(build_out)(build)})
            return
        if build.steps != steps or quiet >= LOG_KEEPALIVE_S:
            steps, quiet = build.steps, 0.0
            yield _line({"type": "build", "build": await db(build_out)(build)})
        await asyncio.sleep(LOG_POLL_S)
        quiet += LOG_POLL_S
