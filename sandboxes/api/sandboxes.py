"""``/sandboxes``: create, list, get, relabel, destroy (one, or all of a label or a launch), pause and resume."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from django.conf import settings
from django.http import HttpRequest
from ninja import Router
from ninja.params.functions import Query  # what ninja.Query(...) calls; ninja.Query itself is typed as Annotated[T, ...]

from console.api_base import BUDGETED, ERRORS, key_of
from console.audit import Actor
from console.db import db
from console.errors import NotFound, Unavailable
from sandboxes.engine.errors import EngineError

from .. import engine_link, notify, selectors
from ..models import Sandbox
from ..schemas import SandboxCreate, SandboxesKilled, SandboxList, SandboxOut, SandboxPatch
from ..services import sandboxes as services
from ..worker import take_down
from ..worker.bring_up import start_directly
from .answers import access_of, page_out, sandbox_out

log = logging.getLogger("forkyard.api")
router = Router(tags=["sandboxes"])
SETTLED = {Sandbox.State.RUNNING, Sandbox.State.FAILED, Sandbox.State.DESTROYED, Sandbox.State.STOPPED}
GONE = set(Sandbox.ENDED)


@router.post("/sandboxes", response={200: SandboxOut, 201: SandboxOut, 202: SandboxOut, **BUDGETED}, summary="Create a sandbox")
async def create_sandbox(request: HttpRequest, payload: SandboxCreate) -> tuple[int, dict[str, Any]]:
    """Create one sandbox from a template or a snapshot.

    With `wait` (the default) the answer comes once it runs: 201, or 200 for a
    retry with the same `idempotency_key`. If it is still starting after a
    while, or `wait` is false: 202, and its state says where it is.
    """
    key = key_of(request)
    sandbox, created = await db(services.sandbox_create)(team=key.team, key=key, spec=payload, direct=payload.wait)
    try:
        if created and sandbox.state == Sandbox.State.CREATING:
            # Shielded: a caller that hangs up does not cut the engine's create short. It completes and
            # is recorded now (visible, and what a retry with its key gets), not adopted a minute later.
            sandbox = await asyncio.shield(start_directly(sandbox))
        if payload.wait and sandbox.state not in SETTLED:
            sandbox = await notify.wait_until(sandbox.id, SETTLED, settings.FORKYARD_CREATE_WAIT_S)
    except Exception:
        # The caller gets an error: what it asked for must not start behind its back later.
        if created:
            await _abandon(sandbox)
        raise
    if sandbox.state == Sandbox.State.FAILED and sandbox.error_code == "template_not_found":
        # Deleted on its host after it was admitted (before the host's heartbeat said so): the template is
        # what is missing, not a host.
        raise NotFound(
            "template_not_found", f"no template {sandbox.template!r}", field="template", details={"sandbox": sandbox.id}
        )
    if sandbox.state == Sandbox.State.FAILED and sandbox.error_code and not sandbox.ready_at:
        # The same answer for the first call and for a retry with its key.
        # The host could not start it (bad input was refused before this point).
        raise Unavailable(
            sandbox.error_code or "create_failed",
            sandbox.error_message or "the sandbox failed to start",
            details={"sandbox": sandbox.id},
        )
    status = 201 if created else 200
    if sandbox.state in (Sandbox.State.QUEUED, Sandbox.State.CREATING):
        status = 202
    return status, sandbox_out(sandbox, access_of(request))


async def _abandon(sandbox: Sandbox) -> None:
    """A create whose caller is answered with an error: destroyed, whatever stage it reached (best effort:
    if the database is what failed, the engine's record of the destroy decides any replay)."""
    try:
        await db(services.sandbox_destroy)(sandbox=sandbox)
    except Exception as error:  # noqa: BLE001 - the caller's own error is the one to answer
        log.warning("could not destroy %s after its create failed: %r", sandbox.pk, error)


@router.get("/sandboxes", response={200: SandboxList, **ERRORS}, summary="List sandboxes")
async def list_sandboxes(
    request: HttpRequest,
    state: str | None = None,
    label: str | None = Query(None, description="key:value, key=value or key"),
    limit: int = Query(100, ge=1, le=1000),
    cursor: str | None = None,
) -> dict[str, Any]:
    """Newest first; pass `next_cursor` as `cursor` for the next page."""
    key = key_of(request)
    page = await db(selectors.sandboxes_page)(
        key.team, state=state, label=label, cursor=cursor, limit=limit, labels=key.label_limit
    )
    access = access_of(request)
    return page_out("sandboxes", page, lambda row: sandbox_out(row, access))


@router.delete("/sandboxes", response={200: SandboxesKilled, **ERRORS}, summary="Destroy sandboxes by label or launch")
async def destroy_sandboxes(
    request: HttpRequest,
    label: str | None = Query(None, description="key:value, key=value or key: every live sandbox with this label"),
    launch: str | None = Query(None, description="a launch id: the launch torn down, every sandbox of it"),
) -> dict[str, Any]:
    """Destroy every live sandbox of the team with a label, or of a launch, in one call; how many were
    asked to stop. Give exactly one of `label` or `launch`: a DELETE naming neither is refused
    (400 `filter_required`), so that nothing kills every sandbox by accident. Their hosts destroy
    them; follow them with `GET /sandboxes?label=...`."""
    killed = await db(services.sandboxes_destroy)(team=key_of(request).team, label=label, launch=launch, actor=Actor.of(request))
    take_down.take_down_in_background(killed.hosts)
    return {"count": killed.count, "stopping": killed.stopping, "destroyed": killed.destroyed}


@router.get("/sandboxes/{sandbox_id}", response={200: SandboxOut, **ERRORS}, summary="Get a sandbox")
async def get_sandbox(request: HttpRequest, sandbox_id: str) -> dict[str, Any]:
    return sandbox_out(await db(selectors.sandbox_for)(key_of(request).team, sandbox_id), access_of(request))


@router.patch(
    "/sandboxes/{sandbox_id}", response={200: SandboxOut, **ERRORS}, summary="Change a sandbox's labels, expiry or idle timeout"
)
async def update_sandbox(request: HttpRequest, sandbox_id: str, payload: SandboxPatch) -> dict[str, Any]:
    """`labels` replaces the sandbox's labels whole (checked as a create's are; a launch's member keeps
    its `launch` label). Lists, kills and batches by label see the new ones at once; usage by label
    counts each billed period under the labels it opened with.

    `ttl_s` (from now) or `expires_at` moves its expiry, earlier or later, within the team's maximum TTL
    counted from when it was ready (`400 ttl_over_maximum`) and its host's; `idle_timeout_s` sets how long
    it may go without an exec or a file call before it is destroyed (0: never). Both only for a running or
    paused sandbox (`409 sandbox_not_running`); its host's engine keeps the time, and the answer shows it."""
    sandbox = await db(selectors.sandbox_for)(key_of(request).team, sandbox_id)
    if payload.ttl_s is not None or payload.expires_at is not None or payload.idle_timeout_s is not None:
        sandbox = await db(services.sandbox_lifetime_set)(
            sandbox=sandbox, ttl_s=payload.ttl_s, expires_at=payload.expires_at, idle_timeout_s=payload.idle_timeout_s
        )
    if payload.labels is not None:
        sandbox = await db(services.sandbox_labels_set)(sandbox=sandbox, labels=payload.labels)
    return sandbox_out(sandbox, access_of(request))


@router.delete("/sandboxes/{sandbox_id}", response={200: SandboxOut, 202: SandboxOut, **ERRORS}, summary="Destroy a sandbox")
async def destroy_sandbox(request: HttpRequest, sandbox_id: str, wait: bool = True) -> tuple[int, dict[str, Any]]:
    sandbox = await db(selectors.sandbox_for)(key_of(request).team, sandbox_id)
    sandbox = await db(services.sandbox_destroy)(sandbox=sandbox)
    if wait and sandbox.state not in GONE:
        sandbox = await notify.wait_until(sandbox.id, GONE, settings.FORKYARD_CREATE_WAIT_S)
    return (200 if sandbox.state in GONE else 202), sandbox_out(sandbox)


async def _pause(request: HttpRequest, sandbox_id: str, paused: bool) -> dict[str, Any]:
    """The engine first (straight to the owning host, like exec), then the row and its billing."""
    sandbox = await db(selectors.started_sandbox_for)(key_of(request).team_id, sandbox_id)
    assert sandbox.host is not None  # a started sandbox has a host
    if not paused:
        await db(services.sandbox_resume_allowed)(sandbox=sandbox)
    try:
        async with engine_link.async_pool(sandbox.host.engine_socket).client() as client:
            await client.call("pause" if paused else "resume", id=sandbox.engine_id)
    except EngineError as error:
        raise engine_link.refusal(error) from None
    return sandbox_out(await db(services.sandbox_pause_recorded)(sandbox_id=sandbox.id, paused=paused), access_of(request))


@router.post("/sandboxes/{sandbox_id}/pause", response={200: SandboxOut, **ERRORS}, summary="Pause a sandbox")
async def pause(request: HttpRequest, sandbox_id: str) -> dict[str, Any]:
    """Freeze every process in it. Paused time is billed at the paused rate."""
    return await _pause(request, sandbox_id, paused=True)


@router.post("/sandboxes/{sandbox_id}/resume", response={200: SandboxOut, **BUDGETED}, summary="Resume a paused sandbox")
async def resume(request: HttpRequest, sandbox_id: str) -> dict[str, Any]:
    """Refused (402) while a budget the sandbox counts against is spent."""
    return await _pause(request, sandbox_id, paused=False)
