"""The console's live view of a desktop: noVNC on the sandbox's page, its VNC carried over the console's websocket.

The sandbox page's desktop panel draws the screen with noVNC's client, which the console serves
itself (``static/vendor/novnc``, from Debian's package; ``static/desktop.js``): no page, script or
style from inside the sandbox reaches the member's browser, only the VNC protocol's bytes, which
noVNC parses.  The page opens ``/ws/desktop/<sandbox>/<mode>/`` on the websocket server; this
consumer signs the member in by the session (Channels' session and origin check, as the terminal's
socket), asks that the member may run the team's sandboxes (the API's ``POST .../desktop/view``
asks the same), and relays the socket's binary frames to the desktop's VNC server in the sandbox
(the engine's ``ports.connect``, as ``api/port_tunnel.py`` does for the API): 5901 for ``view``,
a server started ``-viewonly`` that drops input itself, 5900 for ``control``.  Nothing is exposed
and no signed URL is made: the socket lives as long as the page.
"""

from __future__ import annotations

from console.models import Membership

from ..api.desktop import VNC_PORTS
from ..api.port_tunnel import PortTunnelConsumer
from ..api.pty import CLOSE_CODES
from .terminal import session_member


class LiveViewConsumer(PortTunnelConsumer):
    async def connect(self) -> None:
        await self.accept()
        route = self.scope["url_route"]["kwargs"]
        member = await session_member(self.scope, route["sandbox_id"])
        if not isinstance(member, Membership):
            status, code, message = member
            await self._refuse(CLOSE_CODES[status], code, message)
            return
        port = VNC_PORTS.get(route["mode"])
        if port is None:
            await self._refuse(4400, "invalid_request", f"mode is one of {', '.join(VNC_PORTS)}")
            return
        sandbox = await self.started_sandbox(member.team_id, route["sandbox_id"])
        if sandbox is not None:
            await self.relay(sandbox, port)
