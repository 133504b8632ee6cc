"""Writes about launches: start one (many sandboxes in one call), tear one down.

A launch is recorded at once; its sandboxes are made by the dispatcher
(``worker.dispatch``), in chunks on hosts with room.  A teardown wins over
anything still in flight (see ``transitions``).
"""

from __future__ import annotations

import logging

from django.db import transaction

from console.audit import Act, Actor, audit_record
from console.errors import InvalidRequest, Unavailable, invalid
from console.models import ApiKey, Team
from console.permissions import labels_for_create
from console.sealing import seal
from console.selectors import limits_of

from .. import commands, placement, transitions
from ..models import Launch
from ..schemas import SandboxCreate
from .admission import admit
from .idempotency import insert_once, replay_of

log = logging.getLogger("forkyard.launches")


def launch_create(
    *,
    team: Team,
    key: ApiKey | None,
    spec: SandboxCreate,
    count: int,
    memory_group_size: int = 1,
    memory_group_cpu: str = "each",
    actor: Actor | None = None,
) -> tuple[Launch, bool]:
    """Record a launch of ``count`` sandboxes and queue its dispatch; (launch, created).

    The sandboxes' environment travels with the dispatch command, sealed
    (``console.sealing``), not in the launch's row: it may hold secrets.
    """
    limits = limits_of(team)
    if count < 1:
        raise invalid("count must be at least 1", field="count")
    if count > limits.max_launch_count:
        raise InvalidRequest(
            "launch_too_large",
            f"count is over the team's maximum of {limits.max_launch_count} per launch",
            field="count",
            details={"limit": limits.max_launch_count},
        )
    existing = replay_of(Launch, team, spec.idempotency_key)
    if existing is not None:
        return existing, False
    spec = spec.model_copy(update={"labels": labels_for_create(key, spec.labels)})
    admitted = admit(team=team, spec=spec, count=count, key=key)
    if not placement.live_hosts():
        raise Unavailable("no_capacity", "no host is online to run sandboxes")
    launch, inserted = insert_once(
        Launch,
        team=team,
        idempotency_key=spec.idempotency_key,
        before=admitted.lock,
        api_key=key,
        count=count,
        memory_group_size=memory_group_size,
        memory_group_cpu=memory_group_cpu,
        labels=spec.labels,
        **admitted.shape_fields(),
    )
    if not inserted:
        return launch, False
    audit_record(
        team=team,
        actor=actor or Actor(key=key),
        action=Act.LAUNCH_STARTED,
        target_type="launch",
        target_id=launch.pk,
        target=launch.pk,
        details={"count": count, "size": launch.size, "template": launch.template, "snapshot": launch.snapshot_id},
    )
    try:
        commands.dispatch_launch(launch.pk, seal(spec.env))
    except Exception as error:
        log.warning("could not queue the dispatch of %s: %r", launch.pk, error)
        transitions.launch_failed(launch)
        raise Unavailable("broker_unavailable", "the task broker is unavailable; try again shortly") from error
    return launch, True


@transaction.atomic
def launch_destroy(*, launch: Launch, actor: Actor | None = None) -> tuple[Launch, dict[int, list[str]]]:
    """Tear a launch down: every sandbox in it, whatever its state, and none made after. The launch
    as it is now, and its stopping members' ids by host id (the hosts' commands are queued once
    this commits; the API also takes them down directly: ``worker.take_down``)."""
    was = launch.state
    stopping = transitions.launch_teardown_requested(launch)
    launch_torn_down_recorded(launch, was, actor)
    transaction.on_commit(lambda: commands.ensure_gone_on_hosts(stopping))
    launch.refresh_from_db()
    return launch, stopping


def launch_torn_down_recorded(launch: Launch, was: str, actor: Actor | None) -> None:
    """The audit entry of a teardown asked while the launch still ran (a repeat records nothing)."""
    if was in (Launch.State.CREATING, Launch.State.READY):
        audit_record(
            team=launch.team_id, actor=actor, action=Act.LAUNCH_TORN_DOWN, target_type="launch", target_id=launch.pk,
            target=launch.pk, details={"was": was, "count": launch.count},
        )
