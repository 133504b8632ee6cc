"""Leases whose heartbeats stopped: the host agent expires them and destroys what they held.

Every pass (``reconcile``), on every host: leases whose grace has run out
move ``active -> expired`` (any agent may: the move is a conditional
update, so of several agents exactly one makes it), then everything named
with a lease that is over, expired or ended, is taken down through the
normal destroy path: a launch torn down, and each live sandbox of this host
destroy-requested (``transitions``) and handed to this host's lane
(``commands.ensure_gone``).  It repeats until nothing of an over lease is
alive, so a sandbox whose create raced its lease's end goes at the next pass.
"""

from __future__ import annotations

from .. import commands, transitions
from ..models import Host


def expire_leases(host: Host) -> int:
    """Expire the leases whose grace ran out; destroy what over leases hold on this host. How many sandboxes it asked to stop."""
    transitions.leases_expired()
    destroying = transitions.over_leases_taken_down(host=host)
    commands.ensure_gone_on_hosts(destroying.stopping)
    return destroying.count
