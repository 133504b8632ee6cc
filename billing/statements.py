"""Monthly statements: what a team spent in a month, line by line, from the metered periods.

A statement's lines are by kind (running, paused, paused past a budget, saved state, dedicated
endpoints, and each counted kind: inference tokens, from ``MeteredUsage``) and item (a size, or a model) at each unit price; it
also says the same money by API key and by the values of the labels asked for, and names the
budgets and what they stopped.  Each period counts as it is billed: a closed period wholly
inside the month by its own amount (rounded once, when it closed), any other (one that crosses
the month's start or end, or is still open, counted up to now) by its milliseconds inside the
month, rounded once.  So the statement's total is the sum of its periods' amounts exactly, and
the same to the cent however it is grouped.  Closed periods are summed by the database (one
``GROUP BY`` per grouping); only the few periods at the month's edges are read one by one.
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from django.db.models import Count, Q, Sum, TextField
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast
from django.utils import timezone

from console.errors import invalid
from console.models import Team

from .models import BudgetStop, MeteredUsage, Price, UsagePeriod
from .selectors import BudgetState, budget_states, month_of
from .services import AMOUNT_QUANTUM, MS_PER_HOUR, TOKENS_PER_UNIT, amount_for

DELETED_KEY = "(console or deleted key)"
NO_LABEL = "(none)"
MAX_LABEL_KEYS = 5
# Kinds of line, in the order a statement lists them, and what their quantity counts.
KINDS = {
    UsagePeriod.Kind.RUNNING: ("Running sandboxes", "sandbox-hours"),
    UsagePeriod.Kind.PAUSED: ("Paused sandboxes", "sandbox-hours"),
    "paused_over_budget": ("Paused past a budget's limit", "sandbox-hours"),
    UsagePeriod.Kind.SAVED_STATE: ("Saved state", "GiB-hours"),
    UsagePeriod.Kind.ENDPOINT: ("Dedicated endpoints", "endpoint-hours"),
    Price.Kind.INPUT_TOKENS: ("Inference: input tokens", "tokens"),
    Price.Kind.OUTPUT_TOKENS: ("Inference: output tokens", "tokens"),
}
OVER_BUDGET = "over_budget"


@dataclass
class Line:
    kind: str
    item: str  # a size, or a model; "" for saved state
    unit_price: Decimal  # per hour, per GiB-hour, or per million tokens
    quantity: Decimal = Decimal(0)  # hours, GiB-hours, or tokens
    amount: Decimal = Decimal(0)
    count: int = 0  # periods, or calls

    @property
    def title(self) -> str:
        return KINDS.get(self.kind, (self.kind, ""))[0]

    @property
    def unit(self) -> str:
        return KINDS.get(self.kind, ("", ""))[1]


@dataclass
class Statement:
    team: Team
    start: datetime
    end: datetime
    as_of: datetime  # open periods are counted up to here
    lines: list[Line]
    by_key: list[tuple[str, Decimal]]
    by_label: dict[str, list[tuple[str, Decimal]]]
    budgets: list[BudgetState] = field(default_factory=list)
    stops: list[BudgetStop] = field(default_factory=list)
    currency: str = "USD"

    @property
    def total(self) -> Decimal:
        return sum((line.amount for line in self.lines), Decimal(0))

    @property
    def month(self) -> str:
        return self.start.strftime("%Y-%m")

    @property
    def complete(self) -> bool:
        return self.as_of >= self.end

    def past_limits(self) -> list[tuple[BudgetState, Decimal]]:
        """Each budget of the month that was passed, and by how much."""
        return [(state, state.spent - state.budget.monthly_limit) for state in self.budgets if state.reached]


def parse_month(text: str | None, now: datetime | None = None) -> tuple[datetime, datetime]:
    """``YYYY-MM`` (default: this month) as [its first instant, the next month's), UTC."""
    if not text:
        return month_of(now or timezone.now())
    try:
        first = datetime.strptime(text, "%Y-%m").replace(tzinfo=UTC)
    except ValueError:
        raise invalid("month is YYYY-MM, e.g. 2026-12", field="month") from None
    if not 2000 <= first.year <= 2999:
        raise invalid("month is YYYY-MM, e.g. 2026-12", field="month")
    return month_of(first)


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def _kind(kind: str, reason: str) -> str:
    return "paused_over_budget" if kind == UsagePeriod.Kind.PAUSED and reason == OVER_BUDGET else kind


def statement(team: Team, month: str | None = None, *, label_keys: Iterable[str] = (), now: datetime | None = None) -> Statement:
    """The team's statement for ``month`` (``YYYY-MM``; this month by default), as of ``now``."""
    now = now or timezone.now()
    start, end = parse_month(month, now)
    keys = sorted({key for key in label_keys if key})[:MAX_LABEL_KEYS]
    start_ms, end_ms, now_ms = _ms(start), _ms(end), _ms(now)
    periods = UsagePeriod.objects.filter(team=team)
    annotations = {f"label_{index}": Cast(KeyTextTransform(key, "labels"), output_field=TextField()) for index, key in enumerate(keys)}
    lines: dict[tuple[str, str, Decimal], Line] = {}
    by_key: dict[str, Decimal] = defaultdict(Decimal)
    by_label: dict[str, dict[str, Decimal]] = {key: defaultdict(Decimal) for key in keys}

    def line(kind: str, item: str, unit_price: Decimal) -> Line:
        found = lines.get((kind, item, unit_price))
        if found is None:
            found = lines[(kind, item, unit_price)] = Line(kind, item, unit_price)
        return found

    def count(kind: str, item: str, price: Decimal, gib: Decimal, milliseconds: int, amount: Decimal, n: int) -> None:
        entry = line(kind, item, price)
        entry.quantity += Decimal(milliseconds) / MS_PER_HOUR * gib
        entry.amount += amount
        entry.count += n

    # Closed periods wholly inside the month: their own amounts, summed by the database.
    whole = Q(started_ms__gte=start_ms, ended_ms__isnull=False, ended_ms__lte=min(end_ms, now_ms))
    inside = periods.filter(whole)
    grouped = inside.values("kind", "reason", "size", "unit_price", "quantity_gib").annotate(
        milliseconds=Sum("duration_ms"), amount=Sum("amount"), n=Count("id")
    )
    for row in grouped.order_by():
        item = "" if row["kind"] == UsagePeriod.Kind.SAVED_STATE else row["size"] or "custom"
        count(
            _kind(row["kind"], row["reason"]), item, Decimal(row["unit_price"]), Decimal(row["quantity_gib"]),
            int(row["milliseconds"] or 0), Decimal(row["amount"] or 0), row["n"],
        )
    for key_row in inside.values("api_key__name").annotate(amount=Sum("amount")).order_by():
        by_key[key_row["api_key__name"] or DELETED_KEY] += Decimal(key_row["amount"] or 0)
    for index, key in enumerate(keys):
        alias = f"label_{index}"
        for row in inside.annotate(**{alias: annotations[alias]}).values(alias).annotate(amount=Sum("amount")).order_by():
            by_label[key][row[alias] if row[alias] is not None else NO_LABEL] += Decimal(row["amount"] or 0)

    # The rest that touch the month: open, or crossing its start or end; each clipped to it, rounded once.
    edges = (
        periods.filter(started_ms__lt=min(end_ms, now_ms))
        .filter(Q(ended_ms__isnull=True) | Q(ended_ms__gt=start_ms))
        .exclude(whole)
        .annotate(**annotations)
    )
    columns = ["kind", "reason", "size", "unit_price", "quantity_gib", "api_key__name", "started_ms", "ended_ms", *annotations]
    for row in edges.values(*columns).iterator(chunk_size=2000):
        ended = row["ended_ms"] if row["ended_ms"] is not None else now_ms
        milliseconds = max(0, min(ended, end_ms, now_ms) - max(row["started_ms"], start_ms))
        price, gib = Decimal(row["unit_price"]), Decimal(row["quantity_gib"])
        amount = amount_for(milliseconds, price, gib)
        item = "" if row["kind"] == UsagePeriod.Kind.SAVED_STATE else row["size"] or "custom"
        count(_kind(row["kind"], row["reason"]), item, price, gib, milliseconds, amount, 1)
        by_key[row["api_key__name"] or DELETED_KEY] += amount
        for index, key in enumerate(keys):
            value = row[f"label_{index}"]
            by_label[key][value if value is not None else NO_LABEL] += amount

    # Counted usage (inference tokens): each row's own amount.
    metered = MeteredUsage.objects.filter(team=team, at_ms__gte=start_ms, at_ms__lt=min(end_ms, now_ms + 1))
    counted = metered.values("kind", "item", "unit_price").annotate(quantity=Sum("quantity"), amount=Sum("amount"), n=Count("id"))
    for counted_row in counted.order_by():
        entry = line(counted_row["kind"], counted_row["item"], Decimal(counted_row["unit_price"]))
        entry.quantity += Decimal(counted_row["quantity"] or 0)
        entry.amount += Decimal(counted_row["amount"] or 0)
        entry.count += counted_row["n"]
    for metered_key in metered.values("api_key__name").annotate(amount=Sum("amount")).order_by():
        by_key[metered_key["api_key__name"] or DELETED_KEY] += Decimal(metered_key["amount"] or 0)
    for index, key in enumerate(keys):
        alias = f"label_{index}"
        for row in metered.annotate(**{alias: annotations[alias]}).values(alias).annotate(amount=Sum("amount")).order_by():
            by_label[key][row[alias] if row[alias] is not None else NO_LABEL] += Decimal(row["amount"] or 0)

    order = list(KINDS)
    ordered = sorted(lines.values(), key=lambda item: (order.index(item.kind) if item.kind in order else 99, item.item, item.unit_price))
    in_month = start <= now < end
    return Statement(
        team=team,
        start=start,
        end=end,
        as_of=min(now, end),
        lines=ordered,
        by_key=sorted(by_key.items(), key=lambda pair: (-pair[1], pair[0])),
        by_label={key: sorted(values.items(), key=lambda pair: (-pair[1], pair[0])) for key, values in by_label.items()},
        budgets=budget_states(team, now) if in_month else [],
        stops=list(BudgetStop.objects.filter(team=team, at__gte=start, at__lt=end).order_by("at")[:1000]),
    )


def money(amount: Decimal, places: int = 2) -> str:
    """An amount as a statement prints it: to the cent, or to ``places``."""
    return format(amount.quantize(Decimal(1).scaleb(-places)), "f")


def quantity_text(line: Line) -> str:
    if line.unit == "tokens":
        return f"{int(line.quantity):,}"
    return format(line.quantity.quantize(Decimal("0.000001")), "f")


def unit_price_text(line: Line) -> str:
    per = {"tokens": "per million tokens", "GiB-hours": "per GiB-hour"}.get(line.unit, "per hour")
    return f"{format(line.unit_price.normalize(), 'f')} {per}"


def as_dict(found: Statement) -> dict[str, Any]:
    """The statement as the API answers it (amounts as exact decimal strings)."""
    return {
        "month": found.month,
        "start": found.start,
        "end": found.end,
        "as_of": found.as_of,
        "complete": found.complete,
        "currency": found.currency,
        "total": format(found.total.quantize(AMOUNT_QUANTUM), "f"),
        "lines": [
            {
                "kind": line.kind,
                "title": line.title,
                "item": line.item,
                "unit": line.unit,
                "quantity": format(line.quantity.quantize(Decimal("0.000001")), "f"),
                "unit_price": format(line.unit_price, "f"),
                "amount": format(line.amount.quantize(AMOUNT_QUANTUM), "f"),
                "count": line.count,
            }
            for line in found.lines
        ],
        "by_key": [{"key": name, "amount": format(amount.quantize(AMOUNT_QUANTUM), "f")} for name, amount in found.by_key],
        "by_label": {
            key: [{"value": value, "amount": format(amount.quantize(AMOUNT_QUANTUM), "f")} for value, amount in values]
            for key, values in found.by_label.items()
        },
        "budgets": [
            {
                "id": state.budget.pk,
                "scope": state.budget.scope,
                "limit": str(state.budget.monthly_limit),
                "spent": format(state.spent.quantize(AMOUNT_QUANTUM), "f"),
                "reached": state.reached,
            }
            for state in found.budgets
        ],
        "stopped_by_budgets": [
            {"sandbox": stop.sandbox_id, "scope": stop.scope, "action": stop.action, "at": stop.at, "destroy_at": stop.destroy_at}
            for stop in found.stops
        ],
    }


def as_csv(found: Statement) -> str:
    """One row a line, then the same money by key and by label, then the total: a spreadsheet's input."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["section", "kind", "item", "quantity", "unit", "unit_price", "amount", "currency"])
    for line in found.lines:
        writer.writerow(
            ["line", line.kind, line.item, quantity_text(line).replace(",", ""), line.unit, format(line.unit_price, "f"),
             money(line.amount, 8), found.currency]
        )
    for name, amount in found.by_key:
        writer.writerow(["key", "", name, "", "", "", money(amount, 8), found.currency])
    for key, values in found.by_label.items():
        for value, amount in values:
            writer.writerow([f"label:{key}", "", value, "", "", "", money(amount, 8), found.currency])
    writer.writerow(["total", "", found.month, "", "", "", money(found.total, 8), found.currency])
    return out.getvalue()


__all__ = ["TOKENS_PER_UNIT", "Line", "Statement", "as_csv", "as_dict", "money", "parse_month", "statement"]
