"""Usage reads: totals by size, key, label or day, open periods counted to now."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db.models import Q
from django.utils import timezone

from console.models import Team

from .models import UsagePeriod
from .services import AMOUNT_QUANTUM, amount_for


def usage(team: Team, start: datetime, end: datetime, group_by: str = "size") -> dict[str, Any]:
    """Billable usage overlapping [start, end), each period clipped to the window."""
    now = timezone.now()
    periods = UsagePeriod.objects.filter(team=team, started_at__lt=end).filter(Q(ended_at__isnull=True) | Q(ended_at__gt=start))
    lines: dict[str, dict[str, Any]] = defaultdict(lambda: {"milliseconds": 0, "amount": Decimal(0), "periods": 0})
    total = Decimal(0)
    for period in periods.select_related("api_key").iterator(chunk_size=2000):
        began = max(period.started_at, start)
        finished = min(period.ended_at or now, end)
        if finished <= began:
            continue
        milliseconds = int((finished - began).total_seconds() * 1000)
        if (
            period.ended_at is not None
            and began == period.started_at
            and finished == period.ended_at
            and period.amount is not None
        ):
            amount = period.amount  # a whole closed period: its own rounded line
        else:
            amount = amount_for(milliseconds, period.unit_price, period.quantity_gib)
        group = _group(period, group_by, began)
        line = lines[group]
        line["milliseconds"] += milliseconds
        line["amount"] += amount
        line["periods"] += 1
        total += amount
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


def _group(period: UsagePeriod, group_by: str, began: datetime) -> str:
    if group_by == "size":
        return f"{period.kind}:{period.size}" if period.kind != UsagePeriod.Kind.SAVED_STATE else "saved_state"
    if group_by == "key":
        return period.api_key.name if period.api_key else "(deleted key)"
    if group_by == "day":
        return began.date().isoformat()
    if group_by.startswith("label:"):
        return str(period.labels.get(group_by[6:], "(none)"))
    return "all"


def spend_since(team: Team, since: datetime) -> Decimal:
    return Decimal(usage(team, since, timezone.now() + timedelta(seconds=1), "all")["total"])
