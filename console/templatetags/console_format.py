"""Small formatting filters for the console: thousands, dollars, durations."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from django import template

from billing import charts

register = template.Library()


@register.filter
def thousands(value: Any) -> str:
    """32752 -> 32,752."""
    try:
        return f"{int(value):,}"
    except (TypeError, ValueError):
        return str(value)


def money(amount: Decimal) -> str:
    """An amount in USD as people read money: "$0.00" for nothing, cents once it is a cent or more,
    and up to six places below that, so that a sandbox's fraction of a cent does not read as nothing."""
    if amount == 0:
        return "$0.00"
    sign = "-" if amount < 0 else ""
    amount = abs(amount)
    if amount >= Decimal("0.01"):
        return f"{sign}${amount.quantize(Decimal('0.01'), rounding=ROUND_HALF_UP):,}"
    small = amount.quantize(Decimal("0.000001"), rounding=ROUND_HALF_UP)
    return f"{sign}${format(small, 'f').rstrip('0')}" if small else f"{sign}<$0.000001"


@register.filter
def dollars(value: Any) -> str:
    """A Decimal amount in USD (``money``)."""
    try:
        amount = Decimal(value)
    except (TypeError, ArithmeticError, ValueError):
        return str(value)
    return money(amount)


@register.filter
def percent(share: Any) -> str:
    """0.42 -> 42%."""
    try:
        return f"{float(share) * 100:.0f}%"
    except (TypeError, ValueError):
        return str(share)


@register.filter
def share(percent: Any) -> float:
    """42 (a percent) -> 0.42, for a <meter>."""
    try:
        return round(float(percent) / 100, 4)
    except (TypeError, ValueError):
        return 0.0


@register.filter
def duration_s(seconds: Any) -> str:
    """Seconds as the largest units that say it: 95 -> 1 min 35 s."""
    try:
        total = int(float(seconds))
    except (TypeError, ValueError):
        return str(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours:,} h {minutes} min"
    if minutes:
        return f"{minutes} min {secs} s"
    return f"{secs} s"


@register.filter
def decode_output(data: bytes | str) -> str:
    """A command's output as text (invalid UTF-8 replaced); the template escapes it."""
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)


@register.filter
def series_colour(group: str) -> str:
    """The colour a usage series has on every chart (``billing.charts.series_colour``)."""
    return charts.series_colour(str(group))


@register.filter
def epoch(seconds: Any) -> datetime | None:
    """Seconds since the epoch as a time (UTC), for the date filter."""
    try:
        return datetime.fromtimestamp(float(seconds), tz=UTC)
    except (TypeError, ValueError, OverflowError, OSError):
        return None
