"""Usage over time: summed in the database per hour or day, split across the buckets a period spans."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from billing.charts import bucket_starts, seconds_figure, usage_series, window_series
from billing.models import UsagePeriod
from billing.selectors import usage
from billing.services import amount_for
from tests.console.conftest import TINY, World, usage_period

pytestmark = pytest.mark.django_db


def test_a_period_is_split_across_the_hours_it_spans(world: World) -> None:
    hour = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)
    usage_period(world, hour + timedelta(minutes=30), hour + timedelta(hours=2, minutes=15))
    buckets = [(hour + timedelta(hours=index), hour + timedelta(hours=index + 1)) for index in range(3)]
    series = usage_series(world.team_a, buckets, "size")
    assert series.milliseconds == {"tiny": [1_800_000, 3_600_000, 900_000]}
    assert series.amounts["tiny"] == [amount_for(1_800_000, TINY), amount_for(3_600_000, TINY), amount_for(900_000, TINY)]


def test_open_periods_count_until_now_and_groups_are_by_size_or_key(world: World) -> None:
    from console.keys import api_key_create

    other = api_key_create(team=world.team_a, name="evaluator").key
    now = timezone.now()
    usage_period(world, now - timedelta(minutes=10))  # still running
    usage_period(world, now - timedelta(hours=2), now - timedelta(hours=1), size="default", key=other, price=Decimal("0.018"))
    by_size = window_series(world.team_a, "24h", "size")
    assert set(by_size.milliseconds) == {"tiny", "default"}
    assert abs(sum(by_size.milliseconds["tiny"]) - 600_000) < 5_000
    assert abs(sum(by_size.milliseconds["default"]) - 3_600_000) <= 1  # each end read to the millisecond
    by_key = window_series(world.team_a, "24h", "key")
    assert set(by_key.milliseconds) == {"trainer", "evaluator"}
    # The hour falls across two buckets, each rounded to the hundred-millionth.
    assert abs(sum(by_key.amounts["evaluator"], Decimal(0)) - Decimal("0.018")) <= Decimal("0.00000002")


def test_the_totals_agree_with_the_bill(world: World) -> None:
    """The chart and the bill agree, give or take the rounding of each end to the millisecond."""
    now = timezone.now()
    for minutes in (5, 50, 200, 700):
        usage_period(world, now - timedelta(minutes=minutes + 3, microseconds=1234), now - timedelta(minutes=minutes))
    starts, step = bucket_starts("24h")
    series = usage_series(world.team_a, [(start, start + step) for start in starts], "size")
    bill = usage(world.team_a, starts[0], starts[-1] + step, "size")
    assert abs(series.total_amount() - Decimal(bill["total"])) <= Decimal("0.00000004")
    assert abs(sum(series.milliseconds["tiny"]) - 4 * 180_001) <= 4


def test_other_teams_usage_is_not_counted(world: World) -> None:
    now = timezone.now()
    UsagePeriod.objects.create(
        team=world.team_b, api_key=world.key_b, kind="running", size="tiny", unit_price=TINY, started_at=now - timedelta(hours=1)
    )
    assert window_series(world.team_a, "24h", "size").milliseconds == {}


def test_a_chart_spans_its_window_even_with_nothing_in_it(world: World) -> None:
    """With no bars plotly picks a range of its own (January 2000): the window is set instead."""
    series = window_series(world.team_a, "24h", "size")
    figure = seconds_figure(series, "Sandbox time")
    start, end = figure["layout"]["xaxis"]["range"]
    assert datetime.fromisoformat(start) == series.buckets[0]
    assert datetime.fromisoformat(end) - datetime.fromisoformat(start) == timedelta(hours=24)
    assert figure["data"] == [] and "no usage" in figure["layout"]["annotations"][0]["text"]


def figures(html: str) -> dict[str, Any]:
    """The plotly figures a page carries (json_script blocks), by id."""
    return {
        found.group(1): json.loads(found.group(2))
        for found in re.finditer(r'<script id="([\w-]+)" type="application/json">(.*?)</script>', html, re.S)
        if '"data"' in found.group(2)
    }


def test_a_series_has_one_colour_on_every_chart(member_client: Client, world: World) -> None:
    """By size and by key, seconds and cost, overview and usage: the same name, the same colour."""
    now = timezone.now()
    usage_period(world, now - timedelta(hours=2), now - timedelta(hours=1))
    usage_period(world, now - timedelta(hours=3), now - timedelta(hours=2), size="default", price=Decimal("0.018"))
    colours: dict[str, set[str]] = {}
    for url in (reverse("console:usage"), reverse("console:overview")):
        for figure in figures(member_client.get(url).content.decode()).values():
            for trace in figure["data"]:
                colours.setdefault(trace["name"], set()).add(trace["marker"]["color"])
    assert {"tiny", "default", "trainer"} <= set(colours)
    assert all(len(found) == 1 for found in colours.values()), colours
    assert colours["tiny"] != colours["default"]


def test_cost_so_far_counts_open_periods_up_to_now(member_client: Client, world: World) -> None:
    usage_period(world, timezone.now() - timedelta(minutes=30), None, price=Decimal("36"))  # open: $18 so far
    page = member_client.get(reverse("console:usage")).content.decode()
    shown = re.search(r'Cost, 24h</div><div class="value"[^>]*>\$([\d,.]+)<', page)
    assert shown and Decimal(shown.group(1).replace(",", "")) >= Decimal("18.00"), shown
