"""Where sandboxes go: the live hosts that can run them, and which has the most room.

A host is live while its agent's heartbeat is fresh (``FORKYARD_HOST_STALE_S``)
and an operator has not drained it.  Its room for sandboxes of one memory
limit is the smaller of two counts:

* sandboxes: what its engine may hold (``max_sandboxes``, or fewer if the
  host's kernel limits allow fewer: its preflight's ``fits``), less what it
  holds (as its engine last reported) and what is on its way to it;
* memory: its memory less a reserve (``FORKYARD_HOST_MEMORY_RESERVE_MIB``),
  less what it holds and what is on its way, over what one costs: the
  kernel's memory per sandbox that no limit charges (its engine's measure,
  ``sandbox_overhead_kib``) plus the sandbox's memory limit over
  ``FORKYARD_MEMORY_OVERCOMMIT`` (a limit is a ceiling; only idle memory lets
  32,752 tiny sandboxes, 4 TiB of limits, share a 24 GiB host).

``rooms`` answers both for each host: now, and were it empty (what the fleet
could ever hold, for admission's ``beyond_capacity``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db.models import Count, Q, Sum
from django.utils import timezone

from console.errors import Unavailable
from console.models import Team

from .models import Host, Sandbox, Snapshot, Template


def live_hosts() -> list[Host]:
    fresh = timezone.now() - timedelta(seconds=settings.FORKYARD_HOST_STALE_S)
    return list(Host.objects.filter(state=Host.State.ONLINE, last_heartbeat__gte=fresh))


def hosts_for(*, team: Team, template: str, snapshot: Snapshot | None = None) -> list[list[Host]]:
    """The live hosts that can run it, in tiers of preference.

    A template runs only on the hosts that hold it (those whose engines
    reported it; any live host if none has yet). A fork runs anywhere, but a
    host without its snapshot first gets it copied (seconds for a big one), so
    the hosts holding it come first.
    """
    hosts = live_hosts()
    if snapshot is not None:
        with_snapshot = set(snapshot.hosts.values_list("pk", flat=True))
        return [[host for host in hosts if host.pk in with_snapshot], [host for host in hosts if host.pk not in with_snapshot]]
    templates = Template.objects.filter(Q(team__isnull=True) | Q(team=team), name=template)
    holding = set(templates.exclude(hosts=None).values_list("hosts", flat=True))
    return [[host for host in hosts if host.pk in holding] if holding else hosts]


def largest_shape() -> tuple[float, int] | None:
    """The most vCPUs and memory any live host has (each may be a different host); None if no host has said."""
    hosts = [host for host in live_hosts() if host.cpus and host.memory_mib]  # 0: not reported yet
    if not hosts:
        return None
    return max(float(host.cpus) for host in hosts), max(int(host.memory_mib) for host in hosts)


MEBIBYTE_KIB = 1024


@dataclass(frozen=True)
class Room:
    """How many more sandboxes of one memory limit a host can take: now, and were it empty."""

    host: Host
    now: int
    empty: int


def _overcommit() -> float:
    ratio = float(settings.FORKYARD_MEMORY_OVERCOMMIT)
    if ratio <= 0:
        raise ImproperlyConfigured(f"FORKYARD_MEMORY_OVERCOMMIT must be above 0, not {ratio:g}")
    return ratio


def overhead_kib(host: Host) -> int:
    """The kernel's memory per sandbox on this host: its engine's figure, or the default until it reports one."""
    return host.sandbox_overhead_kib or int(settings.FORKYARD_SANDBOX_OVERHEAD_KIB)


def sandbox_cost_kib(host: Host, memory_mib: int) -> float:
    """What one sandbox of this memory limit costs the host's memory, in KiB."""
    return overhead_kib(host) + memory_mib * MEBIBYTE_KIB / _overcommit()


def capacity_of(host: Host) -> int:
    """The most sandboxes the host may hold: its engine's maximum, or what its kernel's limits allow if fewer."""
    if host.kernel_max_sandboxes is not None:
        return min(host.max_sandboxes, host.kernel_max_sandboxes)
    return host.max_sandboxes


def _ended_since_reported(hosts: Sequence[Host]) -> dict[int, tuple[int, int]]:
    """Per host, the sandboxes (and their memory) its engine still held at its last report and that have
    ended since: without them a fleet torn down looks full until the next heartbeat, and a launch right
    behind a teardown is refused ``no_capacity`` for seconds. Read through the ``updated_at`` index."""
    if not hosts:
        return {}
    since = min(host.last_heartbeat for host in hosts)
    rows = Sandbox.objects.filter(
        host__in=list(hosts), updated_at__gt=since, ended_at__isnull=False, ready_at__isnull=False
    ).exclude(engine_id="")
    reported = {host.pk: host.last_heartbeat for host in hosts}
    gone: dict[int, tuple[int, int]] = {}
    for host_id, ended_at, ready_at, memory in rows.values_list("host_id", "ended_at", "ready_at", "memory_mib"):
        if ready_at and ended_at and ready_at <= reported[host_id] < ended_at:  # up at the report, gone now
            count, mib = gone.get(host_id, (0, 0))
            gone[host_id] = (count + 1, mib + memory)
    return gone


def rooms(hosts: Sequence[Host], memory_mib: int) -> dict[int, Room]:
    """Each host's room for sandboxes of ``memory_mib``, by host id (one query for what is on its way)."""
    pending = {
        row["host"]: (row["count"], row["memory"] or 0)
        for row in Sandbox.objects.filter(host__in=list(hosts), state__in=[Sandbox.State.QUEUED, Sandbox.State.CREATING])
        .values("host")
        .annotate(count=Count("id"), memory=Sum("memory_mib"))
        .order_by()
    }
    gone = _ended_since_reported(hosts)
    ratio = _overcommit()
    found = {}
    for host in hosts:
        coming, coming_mib = pending.get(host.pk, (0, 0))
        ended, ended_mib = gone.get(host.pk, (0, 0))
        held = max(0, host.engine_sandboxes - ended) + coming
        capacity = capacity_of(host)
        now, empty = capacity - held, capacity
        if host.memory_mib:  # 0: its engine has not said yet
            budget_kib = (host.memory_mib - settings.FORKYARD_HOST_MEMORY_RESERVE_MIB) * MEBIBYTE_KIB
            committed_mib = max(0, host.committed_memory_mib - ended_mib) + coming_mib
            used_kib = held * overhead_kib(host) + committed_mib * MEBIBYTE_KIB / ratio
            cost = sandbox_cost_kib(host, memory_mib)
            now = min(now, math.floor((budget_kib - used_kib) / cost))
            empty = min(empty, math.floor(budget_kib / cost))
        found[host.pk] = Room(host, now=max(0, now), empty=max(0, empty))
    return found


def room_of(host: Host, memory_mib: int = 0) -> int:
    """How many more sandboxes of ``memory_mib`` the host can take now."""
    return rooms([host], memory_mib)[host.pk].now


def choose_host(*, tiers: list[list[Host]], count: int = 1, memory_mib: int = 0) -> Host:
    """The host with the most room in the first tier that has room for ``count`` of ``memory_mib``."""
    if not any(tiers):
        raise Unavailable("no_capacity", "no host is online to run sandboxes")
    room = rooms([host for hosts in tiers for host in hosts], memory_mib)
    for hosts in tiers:
        best, best_room = None, 0
        for host in hosts:
            if room[host.pk].now >= count and room[host.pk].now > best_room:
                best, best_room = host, room[host.pk].now
        if best is not None:
            return best
    raise Unavailable("no_capacity", "every host is full; try again shortly", retry_after_s=10)


def spread(hosts: list[Host], chunk_sizes: list[int], memory_mib: int = 0) -> Iterator[Host]:
    """For a launch's chunks, in order: each on the host with the most room left for ``memory_mib``."""
    room = {host_id: found.now for host_id, found in rooms(hosts, memory_mib).items()}
    for size in chunk_sizes:
        host = max(hosts, key=lambda candidate: room[candidate.pk])
        room[host.pk] -= size
        yield host
