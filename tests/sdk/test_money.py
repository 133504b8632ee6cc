"""How the CLI prints money: never ``0E-8``, cents from a cent up, and a fraction of a cent as one."""

from __future__ import annotations

from decimal import Decimal

import pytest

from forkyard._terminal import money
from forkyard.models import Usage


@pytest.mark.parametrize(
    ("amount", "shown"),
    [
        ("0E-8", "0.00 USD"),
        ("0.00000000", "0.00 USD"),
        ("0.00731250", "0.007313 USD"),
        ("0.00000004", "<0.000001 USD"),
        ("0.01", "0.01 USD"),
        ("1234.567", "1,234.57 USD"),
        ("-0.5", "-0.50 USD"),
    ],
)
def test_money_reads_like_money(amount: str, shown: str) -> None:
    assert money(Decimal(amount)) == shown


def test_the_usage_window_is_the_apis_start_and_end() -> None:
    report = Usage.from_api(
        {"start": "2026-12-01T00:00:00Z", "end": "2026-12-02T00:00:00Z", "group_by": "all", "currency": "USD", "total": "0E-8", "lines": []}
    )
    assert report.start is not None and report.end is not None and report.start.day == 1 and report.end.day == 2
    assert money(report.total) == "0.00 USD"
