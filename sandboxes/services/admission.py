"""What a create or a launch asks for, checked before anything is recorded.

``admit`` resolves the request against the catalogue of sizes and the team's
own objects (template or snapshot, network policy), and checks it against the
team's limits (TTL, sandboxes at once) and against the hosts that could run
it (``placement.rooms``: what a sandbox of its shape really costs a host):
more than the fleet could ever hold is ``422 beyond_capacity``, more than it
has room for now ``503 no_capacity`` with ``Retry-After``, both with what
fits (``details.fits``, ``details.fits_now``), rather than a launch that fails
half way.  Everything it refuses, it refuses before a row exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from billing.budgets import admit_spend
from billing.models import Price
from billing.services import hourly_price
from console.errors import BeyondCapacity, Conflict, OverLimit, Unavailable, invalid, not_found
from console.models import ApiKey, Team
from console.selectors import limits_of

from .. import placement, selectors, sizes
from ..models import Lease, NetworkPolicy, Sandbox, Snapshot
from ..schemas import SandboxCreate


@dataclass(frozen=True)
class Admitted:
    """A create or launch request, resolved: what its sandboxes are made of."""

    template: str  # the root template (a fork's: its snapshot's)
    snapshot: Snapshot | None
    shape: sizes.Shape
    ttl_s: int
    network_policy: NetworkPolicy | None
    lease: Lease | None = None
    idle_timeout_s: int = 0

    def lock(self) -> None:
        """Inside the create's transaction: a fork's snapshot is still ready, and the lease it names still
        active, and both stay so until it commits (their deletes and expiries lock the same rows)."""
        if self.snapshot is not None:
            selectors.ready_snapshot_locked(self.snapshot.team, self.snapshot.pk)
        if self.lease is not None:
            selectors.active_lease_for(self.lease.team, self.lease.pk, lock=True)

    def shape_fields(self) -> dict[str, Any]:
        """The fields a Sandbox or a Launch row records of it."""
        return {
            "template": self.template,
            "snapshot": self.snapshot,
            "size": self.shape.size,
            "cpu": self.shape.cpu,
            "memory_mib": self.shape.memory_mib,
            "disk_mib": self.shape.disk_mib,
            "ttl_s": self.ttl_s,
            "idle_timeout_s": self.idle_timeout_s,
            "network_policy": self.network_policy,
            "lease": self.lease,
        }


def _check_fits_a_host(shape: sizes.Shape) -> None:
    """A shape larger than every host is refused now, not failed later on the host that cannot hold it."""
    largest = placement.largest_shape()
    if largest is None:
        return  # no host yet: placement says so
    max_cpu, max_memory_mib = largest
    if shape.cpu > max_cpu or shape.memory_mib > max_memory_mib:
        raise BeyondCapacity(
            "size_too_large",
            f"no host can hold {shape.cpu:g} vCPU and {shape.memory_mib} MiB: the largest has {max_cpu:g} vCPU and {max_memory_mib} MiB",
            field="cpu" if shape.cpu > max_cpu else "memory_mib",
            details={"max_cpu": max_cpu, "max_memory_mib": max_memory_mib},
        )


# Seconds a caller refused for want of room now waits before asking again: sandboxes end by TTL, teardowns,
# and reconciliation; a host's heartbeat (FORKYARD_RECONCILE_S) reports what it has freed.
RETRY_AFTER_FULL_S = 10


def _check_fleet_room(*, team: Team, template: str, snapshot: Snapshot | None, shape: sizes.Shape, count: int) -> None:
    """``count`` sandboxes of ``shape`` fit on the hosts that could run them: ever (or 422), and now (or 503)."""
    hosts = [host for tier in placement.hosts_for(team=team, template=template, snapshot=snapshot) for host in tier]
    if not hosts:
        return  # no host online: placement says so (503 no_capacity)
    rooms = placement.rooms(hosts, shape.memory_mib).values()
    fits, fits_now = sum(room.empty for room in rooms), sum(room.now for room in rooms)
    hosted = f"{len(hosts)} host{'s' if len(hosts) != 1 else ''}"
    if count > fits:
        raise BeyondCapacity(
            "beyond_capacity",
            f"the fleet ({hosted}) could hold at most {fits:,} sandboxes of {shape.memory_mib} MiB at once, "
            f"not {count:,}: ask for fewer, or add hosts",
            field="count",
            details={"fits": fits, "count": count, "hosts": len(hosts)},
        )
    if count > fits_now:
        raise Unavailable(
            "no_capacity",
            f"only {fits_now:,} more sandboxes of {shape.memory_mib} MiB fit on the fleet now ({fits:,} once it is "
            f"empty), not {count:,}: try again once some have ended",
            retry_after_s=RETRY_AFTER_FULL_S,
            details={"fits": fits, "fits_now": fits_now, "count": count, "hosts": len(hosts)},
        )


def admit(*, team: Team, spec: SandboxCreate, count: int = 1, key: ApiKey | None = None) -> Admitted:
    """Resolve and check a request for ``count`` sandboxes by ``key`` (None: a member, from the console);
    raises what it refuses. Last, its budgets: its cost for its whole TTL must fit in every budget it
    counts against (the team's, its key's, its labels'), or it is refused with 402."""
    if bool(spec.template) == bool(spec.snapshot):
        raise invalid("give exactly one of template or snapshot", field="template")
    snapshot = None
    if spec.snapshot:
        snapshot = Snapshot.objects.filter(team=team, id=spec.snapshot, state=Snapshot.State.READY).first()
        if snapshot is None:
            raise not_found("snapshot", spec.snapshot, field="snapshot")
        template = snapshot.template
    else:
        found = selectors.template_for(team, spec.template or "", field="template")
        template = found.name
        if found.team_id is not None:
            # A team's template is the last snapshot of its build: a create from it is a fork of that.
            snapshot = found.snapshot
            if found.state != found.State.READY or snapshot is None or snapshot.state != Snapshot.State.READY:
                raise Conflict(
                    "template_not_ready",
                    f"template {found.name!r} is {found.state}: GET /templates/{found.name}/build shows its build",
                    details={"state": found.state},
                )
            template = snapshot.template
    shape = sizes.shape_of(spec.size, spec.cpu, spec.memory_mib, spec.disk_mib)
    _check_fits_a_host(shape)
    limits = limits_of(team)
    if spec.ttl_s > limits.max_ttl_s:
        raise invalid(f"ttl_s is over the team's maximum of {limits.max_ttl_s}", field="ttl_s")
    policy = None
    if spec.network_policy:
        policy = NetworkPolicy.objects.filter(team=team, id=spec.network_policy).first()
        if policy is None:
            raise not_found("network_policy", spec.network_policy, field="network_policy")
    lease = selectors.active_lease_for(team, spec.lease) if spec.lease else None
    live = Sandbox.objects.filter(team=team, state__in=Sandbox.LIVE).count()
    if live + count > limits.max_sandboxes:
        raise OverLimit(
            "sandbox_quota_exceeded",
            f"the team may run {limits.max_sandboxes} sandboxes at once and has {live}",
            retry_after_s=5,
            details={"limit": limits.max_sandboxes, "running": live},
        )
    _check_fleet_room(team=team, template=template, snapshot=snapshot, shape=shape, count=count)
    hourly = hourly_price(Price.Kind.RUNNING, shape.size, shape.cpu, shape.memory_mib, shape.disk_mib)
    admit_spend(team=team, key=key, labels=dict(spec.labels), hourly=hourly, ttl_s=spec.ttl_s, count=count)
    return Admitted(
        template=template,
        snapshot=snapshot,
        shape=shape,
        ttl_s=spec.ttl_s,
        network_policy=policy,
        lease=lease,
        idle_timeout_s=spec.idle_timeout_s,
    )
