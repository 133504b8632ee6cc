"""Writes about exposed ports: expose one (or change how it is reached), close one.

A row says a sandbox's port may be reached at its preview URL and how
(``ExposedPort.Auth``); the bytes go through ``sandboxes/api/preview.py`` and
the engine (``sandboxes/engine/ports.py``).  Rows go with their sandbox
(``transitions.sandbox_ended``, ``transitions.sandboxes_destroyed``).
"""

from __future__ import annotations

from django.db import IntegrityError, transaction

from console.errors import OverLimit
from console.models import Team

from ..models import ExposedPort, Sandbox
from ..selectors import require_started

MAX_PORTS = 32  # per sandbox


def port_expose(*, team: Team, sandbox: Sandbox, port: int, auth: str) -> ExposedPort:
    """Expose ``port``.  Again: a new row in place of the old one (its ``auth`` replaced, and the
    tokens signed for the old one, which name it, refused from now on)."""
    require_started(sandbox, "expose a port")
    try:
        with transaction.atomic():
            ExposedPort.objects.filter(sandbox=sandbox, port=port).delete()
            if ExposedPort.objects.filter(sandbox=sandbox).count() >= MAX_PORTS:
                raise OverLimit("too_many_ports", f"a sandbox exposes at most {MAX_PORTS} ports; close one first")
            return ExposedPort.objects.create(team=team, sandbox=sandbox, port=port, auth=auth)
    except IntegrityError:  # exposed at the same moment by another request: that one stands
        return ExposedPort.objects.get(sandbox=sandbox, port=port)


def port_close(*, row: ExposedPort) -> None:
    row.delete()
