"""The console's terminal: a shell in a sandbox, typed into from its page (xterm.js in ``static/terminal.js``).

The page starts the shell with a POST (``views.sandboxes.sandbox_terminal``: the engine's
``processes.start`` with a pty, as ``POST /api/v1/sandboxes/{id}/processes`` does), then opens
``/ws/terminal/<sandbox>/<pid>/`` on the websocket server.  This consumer is the API's pty
consumer (``api/pty.py``: output as binary frames, input and resizes from the client, the exit
then a close) signed in by the console's session instead of a key: the socket keeps Channels'
session and origin check, and the member must be allowed to run sandboxes in the sandbox's team
(``console.permissions``).  Closing the page ends the shell (a terminal nobody can see would
otherwise hold one of the sandbox's 32 process places).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from console.db import db
from console.models import Membership
from console.permissions import Action, allows
from sandboxes.engine.errors import EngineError

from ..api.pty import ProcessConsumer
from ..models import Sandbox

log = logging.getLogger("forkyard.terminal")


def membership_for(user: Any, sandbox_id: str) -> Membership | None:
    """The user's membership in the team of the sandbox (the same answer for "absent" and "not yours")."""
    if not getattr(user, "is_authenticated", False):
        return None
    team_id = Sandbox.objects.filter(pk=sandbox_id, team__memberships__user=user).values_list("team_id", flat=True).first()
    if team_id is None:
        return None
    return Membership.objects.filter(team_id=team_id, user=user).first()


async def session_member(scope: Mapping[str, object], sandbox_id: str) -> Membership | tuple[int, str, str]:
    """The signed-in member of the sandbox's team, if allowed to run its sandboxes; else the refusal:
    (HTTP status, code, message). The console's sockets (this terminal, ``live_view.py``) ask this."""
    user = scope.get("user")
    if not getattr(user, "is_authenticated", False):
        return 401, "unauthorized", "sign in to the console first"
    membership = await db(membership_for)(user, sandbox_id)
    if membership is None:
        return 404, "sandbox_not_found", f"no sandbox {sandbox_id[:80]!r}"
    if not allows(membership.role, Action.RUN_SANDBOXES):
        return 403, "forbidden", f"only members can {Action.RUN_SANDBOXES.value}"
    return membership


class TerminalConsumer(ProcessConsumer):
    async def connect(self) -> None:
        await self.accept()
        route = self.scope["url_route"]["kwargs"]
        member = await session_member(self.scope, route["sandbox_id"])
        if not isinstance(member, Membership):
            await self._refuse(*member)
            return
        await self.attach(member.team_id, route["sandbox_id"], int(route["pid"]), {"stdout_offset": 0, "stderr_offset": 0})

    async def disconnect(self, code: int) -> None:
        await super().disconnect(code)
        if self.sandbox is not None and self.pid:
            try:  # the page is gone: so is its shell (and what it started in the foreground)
                await self._call("processes.signal", signal="HUP", group=True)
            except (EngineError, OSError) as error:
                log.info("terminal %s/%s: %s", self.sandbox.pk, self.pid, error)
