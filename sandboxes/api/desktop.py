"""``/sandboxes/{id}/desktop``: a desktop sandbox's screen and input, for computer-use agents.

Straight to the sandbox's engine, like exec (``data``): the engine reads the
screen from the sandbox's X server and runs its input
(``sandboxes/engine/desktop.py``). The live view is the sandbox's noVNC port
exposed with a signed URL (``services/ports.py``, served by ``api/preview.py``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.http import HttpRequest
from ninja import Router

from console.api_base import ERRORS, key_of
from console.db import db
from console.models import Team

from .. import selectors
from ..models import ExposedPort, Sandbox
from ..schemas import DesktopActionsIn, DesktopActionsOut, DesktopOut, DesktopViewIn, DesktopViewOut, ScreenshotIn, ScreenshotOut
from ..services import ports as port_services
from . import preview
from .data import _engine_call

router = Router(tags=["desktop"])
VIEW_PORTS = {"view": 6081, "control": 6080}  # the desktop environment's noVNC services (environments/desktop.json)
# Its VNC servers, which the console's own view reaches (views/live_view.py); 5901 refuses input itself (-viewonly).
VNC_PORTS = {"view": 5901, "control": 5900}
VIEW_PAGE = "vnc.html?autoconnect=1&resize=scale&reconnect=1"


@router.get("/sandboxes/{sandbox_id}/desktop", response={200: DesktopOut, **ERRORS}, summary="The desktop's screen and cursor")
async def desktop_info(request: HttpRequest, sandbox_id: str) -> Any:
    """The screen's size in pixels (what every coordinate refers to) and where the cursor is. A sandbox
    without a running desktop (one not made from the desktop environment) is `desktop_not_running` (409)."""
    return await _engine_call(request, sandbox_id, "desktop.info")


@router.post("/sandboxes/{sandbox_id}/desktop/screenshot", response={200: ScreenshotOut, **ERRORS}, summary="Take a screenshot")
async def screenshot(request: HttpRequest, sandbox_id: str, payload: ScreenshotIn) -> Any:
    """The screen as PNG (or JPEG), base64, at full size or scaled down by `scale` or to fit
    `max_width`/`max_height`. `scale` in the answer maps the image back to the screen: screen x =
    image x / scale. Read from the X server's own frame buffer: nothing runs in the sandbox for it."""
    return await _engine_call(request, sandbox_id, "desktop.screenshot", **payload.model_dump(exclude_none=True))


@router.post("/sandboxes/{sandbox_id}/desktop/actions", response={200: DesktopActionsOut, **ERRORS}, summary="Move, click, type")
async def actions(request: HttpRequest, sandbox_id: str, payload: DesktopActionsIn) -> Any:
    """Do mouse and keyboard actions in order, each once the one before it is done; the answer comes
    after the last, with the cursor's position. Every action is checked (its fields, its coordinates
    against the screen) before the first one runs."""
    items = [action.model_dump(exclude_none=True) for action in payload.actions]
    return await _engine_call(request, sandbox_id, "desktop.act", actions=items)


@router.post(
    "/sandboxes/{sandbox_id}/desktop/view", response={201: DesktopViewOut, **ERRORS}, summary="A live view of the desktop"
)
async def live_view(request: HttpRequest, sandbox_id: str, payload: DesktopViewIn) -> tuple[int, dict[str, Any]]:
    """A signed URL of the desktop in a browser (noVNC): `view` watches only (its VNC server takes no
    input), `control` takes mouse and keyboard. Its port is exposed with `token` auth (listed with the
    sandbox's ports; closing it ends the URL); the URL expires after `token_ttl_s`."""
    team = key_of(request).team
    sandbox = await db(selectors.sandbox_for)(team, sandbox_id)
    await _engine_call(request, sandbox_id, "desktop.info")  # a desktop, running: else desktop_not_running
    return 201, await db(live_view_for)(team, sandbox, payload.mode, payload.token_ttl_s, request.META.get("HTTP_HOST", ""))


def live_view_for(team: Team, sandbox: Sandbox, mode: str, token_ttl_s: int, request_host: str) -> dict[str, Any]:
    """The desktop's noVNC port for ``mode`` exposed with ``token`` auth, and its signed page URL (the
    API's live view and the console's sandbox page). The caller has checked that a desktop runs."""
    port = VIEW_PORTS[mode]
    row = port_services.port_expose(team=team, sandbox=sandbox, port=port, auth=ExposedPort.Auth.TOKEN)
    token, expires = preview.token_for(row, token_ttl_s)
    url = f"{preview.url_of(row, request_host)}{VIEW_PAGE}"
    if mode == "view":
        url += "&view_only=1"
    return {
        "mode": mode,
        "port": port,
        "url": f"{url}&{preview.TOKEN_NAME}={token}",
        "expires_at": datetime.fromtimestamp(expires, UTC),
    }
