"""Budgets: monthly limits checked at admission, alerts at thresholds (reads are ``billing.selectors``).

* ``admit_spend``: a create or launch whose cost for its requested TTL would take a budget that
  applies to it past its limit is refused (``OverBudget``, 402, the code naming the limit), as is
  resuming a sandbox or deploying a dedicated endpoint while a budget that applies to it is spent
  (``require_within``). The inference gateway refuses a call the same way before it is sent
  (``over_budget``, from ``grading.spend``: the most the call could cost against what is spent).
* ``alerts_due``: for each budget, each threshold of this month that spend has passed and no
  alert names yet gets one (a unique constraint makes it once, whatever number of host agents
  run this at the same time); once committed it is e-mailed to the team's owners and admins (and
  the budget's own addresses) through Django's mail, and posted to the budget's webhook.
* What happens to running sandboxes when spend reaches a limit is the worker's
  (``sandboxes/worker/budgets.py``): it pauses or destroys them on its own host.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal
from typing import Any

import httpx
from django.conf import settings
from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.utils import timezone

from console.audit import Act, Actor, audit_record
from console.errors import Conflict, OverBudget, invalid
from console.models import ApiKey, Membership, Role, Team

from .models import Budget, BudgetAlert
from .selectors import BudgetState, budget_spend, budget_states, budgets_applying, month_of

log = logging.getLogger("forkyard.budgets")
MAX_THRESHOLDS = 10
WEBHOOK_TIMEOUT_S = 5.0


def _money(amount: Decimal) -> str:
    return f"${amount.quantize(Decimal('0.01')):,}"


def admit_spend(
    *, team: Team, key: ApiKey | None, labels: dict[str, Any], hourly: Decimal, ttl_s: int, count: int, now: datetime | None = None
) -> None:
    """Refuse a request whose sandboxes, run for their whole TTL at ``hourly`` each, would take a budget past its limit."""
    cost = hourly * Decimal(ttl_s) * count / Decimal(3600)
    for budget in budgets_applying(team, key.pk if key else None, labels):
        spent = budget_spend(budget, now)
        if spent + cost > budget.monthly_limit:
            raise over_budget(budget, spent, cost, f"{count:,} sandbox{'es' if count != 1 else ''} for {ttl_s:,} s")


def over_budget(budget: Budget, spent: Decimal, cost: Decimal, what: str) -> OverBudget:
    """The refusal (402, the code naming the limit) of ``what``, which could cost up to ``cost``."""
    return OverBudget(
        budget.scope_code,
        f"the {budget.scope} budget is {_money(budget.monthly_limit)} a month and {_money(spent)} is spent: "
        f"{what} could cost up to {_money(cost)}",
        details={
            "budget": budget.pk,
            "scope": budget.scope,
            "limit": str(budget.monthly_limit),
            "spent": str(spent.quantize(Decimal("0.00000001"))),
            "cost": str(cost.quantize(Decimal("0.00000001"))),
        },
    )


def require_within(*, team: Team | str, key_id: str | None, labels: dict[str, Any], now: datetime | None = None) -> None:
    """Refuse (402) while a budget this sandbox counts against is spent: a paused sandbox does not resume past it."""
    for budget in budgets_applying(team, key_id, labels):
        spent = budget_spend(budget, now)
        if spent >= budget.monthly_limit:
            raise OverBudget(
                budget.scope_code,
                f"the {budget.scope} budget of {_money(budget.monthly_limit)} a month is spent ({_money(spent)}): "
                "raise it, or wait for next month",
                details={"budget": budget.pk, "scope": budget.scope, "limit": str(budget.monthly_limit), "spent": str(spent)},
            )


# --- budgets as the team sets them -----------------------------------------------------------------


@dataclass(frozen=True)
class BudgetFields:
    monthly_limit: Decimal
    alert_percents: list[int]
    over_limit: str = Budget.OverLimit.PAUSE
    grace_s: int = 3600
    webhook_url: str = ""
    notify_emails: tuple[str, ...] = ()


def _checked(fields: BudgetFields) -> BudgetFields:
    if fields.monthly_limit < 0 or fields.monthly_limit >= Decimal("1e10"):
        raise invalid("monthly_limit is an amount in USD, 0 or more", field="monthly_limit")
    percents = sorted({int(percent) for percent in fields.alert_percents})
    if len(percents) > MAX_THRESHOLDS or any(not 1 <= percent <= 100 for percent in percents):
        raise invalid(f"alert_percents are at most {MAX_THRESHOLDS} whole percents from 1 to 100", field="alert_percents")
    if fields.over_limit not in Budget.OverLimit.values:
        raise invalid(f"over_limit is one of {', '.join(Budget.OverLimit.values)}", field="over_limit")
    if not 0 <= fields.grace_s <= 30 * 24 * 3600:
        raise invalid("grace_s is 0 to 30 days", field="grace_s")
    if fields.webhook_url and not fields.webhook_url.startswith(("http://", "https://")):
        raise invalid("webhook_url is an http:// or https:// URL", field="webhook_url")
    return BudgetFields(
        monthly_limit=fields.monthly_limit.quantize(Decimal("0.01")),
        alert_percents=percents,
        over_limit=fields.over_limit,
        grace_s=fields.grace_s,
        webhook_url=fields.webhook_url,
        notify_emails=tuple(sorted({email.strip().lower() for email in fields.notify_emails if email.strip()})),
    )


def _as_dict(budget: Budget) -> dict[str, Any]:
    return {
        "monthly_limit": str(budget.monthly_limit),
        "alert_percents": budget.alert_percents,
        "over_limit": budget.over_limit,
        "grace_s": budget.grace_s,
        "webhook_url": budget.webhook_url,
    }


@transaction.atomic
def budget_create(
    *, team: Team, fields: BudgetFields, key: ApiKey | None = None, label: str = "", actor: Actor | None = None
) -> Budget:
    """A budget for the team (neither ``key`` nor ``label``), for one of its keys, or for a label (``key=value``)."""
    if key is not None and label:
        raise invalid("a budget is the team's, a key's or a label's: not a key's and a label's", field="label")
    if key is not None and key.team_id != team.pk:
        raise invalid("that key is another team's", field="api_key")
    if label:
        name, separator, value = label.partition("=")
        if not separator or not name or "__" in name or len(name) > 63:
            raise invalid("label is key=value", field="label")
    checked = _checked(fields)
    try:
        with transaction.atomic():
            budget = Budget.objects.create(
                team=team,
                api_key=key,
                label=label,
                monthly_limit=checked.monthly_limit,
                alert_percents=checked.alert_percents,
                over_limit=checked.over_limit,
                grace_s=checked.grace_s,
                webhook_url=checked.webhook_url,
                notify_emails=list(checked.notify_emails),
            )
    except IntegrityError:
        raise Conflict("budget_exists", "that scope has a budget already: change it instead", field="label") from None
    audit_record(
        team=team, actor=actor, action=Act.BUDGET_CREATED, target_type="budget", target_id=budget.pk, target=budget.scope,
        details=_as_dict(budget),
    )
    return budget


@transaction.atomic
def budget_update(*, budget: Budget, fields: BudgetFields, actor: Actor | None = None) -> Budget:
    checked = _checked(fields)
    before = _as_dict(budget)
    budget.monthly_limit, budget.alert_percents = checked.monthly_limit, checked.alert_percents
    budget.over_limit, budget.grace_s, budget.webhook_url = checked.over_limit, checked.grace_s, checked.webhook_url
    budget.notify_emails, budget.updated_at = list(checked.notify_emails), timezone.now()
    budget.save()
    after = _as_dict(budget)
    audit_record(
        team=budget.team_id, actor=actor, action=Act.BUDGET_CHANGED, target_type="budget", target_id=budget.pk,
        target=budget.scope, details={name: {"from": before[name], "to": after[name]} for name in after if before[name] != after[name]},
    )
    return budget


@transaction.atomic
def budget_delete(*, budget: Budget, actor: Actor | None = None) -> None:
    audit_record(
        team=budget.team_id, actor=actor, action=Act.BUDGET_DELETED, target_type="budget", target_id=budget.pk,
        target=budget.scope, details=_as_dict(budget),
    )
    budget.delete()


# --- alerts ----------------------------------------------------------------------------------------


def thresholds(budget: Budget) -> list[int]:
    """Its soft thresholds, and 100: the limit itself, reached."""
    return sorted({*(int(percent) for percent in budget.alert_percents), 100})


def alerts_due(now: datetime | None = None, states: list[BudgetState] | None = None) -> list[BudgetAlert]:
    """Record (and, once committed, send) the alerts of every threshold passed this month and not yet alerted."""
    now = now or timezone.now()
    month: date = month_of(now)[0].date()
    made = []
    for state in states if states is not None else budget_states(now=now):
        passed = [percent for percent in thresholds(state.budget) if state.spent * 100 >= state.budget.monthly_limit * percent]
        if not passed:
            continue
        sent = set(BudgetAlert.objects.filter(budget=state.budget, month=month).values_list("percent", flat=True))
        for percent in passed:
            if percent in sent:
                continue
            alert = _record_alert(state, month, percent, now)
            if alert is not None:
                made.append(alert)
    return made


def _record_alert(state: BudgetState, month: date, percent: int, now: datetime) -> BudgetAlert | None:
    budget = state.budget
    try:
        with transaction.atomic():
            alert = BudgetAlert.objects.create(
                budget=budget, team_id=budget.team_id, month=month, percent=percent, spent=state.spent,
                limit=budget.monthly_limit, at=now,
            )
            if percent >= 100:
                audit_record(
                    team=budget.team_id, actor=None, action=Act.BUDGET_REACHED, target_type="budget", target_id=budget.pk,
                    target=budget.scope, details={"limit": str(budget.monthly_limit), "spent": str(state.spent), "then": budget.over_limit},
                    at=now,
                )
            transaction.on_commit(lambda: send_alert(alert.pk))
    except IntegrityError:
        return None  # another agent recorded it first: it sends it
    return alert


def alert_sentence(alert: BudgetAlert) -> str:
    budget = alert.budget
    if alert.percent >= 100:
        then = (
            f"its sandboxes are paused and destroyed after {budget.grace_s // 60} min"
            if budget.over_limit == Budget.OverLimit.PAUSE
            else "its sandboxes are destroyed"
        )
        return f"The {budget.scope} budget of {_money(alert.limit)} for {alert.month:%B %Y} is reached ({_money(alert.spent)} spent): {then}."
    return f"The {budget.scope} budget is {alert.percent}% spent: {_money(alert.spent)} of {_money(alert.limit)} for {alert.month:%B %Y}."


def _recipients(alert: BudgetAlert) -> list[str]:
    admins = Membership.objects.filter(team_id=alert.team_id, role__in=[Role.OWNER, Role.ADMIN]).exclude(user__email="")
    emails = {email.lower() for email in admins.values_list("user__email", flat=True)}
    return sorted(emails | set(alert.budget.notify_emails or []))


def send_alert(alert_id: int) -> BudgetAlert:
    """E-mail the alert and post it to the budget's webhook; what went out is recorded on the alert."""
    alert = BudgetAlert.objects.select_related("budget", "budget__api_key", "team").get(pk=alert_id)
    sentence = alert_sentence(alert)
    recipients = _recipients(alert)
    if recipients:
        try:
            send_mail(f"forkyard: {alert.team.name}: budget {alert.percent}%", sentence + "\n", settings.DEFAULT_FROM_EMAIL, recipients)
            alert.emailed_to = recipients
        except Exception as error:  # noqa: BLE001 - a mail server down must not lose the alert (the console shows it)
            log.warning("budget alert %s: could not e-mail: %r", alert.pk, error)
    if alert.budget.webhook_url:
        payload = {
            "type": "budget.alert",
            "team": alert.team_id,
            "budget": alert.budget_id,
            "scope": alert.budget.scope,
            "month": alert.month.isoformat(),
            "percent": alert.percent,
            "reached": alert.percent >= 100,
            "limit": str(alert.limit),
            "spent": str(alert.spent),
            "message": sentence,
        }
        try:
            answer = httpx.post(
                alert.budget.webhook_url,
                content=json.dumps(payload),
                headers={"Content-Type": "application/json", "User-Agent": "forkyard-budgets"},
                timeout=WEBHOOK_TIMEOUT_S,
            )
            alert.webhook_status = str(answer.status_code)
        except httpx.HTTPError as error:
            alert.webhook_status = f"error: {type(error).__name__}"[:64]
    alert.save(update_fields=["emailed_to", "webhook_status"])
    return alert
