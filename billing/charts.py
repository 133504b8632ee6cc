"""Usage over time for the console: summed in the database, drawn with plotly.

A sandbox's period can run for hours, so its time is split across the buckets
it overlaps (not counted in the hour it started): each bucket is one SUM over
the periods that overlap it, computed in integer milliseconds since the epoch.
One query answers a whole chart however many sandboxes ran.

Each end of a period is read to the millisecond, and amounts are rounded once
per (group, price, bucket) rather than once per period as on a bill
(billing.selectors.usage): a chart and a "spend today" figure may differ from
the bill by a few millionths of a dollar, which they can afford.
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db.models import BigIntegerField, F, Q, Sum, Value
from django.db.models.functions import Coalesce, Greatest, Least
from django.utils import timezone

from console.models import Team

from .models import UsagePeriod
from .services import AMOUNT_QUANTUM, amount_for

WINDOWS = {"24h": (timedelta(hours=24), timedelta(hours=1)), "7d": (timedelta(days=7), timedelta(days=1))}
GROUPINGS = ("size", "key", "all")


@dataclass
class Series:
    """Per group, one value per bucket: milliseconds and amounts."""

    buckets: list[datetime]
    milliseconds: dict[str, list[int]] = field(default_factory=dict)
    amounts: dict[str, list[Decimal]] = field(default_factory=dict)
    sandbox_groups: set[str] = field(default_factory=set)  # groups whose time is sandbox time

    def total_amount(self) -> Decimal:
        return sum((sum(values, Decimal(0)) for values in self.amounts.values()), Decimal(0)).quantize(AMOUNT_QUANTUM)

    def amount_since(self, moment: datetime) -> Decimal:
        """The cost in the buckets that start at or after ``moment`` (a bucket boundary)."""
        keep = [index for index, start in enumerate(self.buckets) if start >= moment]
        spent = sum((values[index] for values in self.amounts.values() for index in keep), Decimal(0))
        return spent.quantize(AMOUNT_QUANTUM)

    def totals(self) -> list[tuple[str, float, Decimal]]:
        """(group, seconds, amount) over the whole window, biggest spend first."""
        rows = [
            (group, sum(self.milliseconds[group]) / 1000, sum(self.amounts[group], Decimal(0)).quantize(AMOUNT_QUANTUM))
            for group in self.amounts
        ]
        return sorted(rows, key=lambda row: (-row[2], row[0]))


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def bucket_starts(window: str, now: datetime | None = None) -> tuple[list[datetime], timedelta]:
    """The buckets of a window, aligned to the hour (or the day), the last one holding now."""
    span, step = WINDOWS[window]
    now = now or timezone.now()
    last = now.replace(minute=0, second=0, microsecond=0)
    if step >= timedelta(days=1):
        last = last.replace(hour=0)
    count = int(span / step)
    return [last - step * index for index in reversed(range(count))], step


def _group_label(row: dict[str, Any], grouping: str) -> str:
    if row["kind"] == UsagePeriod.Kind.SAVED_STATE:
        return "saved state"
    if grouping == "key":
        return row["api_key__name"] or "(console or deleted key)"
    if grouping == "all":
        return "all"
    size = row["size"] or "custom"
    return size if row["kind"] == UsagePeriod.Kind.RUNNING else f"{size} (paused)"


def usage_series(team: Team, buckets: list[tuple[datetime, datetime]], grouping: str = "size") -> Series:
    """Milliseconds and cost of the team's usage in each [start, end) bucket, per group."""
    return usage_series_by(team, buckets, (grouping,))[grouping]


def usage_series_by(team: Team, buckets: list[tuple[datetime, datetime]], groupings: tuple[str, ...]) -> dict[str, Series]:
    """The same usage grouped several ways, from one pass over the periods (the
    usage page draws by size and by key: one scan of the team's periods, not two)."""
    assert groupings and all(grouping in GROUPINGS for grouping in groupings)
    now_ms = _ms(timezone.now())
    first, last = _ms(buckets[0][0]), _ms(buckets[-1][1])
    # The integer epoch columns, not the datetimes: converting two datetimes per
    # period per bucket was most of a chart's time (230 ms of 24 buckets over
    # 32,752 periods on SQLite).
    started = F("started_ms")
    ended = Coalesce(F("ended_ms"), Value(now_ms, output_field=BigIntegerField()))
    sums = {}
    for index, (start, end) in enumerate(buckets):
        start_ms, end_ms = _ms(start), _ms(end)
        overlap = Least(Value(end_ms, output_field=BigIntegerField()), ended) - Greatest(
            Value(start_ms, output_field=BigIntegerField()), started
        )
        # Only periods that overlap this bucket are measured: the rest cost nothing to skip.
        touching = Q(started_ms__lt=end_ms) & (Q(ended_ms__isnull=True) | Q(ended_ms__gt=start_ms))
        sums[f"b{index}"] = Sum(overlap, filter=touching, output_field=BigIntegerField())
    columns = ["kind", "unit_price", "quantity_gib"]
    for grouping in groupings:
        columns += {"size": ["size"], "key": ["api_key__name"], "all": []}[grouping]
    rows = list(
        UsagePeriod.objects.filter(team=team, started_ms__lt=last)
        .filter(Q(ended_ms__isnull=True) | Q(ended_ms__gt=first))
        .values(*columns)
        .annotate(**sums)
        .order_by()
    )
    return {grouping: _series(rows, buckets, grouping) for grouping in groupings}


def _series(rows: list[dict[str, Any]], buckets: list[tuple[datetime, datetime]], grouping: str) -> Series:
    """One grouping's series from rows that may be finer (grouped several ways):
    milliseconds are summed per (group, price) first, and each amount rounded once."""
    series = Series(buckets=[start for start, _ in buckets])
    priced: dict[tuple[str, Decimal, Decimal], list[int]] = defaultdict(lambda: [0] * len(buckets))
    for row in rows:
        group = _group_label(row, grouping)
        if row["kind"] != UsagePeriod.Kind.SAVED_STATE:
            series.sandbox_groups.add(group)
        line = priced[(group, Decimal(row["unit_price"]), Decimal(row["quantity_gib"]))]
        for index in range(len(buckets)):
            line[index] += max(0, int(row[f"b{index}"] or 0))
    milliseconds: dict[str, list[int]] = defaultdict(lambda: [0] * len(buckets))
    amounts: dict[str, list[Decimal]] = defaultdict(lambda: [Decimal(0)] * len(buckets))
    for (group, unit_price, quantity), spent in priced.items():
        for index, value in enumerate(spent):
            milliseconds[group][index] += value
            amounts[group][index] += amount_for(value, unit_price, quantity)
    series.milliseconds, series.amounts = dict(milliseconds), dict(amounts)
    return series


def window_series(team: Team, window: str, grouping: str) -> Series:
    return window_series_by(team, window, (grouping,))[grouping]


def window_series_by(team: Team, window: str, groupings: tuple[str, ...]) -> dict[str, Series]:
    starts, step = bucket_starts(window)
    return usage_series_by(team, [(start, start + step) for start in starts], groupings)


def sandbox_spend(sandbox: Any) -> tuple[float, Decimal]:
    """(billed seconds, cost) of one sandbox so far: its few periods, the open one to now."""
    return _spend(UsagePeriod.objects.filter(sandbox=sandbox))


def snapshot_saved_state(snapshot: Any) -> tuple[float, Decimal]:
    """(billed seconds, cost) of one snapshot's saved state so far."""
    return _spend(UsagePeriod.objects.filter(snapshot=snapshot))


def _spend(periods: Any) -> tuple[float, Decimal]:
    now = timezone.now()
    seconds, amount = 0.0, Decimal(0)
    for period in periods.only("started_at", "ended_at", "amount", "unit_price", "quantity_gib"):
        if period.ended_at is not None and period.amount is not None:
            seconds += (period.ended_at - period.started_at).total_seconds()
            amount += period.amount
        else:
            milliseconds = max(0, _ms(now) - _ms(period.started_at))
            seconds += milliseconds / 1000
            amount += amount_for(milliseconds, period.unit_price, period.quantity_gib)
    return seconds, amount


# --- figures ---------------------------------------------------------------------------

# One colour a series, the same on every chart (and the board's running line is "tiny"'s green):
# the known groups by name, any other (a key's name) by a stable hash of it into the palette.
SERIES_COLOURS = {
    "tiny": "#1f8a4c",
    "default": "#2451d6",
    "custom": "#7c3aed",
    "tiny (paused)": "#86c9a1",
    "default (paused)": "#94a9ea",
    "custom (paused)": "#bfa3f2",
    "saved state": "#b7791f",
    "all": "#2451d6",
    "(console or deleted key)": "#6b7280",
}
PALETTE = ["#0e7490", "#c2410c", "#be185d", "#4d7c0f", "#6d28d9", "#a16207", "#0369a1", "#b91c1c", "#15803d", "#7e22ce"]


def series_colour(group: str) -> str:
    """The colour of a series named ``group``, wherever it is drawn."""
    known = SERIES_COLOURS.get(group)
    if known is not None:
        return known
    return PALETTE[sum(group.encode()) * 2654435761 % 2**32 % len(PALETTE)]


@functools.cache
def _theme() -> dict[str, Any]:
    """plotly's "simple_white" template as JSON, read once per process."""
    import plotly.io as pio  # imported on first use: web pages only
    from plotly.utils import PlotlyJSONEncoder

    theme: dict[str, Any] = json.loads(json.dumps(pio.templates["simple_white"].to_plotly_json(), cls=PlotlyJSONEncoder))
    return theme


def _figure(series: Series, metric: str, title: str) -> dict[str, Any]:
    """A stacked bar chart as plotly's JSON (data and layout), for Plotly.newPlot in
    the page; a dict, so that the template's json_script escapes it for a <script>
    tag. Written as plotly's figure schema directly: building it through
    plotly.graph_objects validated every property and cost ~20 ms a chart."""
    x = [start.isoformat() for start in series.buckets]
    data: list[dict[str, Any]] = []
    for group in sorted(series.amounts):
        if metric == "seconds":
            if group not in series.sandbox_groups:
                continue  # saved state is GiB-hours, not sandbox time
            y: list[float] = [ms / 1000 for ms in series.milliseconds[group]]
            hover = "%{y:,.0f} s<extra>%{fullData.name}</extra>"
        else:
            y = [float(amount) for amount in series.amounts[group]]
            hover = "$%{y:.4f}<extra>%{fullData.name}</extra>"
        data.append(
            {"type": "bar", "name": group, "x": x, "y": y, "hovertemplate": hover, "marker": {"color": series_colour(group)}}
        )
    layout: dict[str, Any] = {
        "template": _theme(),
        "title": {"text": title, "font": {"size": 14}},
        "barmode": "stack",
        "height": 280,
        "margin": {"l": 60, "r": 10, "t": 40, "b": 30},
        "legend": {"orientation": "h", "x": 1, "xanchor": "right", "y": 1.0, "yanchor": "bottom"},
        "yaxis": {"title": {"text": "sandbox-seconds" if metric == "seconds" else "USD"}, "rangemode": "tozero"},
        # The window, always: with no bars plotly would pick a range of its own (the year 2000).
        "xaxis": {"type": "date", "range": _window(series)},
    }
    if not data:
        layout["annotations"] = [
            {"text": "no usage in this window", "showarrow": False, "xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5}
        ]
        layout["yaxis"]["range"] = [0, 1]
    return {"data": data, "layout": layout}


def _window(series: Series) -> list[str]:
    if not series.buckets:
        return []
    step = series.buckets[1] - series.buckets[0] if len(series.buckets) > 1 else timedelta(hours=1)
    return [series.buckets[0].isoformat(), (series.buckets[-1] + step).isoformat()]


def seconds_figure(series: Series, title: str) -> dict[str, Any]:
    return _figure(series, "seconds", title)


def cost_figure(series: Series, title: str) -> dict[str, Any]:
    return _figure(series, "cost", title)
