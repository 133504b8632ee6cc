"""Writes about leases: take one, keep it alive (a heartbeat), end it.

A lease ties sandboxes to a client that is still there.  A create or a
launch may name an active lease; its client heartbeats it at least once per
``grace_s``.  When the heartbeats stop for that long, the host agents'
reconciliation marks it expired and destroys everything named with it
(``worker.leases``); a client that ends its lease has the same done at once.
An expired or ended lease stays over: a heartbeat cannot revive it, and
nothing new may name it.
"""

from __future__ import annotations

from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from console.models import ApiKey, Team

from .. import commands, selectors, transitions
from ..models import Lease


def lease_create(*, team: Team, key: ApiKey | None, grace_s: int) -> Lease:
    """A new active lease, which expires ``grace_s`` seconds from now unless a heartbeat comes first."""
    now = timezone.now()
    lease = Lease.objects.create(
        team=team, api_key=key, grace_s=grace_s, created_at=now, heartbeat_at=now, expires_at=now + timedelta(seconds=grace_s)
    )
    return selectors.lease_for(team, lease.pk)


def _take_down(lease: Lease) -> None:
    """Everything named with the (over) lease: torn down, its hosts told once this commits."""
    with transaction.atomic():
        destroying = transitions.over_leases_taken_down(lease=lease)
        transaction.on_commit(lambda: commands.ensure_gone_on_hosts(destroying.stopping))


def lease_heartbeat(*, lease: Lease) -> Lease:
    """Keep an active lease alive for another ``grace_s``.  One whose grace ran out before this
    heartbeat came expires now (its sandboxes go), and the heartbeat is refused (``lease_expired``);
    one that was ended is refused (``lease_ended``)."""
    if not transitions.lease_renewed(lease):
        transitions.leases_expired([lease.pk])
        _take_down(lease)
        selectors.active_lease(selectors.lease_for(lease.team, lease.pk))  # raises what it is now
    return selectors.lease_for(lease.team, lease.pk)


def lease_end(*, lease: Lease) -> Lease:
    """End a lease (its client is done): every sandbox and launch named with it is destroyed.  Idempotent:
    ending one that is already over only makes sure of that."""
    transitions.lease_ended(lease)
    _take_down(lease)
    return selectors.lease_for(lease.team, lease.pk)
