"""``/sandboxes/{id}/ports``: a sandbox's TCP ports at preview URLs (``api/preview.py`` serves them).

Exposing, listing and closing are rows of the team's (``services/ports.py``);
waiting for a port goes straight to the sandbox's engine (``ports.wait``),
like a command.  Another team's sandbox is not found.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.http import HttpRequest
from ninja import Router

from console.api_base import ERRORS, key_of
from console.db import db

from .. import selectors
from ..models import ExposedPort
from ..schemas import Deleted, PortIn, PortList, PortOut, PortWaited, PortWaitIn
from ..services import ports as services
from . import preview
from .data import _engine_call

router = Router(tags=["ports"])
LIST_TOKEN_TTL_S = 3600


def port_out(row: ExposedPort, request: HttpRequest, token_ttl_s: int = LIST_TOKEN_TTL_S) -> dict[str, Any]:
    url = preview.url_of(row, request.META.get("HTTP_HOST", ""))
    token_url, expires_at = None, None
    if row.auth == ExposedPort.Auth.TOKEN:
        token, expires = preview.token_for(row, token_ttl_s)
        token_url, expires_at = f"{url}?{preview.TOKEN_NAME}={token}", datetime.fromtimestamp(expires, UTC)
    return {
        "id": row.id,
        "sandbox_id": row.sandbox_id,
        "port": row.port,
        "auth": row.auth,
        "url": url,
        "token_url": token_url,
        "token_expires_at": expires_at,
        "created_at": row.created_at,
    }


@router.post("/sandboxes/{sandbox_id}/ports", response={201: PortOut, **ERRORS}, summary="Expose a port at a URL")
async def expose_port(request: HttpRequest, sandbox_id: str, payload: PortIn) -> tuple[int, dict[str, Any]]:
    """Reach a TCP port of a running sandbox at its preview URL: HTTP, streamed answers and websockets,
    proxied to 127.0.0.1:`port` inside the sandbox. `auth` says who may: `key` (the team's API key in
    the `X-Forkyard-Key` header), `token` (the signed `token_url`, which expires after `token_ttl_s`;
    its first answer sets a cookie for the rest of the page's requests) or `public` (anyone).
    Exposing it again changes its `auth` (and ends its tokens). Nothing listening there yet: the URL
    answers 502 `port_not_listening`. It closes with the sandbox; at most 32 per sandbox."""
    team = key_of(request).team
    sandbox = await db(selectors.sandbox_for)(team, sandbox_id)
    row = await db(services.port_expose)(team=team, sandbox=sandbox, port=payload.port, auth=payload.auth)
    return 201, port_out(row, request, payload.token_ttl_s)


@router.get("/sandboxes/{sandbox_id}/ports", response={200: PortList, **ERRORS}, summary="List exposed ports")
async def list_ports(request: HttpRequest, sandbox_id: str) -> dict[str, Any]:
    """By port number; one page (at most 32). A `token` port comes with a fresh signed URL (an hour)."""
    sandbox = await db(selectors.sandbox_for)(key_of(request).team, sandbox_id)
    rows = await db(selectors.ports_of)(sandbox)
    return {"ports": [port_out(row, request) for row in rows], "next_cursor": None}


@router.delete("/sandboxes/{sandbox_id}/ports/{port}", response={200: Deleted, **ERRORS}, summary="Close an exposed port")
async def close_port(request: HttpRequest, sandbox_id: str, port: int) -> dict[str, Any]:
    """Its URL answers 404 `port_not_found` from now on (connections already open run on)."""
    sandbox = await db(selectors.sandbox_for)(key_of(request).team, sandbox_id)
    row = await db(selectors.port_for)(sandbox, port)
    port_id = row.id  # the row forgets it once deleted
    await db(services.port_close)(row=row)
    return {"id": port_id, "deleted": True}


@router.post(
    "/sandboxes/{sandbox_id}/ports/{port}/wait", response={200: PortWaited, **ERRORS}, summary="Wait for a port to listen"
)
async def wait_port(request: HttpRequest, sandbox_id: str, port: int, payload: PortWaitIn) -> dict[str, Any]:
    """Until something in the sandbox accepts connections on `port` (on 127.0.0.1), or `timeout_s`
    passes; answered either way (`listening`). The port need not be exposed."""
    result = await _engine_call(request, sandbox_id, "ports.wait", port=port, timeout_s=payload.timeout_s)
    return {"port": result["port"], "listening": result["listening"], "waited_s": result["waited_s"]}
