"""Budgets reached: what the host agent does about them on its own host, every pass.

1. Every budget's spend this month is read (open periods counted up to now), and the alerts of
   the thresholds it passed are recorded and sent, once each (``billing.budgets.alerts_due``).
2. For each budget whose spend reached its limit, the live sandboxes of its scope on this host:
   with ``over_limit = destroy``, destroy-requested and handed to this host's lane; with
   ``pause``, the running ones paused on the engine (the same call as ``POST .../pause``), then
   recorded paused in one transaction, their paused periods marked ``over_budget`` (billed at
   the paused rate, and shown on a line of their own in the statement); those paused already
   get the same mark; queued ones (not yet billed) end at once. Each gets a ``BudgetStop``
   naming the budget, and, when paused, the end of its grace.
3. Sandboxes whose grace has run out are destroyed.
4. Other apps stop what else a reached budget pays for on this host (``REACHED``: grading's
   dedicated endpoints, which cannot be paused, are deleted).

Any agent may run this at the same time as another: every step is a conditional move, a
unique row (one stop per sandbox, one alert per threshold), or acts on this host's sandboxes only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction
from django.utils import timezone

from billing.budgets import alerts_due
from billing.models import Budget, BudgetStop
from billing.selectors import BudgetState, budget_states
from sandboxes.engine import errors as engine_errors

from .. import commands, engine_link, selectors, transitions
from ..models import Host, Sandbox

log = logging.getLogger("forkyard.budgets")
OVER_BUDGET = "over_budget"
S = Sandbox.State
# What other apps stop on this host for a reached budget (they append at their AppConfig.ready): each
# takes the host, the budget's state and the moment, and returns what it stopped, by kind.
REACHED: list[Callable[[Host, BudgetState, datetime], dict[str, int]]] = []


def enforce_budgets(host: Host, now: datetime | None = None) -> dict[str, int]:
    """One pass for ``host``; what it did, by kind."""
    now = now or timezone.now()
    counts = {"alerts": 0, "paused": 0, "destroyed": 0, "grace_over": 0}
    states = budget_states(now=now)
    counts["alerts"] = len(alerts_due(now, states))
    for state in states:
        if state.reached:
            paused, destroyed = _stop(host, state, now)
            counts["paused"] += paused
            counts["destroyed"] += destroyed
            for stop_more in REACHED:
                for kind, count in stop_more(host, state, now).items():
                    counts[kind] = counts.get(kind, 0) + count
    counts["grace_over"] = _end_graces(host, now)
    return counts


def _in_scope(host: Host, budget: Budget) -> list[Sandbox]:
    rows = Sandbox.objects.filter(team_id=budget.team_id, host=host, state__in=(S.QUEUED, S.CREATING, S.RUNNING, S.PAUSED))
    if budget.api_key_id:
        rows = rows.filter(api_key_id=budget.api_key_id)
    pair = budget.label_pair()
    if pair is not None:
        rows = selectors.within(rows, {pair[0]: pair[1]})
    # Once stopped by a budget, a sandbox is that budget's to end (its grace), not again.
    return list(rows.exclude(budget_stops__isnull=False).order_by("pk"))


def _stop(host: Host, state: BudgetState, now: datetime) -> tuple[int, int]:
    budget = state.budget
    found = _in_scope(host, budget)
    if not found:
        return 0, 0
    queued = [row.pk for row in found if row.state == S.QUEUED]
    if budget.over_limit == Budget.OverLimit.DESTROY:
        ids = [row.pk for row in found]
        _record_stops(budget, ids, BudgetStop.Action.DESTROYED, now, destroy_at=None)
        destroying = transitions.sandboxes_destroy_requested(ids)
        commands.ensure_gone_on_hosts(destroying.stopping)
        return 0, destroying.count
    # Pause: what runs is frozen (the engine first, then the rows); what never started ends now.
    client = engine_link.engine(host.engine_socket)
    frozen = []
    for row in found:
        if row.state != S.RUNNING or not row.engine_id:
            continue
        try:
            client.call("pause", id=row.engine_id)
        except engine_errors.EngineError as error:
            log.info("budget %s: could not pause %s: %s", budget.pk, row.pk, error)
            continue
        frozen.append(row.pk)
    already = [row.pk for row in found if row.state == S.PAUSED]
    moved = transitions.sandboxes_paused(frozen, at=now, reason=OVER_BUDGET, rebill=already)
    grace_end = now + timedelta(seconds=budget.grace_s)
    _record_stops(budget, moved + already, BudgetStop.Action.PAUSED, now, destroy_at=grace_end)
    if queued:
        _record_stops(budget, queued, BudgetStop.Action.DESTROYED, now, destroy_at=None)
        destroying = transitions.sandboxes_destroy_requested(queued)
        commands.ensure_gone_on_hosts(destroying.stopping)
    return len(moved) + len(already), len(queued)


def _record_stops(budget: Budget, sandbox_ids: list[str], action: str, now: datetime, destroy_at: datetime | None) -> None:
    for sandbox_id in sandbox_ids:
        try:
            with transaction.atomic():
                BudgetStop.objects.create(
                    budget=budget,
                    team_id=budget.team_id,
                    sandbox_id=sandbox_id,
                    scope=budget.scope,
                    limit=budget.monthly_limit,
                    action=action,
                    at=now,
                    destroy_at=destroy_at,
                    destroyed_at=now if action == BudgetStop.Action.DESTROYED else None,
                )
        except IntegrityError:
            continue  # another agent stopped it first


def _end_graces(host: Host, now: datetime) -> int:
    """Sandboxes paused by a budget whose grace ran out: destroyed (handed to this host's lane)."""
    due = BudgetStop.objects.filter(
        destroy_at__lte=now, destroyed_at__isnull=True, sandbox__host=host, sandbox__state__in=Sandbox.LIVE
    ).values_list("pk", "sandbox_id")
    pairs = list(due)
    if not pairs:
        return 0
    BudgetStop.objects.filter(pk__in=[pk for pk, _ in pairs]).update(destroyed_at=now)
    destroying = transitions.sandboxes_destroy_requested([sandbox_id for _, sandbox_id in pairs])
    commands.ensure_gone_on_hosts(destroying.stopping)
    return destroying.count
