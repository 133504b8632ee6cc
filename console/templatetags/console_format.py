"""Small formatting filters for the console: thousands, dollars, durations."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from django import template

register = template.Library()


@register.filter
def thousands(value: Any) -> str:
    """32752 -> 32,752."""
    try:
        return f"{int(value):,}"
    except (TypeError, ValueError):
        return str(value)


@register.filter
def dollars(value: Any) -> str:
    """A Decimal amount in USD: cents once it is a dollar or more, else four places."""
    try:
        amount = Decimal(value)
    except (TypeError, ArithmeticError, ValueError):
        return str(value)
    places = Decimal("0.01") if abs(amount) >= 1 else Decimal("0.0001")
    return f"${amount.quantize(places, rounding=ROUND_HALF_UP):,}"


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
