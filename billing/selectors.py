"""Usage reads: totals by size, key, label or day, summed by the database.

Each period is clipped to the window and measured in integer milliseconds in
SQL (from its epoch-millisecond columns), grouped with its price; amounts are computed
once per (group, price) line.  One query however many sandboxes ran: a team
with 32,752 sandboxes gets its usage as fast as one with three.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db.models import BigIntegerField, Count, F, Q, Sum, Value
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Coalesce, Greatest, Least
from django.utils import timezone

from console.models import Team

from .models import UsagePeriod
from .services import AMOUNT_QUANTUM, amount_for

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
    total = sum((line["amount"] for line in lines.values()), Decimal(0))
    return {
        "start": start,
        "end": end,
        "group_by": group_by,
        "currency": "USD",
        "total": str(total.quantize(AMOUNT_QUANTUM)),
        "lines": [
            {
                "group": group,
                "seconds": round(line["milliseconds"] / 1000, 3),
                "amount": str(line["amount"].quantize(AMOUNT_QUANTUM)),
                "periods": line["periods"],
            }
            for group, line in sorted(lines.items())
        ],
    }


def spend_since(team: Team, since: datetime) -> Decimal:
    return Decimal(usage(team, since, timezone.now() + timedelta(seconds=1), "all")["total"])
