"""Usage reads: totals by size, key, label or day, summed by the database; tokens by model.

Each period is clipped to the window and measured in integer milliseconds in
SQL (from its epoch-millisecond columns), grouped with its price; amounts are computed
once per (group, price) line.  One query however many sandboxes ran: a team
with 32,752 sandboxes gets its usage as fast as one with three.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db.models import BigIntegerField, Count, F, Q, QuerySet, Sum, TextField, Value
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast, Coalesce, Greatest, Least
from django.utils import timezone

from console.errors import not_found
from console.models import Team

from .models import Budget, BudgetAlert, BudgetStop, MeteredUsage, Price, UsagePeriod
from .services import AMOUNT_QUANTUM, MS_PER_HOUR, amount_for

MAX_DAYS = 400


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def _overlap(start: datetime, end: datetime, now_ms: int) -> Any:
    """Each period's milliseconds inside [start, end), from its integer epoch columns (exact on every database)."""
    ended = Coalesce(F("ended_ms"), Value(now_ms, output_field=BigIntegerField()))
    return Least(Value(_ms(end), output_field=BigIntegerField()), ended) - Greatest(
        Value(_ms(start), output_field=BigIntegerField()), F("started_ms")
    )


def _touching(start: datetime, end: datetime) -> Q:
    return Q(started_at__lt=end) & (Q(ended_at__isnull=True) | Q(ended_at__gt=start))


def _name(row: dict[str, Any], group_by: str) -> str:
    if group_by == "size":
        return "saved_state" if row["kind"] == UsagePeriod.Kind.SAVED_STATE else f"{row['kind']}:{row['size'] or 'custom'}"
    if group_by == "key":
        return row["api_key__name"] or "(console or deleted key)"
    if group_by.startswith("label:"):
        return str(row["label_value"]) if row["label_value"] is not None else "(none)"
    return "all"


def usage(team: Team, start: datetime, end: datetime, group_by: str = "size") -> dict[str, Any]:
    """Billable usage overlapping [start, end), open periods counted to now."""
    now_ms = _ms(timezone.now())
    lines: dict[str, dict[str, Any]] = defaultdict(lambda: {"milliseconds": 0, "amount": Decimal(0), "periods": 0})
    windows: list[tuple[datetime, datetime, str | None]]  # (from, to, the day's name when grouped by day)
    if group_by == "day":
        day = start.replace(hour=0, minute=0, second=0, microsecond=0)
        windows = []
        while day < end and len(windows) < MAX_DAYS:
            windows.append((max(day, start), min(day + timedelta(days=1), end), day.date().isoformat()))
            day += timedelta(days=1)
    else:
        windows = [(start, end, None)]
    rows = UsagePeriod.objects.filter(team=team)
    columns = ["kind", "unit_price", "quantity_gib"]
    if group_by == "size":
        columns.append("size")
    elif group_by == "key":
        columns.append("api_key__name")
    elif group_by.startswith("label:"):
        rows = rows.annotate(label_value=KeyTextTransform(group_by[6:], "labels"))
        columns.append("label_value")
    for window_start, window_end, day_name in windows:
        measured = (
            rows.filter(_touching(window_start, window_end))
            .values(*columns)
            .annotate(
                milliseconds=Sum(_overlap(window_start, window_end, now_ms), output_field=BigIntegerField()), periods=Count("id")
            )
            .order_by()
        )
        for row in measured:
            milliseconds = max(0, int(row["milliseconds"] or 0))
            line = lines[day_name or _name(row, group_by)]
            line["milliseconds"] += milliseconds
            line["amount"] += amount_for(milliseconds, Decimal(row["unit_price"]), Decimal(row["quantity_gib"]))
            line["periods"] += row["periods"]
    tokens = token_usage(team, start, end)
    total = sum((line["amount"] for line in lines.values()), Decimal(0)) + sum(
        (Decimal(line["amount"]) for line in tokens), Decimal(0)
    )
    return {
        "start": start,
        "end": end,
        "group_by": group_by,
        "currency": "USD",
        "total": format(total.quantize(AMOUNT_QUANTUM), "f"),
        "lines": [
            {
                "group": group,
                "seconds": round(line["milliseconds"] / 1000, 3),
                "amount": format(line["amount"].quantize(AMOUNT_QUANTUM), "f"),
                "periods": line["periods"],
            }
            for group, line in sorted(lines.items())
        ],
        "tokens": tokens,
    }


def token_usage(team: Team, start: datetime, end: datetime) -> list[dict[str, Any]]:
    """Tokens through the inference gateway in [start, end), by model: counts and their cost (one query of
    the meter that statements and budgets read too)."""
    rows = (
        MeteredUsage.objects.filter(team=team, at_ms__gte=_ms(start), at_ms__lt=_ms(end))
        .values("item", "kind")
        .annotate(quantity=Sum("quantity"), amount=Sum("amount"))
        .order_by()
    )
    by_model: dict[str, dict[str, Any]] = defaultdict(lambda: {"input_tokens": 0, "output_tokens": 0, "amount": Decimal(0)})
    for row in rows:
        line = by_model[row["item"]]
        line[row["kind"]] += int(row["quantity"] or 0)
        line["amount"] += Decimal(row["amount"] or 0)
    return [
        {
            "model": model,
            "input_tokens": line["input_tokens"],
            "output_tokens": line["output_tokens"],
            "amount": format(line["amount"].quantize(AMOUNT_QUANTUM), "f"),
        }
        for model, line in sorted(by_model.items())
    ]


def token_prices(models: list[str]) -> dict[str, tuple[Decimal, Decimal]]:
    """Each model's (input, output) price per million tokens on the rate card, as ``services.model_price``
    reads it (its own line, else the line for every model, else nothing), for many models in one query."""
    kinds = (Price.Kind.INPUT_TOKENS, Price.Kind.OUTPUT_TOKENS)
    lines = {
        (kind, model): Decimal(amount)
        for kind, model, amount in Price.objects.filter(kind__in=kinds, size="", model__in=[*models, ""]).values_list(
            "kind", "model", "amount"
        )
    }

    def price(kind: str, model: str) -> Decimal:
        return lines.get((kind, model), lines.get((kind, ""), Decimal(0)))

    return {model: (price(kinds[0], model), price(kinds[1], model)) for model in models}


def spend_since(team: Team, since: datetime) -> Decimal:
    return Decimal(usage(team, since, timezone.now() + timedelta(seconds=1), "all")["total"])


def cost_so_far(periods: QuerySet[UsagePeriod], now_ms: int | None = None) -> Decimal:
    """What these periods cost: the closed ones as billed, the open ones up to now.

    Two aggregate queries however many periods: open periods are summed per
    price as (count x now - sum of their starts).
    """
    now_ms = now_ms if now_ms is not None else _ms(timezone.now())
    cost = Decimal(periods.filter(ended_at__isnull=False).aggregate(total=Sum("amount"))["total"] or 0)
    open_by_price = (
        periods.filter(ended_at__isnull=True)
        .values("unit_price", "quantity_gib")
        .annotate(n=Count("id"), started=Sum("started_ms"))
        .values_list("unit_price", "quantity_gib", "n", "started")
    )
    for unit_price, quantity, count, started_sum in open_by_price:
        cost += Decimal(count * now_ms - int(started_sum or 0)) * Decimal(unit_price) * Decimal(quantity) / MS_PER_HOUR
    return cost


def month_of(moment: datetime) -> tuple[datetime, datetime]:
    """The calendar month (UTC) holding ``moment``: [its first instant, the next month's)."""
    start = moment.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = (start + timedelta(days=32)).replace(day=1)
    return start, end


def cost_between(periods: QuerySet[UsagePeriod], start: datetime, end: datetime, now_ms: int | None = None) -> Decimal:
    """What these periods cost inside [start, end), open ones counted up to now: one query, the
    time summed per price and each price's amount rounded once."""
    now_ms = now_ms if now_ms is not None else _ms(timezone.now())
    # A period that has not started by now costs nothing yet; nor does the part of the window still to come.
    clipped_end = datetime.fromtimestamp(min(_ms(end), now_ms) / 1000, tz=UTC)
    if clipped_end <= start:
        return Decimal(0)
    priced = (
        periods.filter(_touching(start, clipped_end))
        .values("unit_price", "quantity_gib")
        .annotate(milliseconds=Sum(_overlap(start, clipped_end, now_ms), output_field=BigIntegerField()))
        .order_by()
    )
    return sum(
        (
            amount_for(max(0, int(row["milliseconds"] or 0)), Decimal(row["unit_price"]), Decimal(row["quantity_gib"]))
            for row in priced
        ),
        Decimal(0),
    )


def metered_between(rows: QuerySet[MeteredUsage], start: datetime, end: datetime) -> Decimal:
    total = rows.filter(at_ms__gte=_ms(start), at_ms__lt=_ms(end)).aggregate(total=Sum("amount"))["total"]
    return Decimal(total or 0)


def in_scope(rows: QuerySet[Any], budget: Budget) -> QuerySet[Any]:
    """Usage rows (periods or metered) of a budget's scope: its team's, its key's, or its label's."""
    rows = rows.filter(team_id=budget.team_id)
    if budget.api_key_id:
        rows = rows.filter(api_key_id=budget.api_key_id)
    pair = budget.label_pair()
    if pair is not None:
        rows = rows.alias(budget_label=Cast(KeyTextTransform(pair[0], "labels"), output_field=TextField())).filter(
            budget_label=pair[1]
        )
    return rows


def budget_spend(budget: Budget, now: datetime | None = None) -> Decimal:
    """What the budget's scope has spent this month so far, open periods counted up to ``now``."""
    now = now or timezone.now()
    start, end = month_of(now)
    spent = cost_between(in_scope(UsagePeriod.objects.all(), budget), start, end, now_ms=_ms(now))
    return spent + metered_between(in_scope(MeteredUsage.objects.all(), budget), start, end)


@dataclass(frozen=True)
class BudgetState:
    budget: Budget
    spent: Decimal

    @property
    def percent(self) -> Decimal:
        return (self.spent * 100 / self.budget.monthly_limit) if self.budget.monthly_limit > 0 else Decimal(100)

    @property
    def reached(self) -> bool:
        return self.spent >= self.budget.monthly_limit

    @property
    def left(self) -> Decimal:
        return max(Decimal(0), self.budget.monthly_limit - self.spent)


def budgets_of(team: Team | str) -> list[Budget]:
    """The team's budgets: the team's own first, then keys', then labels'."""
    team_id = team if isinstance(team, str) else team.pk
    rows = Budget.objects.select_related("api_key").filter(team_id=team_id)
    return sorted(rows, key=lambda budget: (bool(budget.api_key_id), bool(budget.label), budget.label, budget.created_at))


def budget_for(team: Team, budget_id: str) -> Budget:
    budget = Budget.objects.select_related("api_key").filter(team=team, pk=budget_id).first()
    if budget is None:
        raise not_found("budget", budget_id)
    return budget


def budget_states(team: Team | str | None = None, now: datetime | None = None) -> list[BudgetState]:
    """Every budget (of ``team``, or of every team) with its spend this month."""
    rows = budgets_of(team) if team is not None else list(Budget.objects.select_related("api_key").order_by("team_id", "pk"))
    return [BudgetState(budget, budget_spend(budget, now)) for budget in rows]


def budgets_applying(team: Team | str, key_id: str | None, labels: dict[str, Any]) -> list[Budget]:
    """The budgets a sandbox made by ``key_id`` with ``labels`` counts against."""
    applying = []
    for budget in budgets_of(team):
        pair = budget.label_pair()
        if budget.api_key_id and budget.api_key_id != key_id:
            continue
        if pair is not None and str(labels.get(pair[0], "\x00")) != pair[1]:
            continue
        applying.append(budget)
    return applying


def alerts_of(team: Team, limit: int = 20) -> list[BudgetAlert]:
    return list(BudgetAlert.objects.filter(team=team).select_related("budget", "budget__api_key").order_by("-at")[:limit])


def stops_of(team: Team, limit: int = 50) -> list[BudgetStop]:
    return list(BudgetStop.objects.filter(team=team).order_by("-at")[:limit])


def stop_of(sandbox_id: str) -> BudgetStop | None:
    """Why a sandbox was paused or destroyed by a budget, if it was."""
    return BudgetStop.objects.filter(sandbox_id=sandbox_id).first()


def reached_budgets_sentence(team: Team) -> str:
    """What every console page says while a budget of the team is reached this month ("" while none is):
    from the alerts recorded (one query), not by summing spend on every page."""
    start, _ = month_of(timezone.now())
    reached = list(
        BudgetAlert.objects.filter(team=team, month=start.date(), percent__gte=100, budget__isnull=False)
        .select_related("budget", "budget__api_key")
        .order_by("at")
    )
    # A budget raised since it was reached is no longer reached (its next alert says otherwise).
    reached = [alert for alert in reached if alert.budget.monthly_limit <= alert.limit]
    if not reached:
        return ""
    parts = []
    for alert in reached:
        then = "sandboxes paused, then destroyed" if alert.budget.over_limit == Budget.OverLimit.PAUSE else "sandboxes destroyed"
        parts.append(f"the {alert.budget.scope} budget of ${alert.limit:,} ({then})")
    return f"Budget reached this month: {'; '.join(parts)}. New sandboxes in its scope are refused."
