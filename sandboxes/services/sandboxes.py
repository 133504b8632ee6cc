"""Writes about sandboxes: create one, destroy one (or all of a label or a launch), pause and resume one, relabel one.

A create is recorded ``queued`` on the host with the most room, then queued
on that host's lane; or, for the API's direct path, recorded ``creating`` for
the web server to ask the engine itself (``worker.bring_up.start_directly``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from billing.budgets import require_within
from console.audit import Actor
from console.errors import InvalidRequest, Unavailable, invalid
from console.models import ApiKey, Team
from console.permissions import labels_for_create
from console.selectors import limits_of
from sandboxes.engine.errors import EngineError

from .. import commands, engine_link, placement, selectors, transitions
from ..models import Sandbox
from ..schemas import SandboxCreate
from .admission import admit
from .idempotency import insert_once, replay_of
from .launches import launch_torn_down_recorded

log = logging.getLogger("forkyard.sandboxes")


def sandbox_create(*, team: Team, key: ApiKey | None, spec: SandboxCreate, direct: bool = False) -> tuple[Sandbox, bool]:
    """Record a sandbox and queue it on a host; (sandbox, created).

    ``key`` is the API key that asked (None: a signed-in member, from the
    console). A repeated ``idempotency_key`` returns the first sandbox and
    creates nothing: the unique constraint decides, not a check here.

    ``direct``: the caller will ask the host's engine itself, so the row is
    recorded ``creating`` and nothing is queued, when the host can take it at
    once (it holds the template or snapshot). Otherwise, or if the caller then
    fails, the host's queue does it, as for everything else.
    """
    existing = replay_of(Sandbox, team, spec.idempotency_key, related=("host",))
    if existing is not None:
        return existing, False
    spec = spec.model_copy(update={"labels": labels_for_create(key, spec.labels)})
    admitted = admit(team=team, spec=spec, key=key)
    host = placement.choose_host(
        tiers=placement.hosts_for(team=team, template=admitted.template, snapshot=admitted.snapshot),
        memory_mib=admitted.shape.memory_mib,
    )
    sandbox, inserted = insert_once(
        Sandbox,
        team=team,
        idempotency_key=spec.idempotency_key,
        before=admitted.lock,
        related=("host",),
        api_key=key,
        host=host,
        env=spec.env,
        labels=spec.labels,
        **admitted.shape_fields(),
    )
    if not inserted:
        return sandbox, False
    if direct and (admitted.snapshot is None or admitted.snapshot.hosts.filter(pk=host.pk).exists()):
        # Claimed for the caller: "creating", so no reconciliation queues it
        # meanwhile (a row stuck there is queued again after STUCK_AFTER_S).
        if transitions.sandboxes_claimed([sandbox.pk], host):
            sandbox.state = Sandbox.State.CREATING
            return sandbox, True
    queue_or_fail(sandbox, lambda: commands.ensure_running(host, [sandbox.pk], interactive=True))
    return sandbox, True


def queue_or_fail(sandbox: Sandbox, queue: Callable[[], None]) -> None:
    """Queue a sandbox's first command; if the broker refuses, the sandbox fails now
    rather than start later behind the caller's back."""
    try:
        queue()
    except Exception as error:
        # Whatever the broker raised (its own errors, or an OSError from the
        # embedded one's directory), the command is not queued.
        log.warning("could not queue a command for %s: %r", sandbox.pk, error)
        transitions.sandbox_failed(sandbox, code="broker_unavailable", message="the command could not be queued")
        raise Unavailable("broker_unavailable", "the task broker is unavailable; try again shortly") from error


def sandbox_destroy(*, sandbox: Sandbox) -> Sandbox:
    """Ask for a sandbox to be gone (its host's worker destroys it); idempotent."""
    sandbox = transitions.sandbox_destroy_requested(sandbox)
    host = sandbox.host
    if sandbox.state == Sandbox.State.STOPPING and host is not None:
        transaction.on_commit(lambda: commands.ensure_gone(host, [sandbox.pk]))
    return sandbox


@dataclass(frozen=True)
class Killed:
    """What a kill by label or launch asked: how many sandboxes their hosts now destroy, how many were gone at once."""

    stopping: int
    destroyed: int  # still queued: they never reached a host
    hosts: dict[int, list[str]] = field(default_factory=dict)  # the stopping ones' ids by host id, for the direct path

    @property
    def count(self) -> int:
        return self.stopping + self.destroyed


def sandboxes_destroy(
    *, team: Team, label: str | None = None, launch: str | None = None, actor: Actor | None = None
) -> Killed:
    """Destroy every live sandbox of the team with a label, or of a launch (then the launch is torn
    down: it makes no more).  With neither, nothing: ``filter_required``, so that no one kills
    everything by accident."""
    if label is None and launch is None:
        raise InvalidRequest(
            "filter_required", "name the sandboxes to destroy: ?label=key:value or ?launch=<launch id>", field="label"
        )
    if label is not None and launch is not None:
        raise invalid("name the sandboxes to destroy by label or by launch, not both", field="launch")
    with transaction.atomic():
        if launch is not None:
            found = selectors.launch_for(team, launch, field="launch")
            before = selectors.member_states(found)
            was = found.state
            stopping = transitions.launch_teardown_requested(found)
            launch_torn_down_recorded(found, was, actor)
            states = (Sandbox.State.CREATING, *Sandbox.STARTED)
            killed = Killed(
                stopping=sum(before.get(state, 0) for state in states),
                destroyed=before.get(Sandbox.State.QUEUED, 0),
                hosts=stopping,
            )
        else:
            rows = selectors.with_label(Sandbox.objects.filter(team=team, state__in=Sandbox.LIVE), label or "")
            destroying = transitions.sandboxes_destroy_requested(list(rows.values_list("pk", flat=True)))
            stopping = destroying.stopping
            killed = Killed(
                stopping=destroying.count - len(destroying.destroyed), destroyed=len(destroying.destroyed), hosts=stopping
            )
        transaction.on_commit(lambda: commands.ensure_gone_on_hosts(stopping))
    return killed


def sandbox_labels_set(*, sandbox: Sandbox, labels: dict[str, str]) -> Sandbox:
    """Replace a sandbox's labels (already validated, ``schemas``).  A launch's member keeps its ``launch``
    label, which names its launch.  Billing takes labels as they are when each period opens."""
    if sandbox.launch_id:
        labels = {**labels, "launch": sandbox.launch_id}
    Sandbox.objects.filter(pk=sandbox.pk).update(labels=labels, updated_at=timezone.now())
    return selectors.sandbox_for(sandbox.team, sandbox.pk)


def sandbox_lifetime_set(
    *, sandbox: Sandbox, ttl_s: int | None = None, expires_at: datetime | None = None, idle_timeout_s: int | None = None
) -> Sandbox:
    """Move a started sandbox's expiry (``ttl_s`` from now, or ``expires_at``) and/or set its idle timeout: its
    engine first (whose timers decide), then the row, from the engine's answer. Its lifetime (ready to expiry)
    stays within the team's maximum TTL (``ttl_over_maximum``), and the engine bounds it by its own."""
    if ttl_s is None and expires_at is None and idle_timeout_s is None:
        return sandbox
    selectors.require_started(sandbox, "change its lifetime")
    assert sandbox.host is not None  # a started sandbox has a host
    now = timezone.now()
    if ttl_s is not None or expires_at is not None:
        wanted = expires_at if expires_at is not None else now + timedelta(seconds=ttl_s or 0)
        if wanted <= now:
            raise invalid("expires_at is in the past", field="expires_at")
        maximum = limits_of(sandbox.team).max_ttl_s
        lifetime = (wanted - (sandbox.ready_at or sandbox.created_at)).total_seconds()
        if lifetime > maximum:
            raise InvalidRequest(
                "ttl_over_maximum",
                f"that would make its lifetime {int(lifetime)} s, over the team's maximum TTL of {maximum} s",
                field="ttl_s" if ttl_s is not None else "expires_at",
                details={"max_ttl_s": maximum},
            )
    args: dict[str, Any] = {}
    if ttl_s is not None:
        args["ttl_s"] = ttl_s
    elif expires_at is not None:
        args["expires_at"] = expires_at.timestamp()
    if idle_timeout_s is not None:
        args["idle_timeout_s"] = idle_timeout_s
    try:
        record = engine_link.engine(sandbox.host.engine_socket).call("update", id=sandbox.engine_id, **args)
    except EngineError as error:
        raise engine_link.refusal(error, sandbox) from None
    engine_expiry = transitions.engine_time(record, "expires_at")
    fields: dict[str, Any] = {"idle_timeout_s": record.get("idle_timeout_s", 0), "updated_at": timezone.now()}
    if engine_expiry is not None:
        fields["expires_at"] = engine_expiry
        fields["ttl_s"] = max(1, round((engine_expiry - (sandbox.ready_at or sandbox.created_at)).total_seconds()))
    Sandbox.objects.filter(pk=sandbox.pk).update(**fields)
    return selectors.sandbox_for(sandbox.team, sandbox.pk)


def sandbox_pause(*, sandbox: Sandbox, paused: bool) -> Sandbox:
    """Pause (or resume) a sandbox from a thread that may block (a console view): the engine, then the row.

    The API does the same with its async engine pool, then ``sandbox_pause_recorded``.
    """
    selectors.require_started(sandbox)
    assert sandbox.host is not None  # a started sandbox has a host
    if not paused:
        sandbox_resume_allowed(sandbox=sandbox)
    try:
        engine_link.engine(sandbox.host.engine_socket).call("pause" if paused else "resume", id=sandbox.engine_id)
    except EngineError as error:
        raise engine_link.refusal(error) from None
    return sandbox_pause_recorded(sandbox_id=sandbox.pk, paused=paused)


def sandbox_resume_allowed(*, sandbox: Sandbox) -> None:
    """A paused sandbox resumes only while every budget it counts against has money left (402 otherwise)."""
    require_within(team=sandbox.team_id, key_id=sandbox.api_key_id, labels=sandbox.labels)


def sandbox_pause_recorded(*, sandbox_id: str, paused: bool) -> Sandbox:
    """After its engine paused (or resumed) it: the row and its billing follow."""
    transitions.sandbox_pause_recorded(sandbox_id, paused=paused)
    return Sandbox.objects.select_related("host").get(pk=sandbox_id)
