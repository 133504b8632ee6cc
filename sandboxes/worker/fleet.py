"""The fleet's watch: a host whose heartbeat stopped is offline, and what it had not started goes to the others.

Run by every host's agent after its own host's pass (``agent.py``); the first
live host by name does the work and the others return at once, so that a
fleet of agents does not scan it many times over.  Every write is
conditional, so two agents that both think they lead (a heartbeat going
stale under one) do nothing twice.

1. An online host whose heartbeat is older than ``FORKYARD_HOST_STALE_S`` is
   offline (it is online again once its agent reports: ``heartbeat``).  Its
   engine may be dead, or its agent, or the link: from here they look alike.
2. Its sandboxes that have not started (queued, or creating with no engine
   sandbox recorded) are placed again, on the live hosts that can run them
   and have room for them now, as a launch's chunks are (``placement.spread``,
   ``transitions.sandboxes_replaced``), and queued there; the rest wait for
   room, or for the host, at the next pass.  What the lost host still had in
   flight cannot touch them any more: every transition its worker makes
   names its host.  When it comes back, the commands left on its queue find
   nothing of theirs, and a copy its engine made before it stopped is an
   orphan its own reconciliation destroys (the row names another host).
3. Its started sandboxes stay as they are while it may come back (a
   restarted engine adopts them, and its reconciliation settles the rest);
   once its heartbeat is ``FORKYARD_HOST_LOST_S`` old (drained or not) they
   end ``stopped`` (``host_lost``), billed up to its last heartbeat
   (``sandboxes_lost``).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from .. import commands, placement, transitions
from ..models import Host, Sandbox, Snapshot

log = logging.getLogger("forkyard.fleet")
S = Sandbox.State
# Rows re-placed in one pass, at most (the next pass takes the rest).
PASS_LIMIT = 20_000


def watch_fleet(agent_host: str) -> dict[str, int]:
    """One pass of the watch, if ``agent_host`` leads; what it did, by kind."""
    live = placement.live_hosts()
    if not live or min(host.name for host in live) != agent_host:
        return {}
    now = timezone.now()
    stale_before = now - timedelta(seconds=settings.FORKYARD_HOST_STALE_S)
    counts = {"offline": 0, "replaced": 0, "lost": 0}
    counts["offline"] = Host.objects.filter(state=Host.State.ONLINE, last_heartbeat__lt=stale_before).update(
        state=Host.State.OFFLINE
    )
    lost_before = now - timedelta(seconds=settings.FORKYARD_HOST_LOST_S)
    for host in Host.objects.filter(last_heartbeat__lt=stale_before).order_by("name"):
        counts["replaced"] += replace_unstarted(host)
        if host.last_heartbeat < lost_before:  # drained or not: its sandboxes are gone with it
            counts["lost"] += transitions.sandboxes_lost(host)
    if any(counts.values()):
        log.info("fleet: %s", counts)
    return counts


def replace_unstarted(lost: Host) -> int:
    """Step 2 for one host: its unstarted sandboxes on the others, as many as have room now; how many moved."""
    unstarted = Sandbox.objects.filter(host=lost, state__in=[S.QUEUED, S.CREATING], engine_id="").order_by(
        "launch_id", "launch_index", "pk"
    )
    # What placement needs to know of them: whose, from what, how much memory.
    groups: dict[tuple[str, str, str, int], list[str]] = defaultdict(list)
    for pk, team_id, template, snapshot_id, memory_mib in unstarted.values_list(
        "pk", "team_id", "template", "snapshot_id", "memory_mib"
    )[:PASS_LIMIT]:
        groups[(team_id, template, snapshot_id or "", memory_mib)].append(pk)
    moved = 0
    for (_, template, snapshot_id, memory_mib), ids in groups.items():
        moved += _replace_group(lost, ids, template=template, snapshot_id=snapshot_id, memory_mib=memory_mib)
    return moved


def _replace_group(lost: Host, ids: list[str], *, template: str, snapshot_id: str, memory_mib: int) -> int:
    """One team's sandboxes of one template (or snapshot) and memory limit, spread over the hosts with room."""
    first = Sandbox.objects.select_related("team").get(pk=ids[0])
    snapshot = Snapshot.objects.filter(pk=snapshot_id).first() if snapshot_id else None
    hosts = [
        host
        for tier in placement.hosts_for(team=first.team, template=template, snapshot=snapshot)
        for host in tier
        if host.pk != lost.pk
    ]
    if not hosts:
        return 0  # nowhere to go yet: the next pass tries again
    room = sum(found.now for found in placement.rooms(hosts, memory_mib).values())
    ids = ids[:room]
    size = settings.FORKYARD_LAUNCH_CHUNK
    chunks = [ids[start : start + size] for start in range(0, len(ids), size)]
    moved = 0
    for chunk, host in zip(chunks, placement.spread(hosts, [len(chunk) for chunk in chunks], memory_mib), strict=True):
        replaced = transitions.sandboxes_replaced(chunk, lost=lost, to=host)
        if replaced:
            commands.ensure_running(host, replaced)
            log.info("re-placed %d sandboxes of lost host %s on %s", len(replaced), lost.name, host.name)
        moved += len(replaced)
    return moved
