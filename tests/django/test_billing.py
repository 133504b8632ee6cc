"""Metering: periods from transitions, exact money, one open period per sandbox.

Every expected amount here is computed in the test itself, from the rule the
product promises (ARCHITECTURE.md, "Billing"): a period's ends are kept as
epoch milliseconds, its duration is their difference, its amount is that many
milliseconds times the hourly price on the rate card / 3,600,000, rounded half
up to 8 places, once per period; a usage report clips each period to its
window and rounds once per (line, price). Nothing here asks the code under
test (``billing.services.amount_for`` and friends) what the answer should be.
"""

from __future__ import annotations

import random
import re
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from billing.models import Price, UsagePeriod
from billing.selectors import usage
from billing.services import (
    amount_for,
    install_default_prices,
    open_running_periods,
    saved_state_transition,
    usage_transition,
)
from console.db import insert_each
from console.keys import api_key_create
from console.services import team_create
from sandboxes.models import Sandbox, Snapshot

pytestmark = pytest.mark.django_db

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MS = timedelta(milliseconds=1)
EIGHT_PLACES = Decimal("0.00000001")
CENT = Decimal("0.01")
# PRODUCT.md's rate card (the defaults an operator starts with), per hour; saved state per GiB-hour.
PRODUCT_PRICES = {("running", "tiny"): "0.0073125", ("running", "default"): "0.018", ("saved_state", ""): "0.0002"}


def epoch_ms(moment: datetime) -> int:
    """A moment as whole epoch milliseconds (exact integer arithmetic, no floats)."""
    return (moment - EPOCH) // MS


def expected(milliseconds: int, per_hour: Decimal, quantity: Decimal = Decimal(1)) -> Decimal:
    """What that many milliseconds cost: exact, then rounded half up to 8 places."""
    exact = Decimal(milliseconds) * per_hour * quantity / Decimal(3_600_000)
    return exact.quantize(EIGHT_PLACES, rounding=ROUND_HALF_UP)


def rate(kind: str, size: str) -> Decimal:
    """The hourly price on the rate card (data in the database, as an operator left it)."""
    return Price.objects.get(kind=kind, size=size).amount


def overlap_ms(start: datetime, end: datetime, window_start: datetime, window_end: datetime) -> int:
    return max(0, min(epoch_ms(end), epoch_ms(window_end)) - max(epoch_ms(start), epoch_ms(window_start)))


@pytest.fixture
def team():
    install_default_prices()
    return team_create(name="Billing Co")


@pytest.fixture
def make_sandbox(team):
    key = api_key_create(team=team, name="k").key

    def make(size: str = "tiny", **labels: str) -> Sandbox:
        cpu, memory = {"tiny": (1, 128), "default": (2, 4096)}[size]
        return Sandbox.objects.create(
            team=team, api_key=key, template="base", size=size, cpu=cpu, memory_mib=memory, ttl_s=60, labels=labels
        )

    return make


@pytest.fixture
def sandbox(make_sandbox):
    return make_sandbox()


def test_the_shipped_rate_card_is_the_products(team):
    for (kind, size), amount in PRODUCT_PRICES.items():
        assert rate(kind, size) == Decimal(amount), (kind, size)


def test_amounts_are_exact_and_rounded_once():
    assert amount_for(3_600_000, Decimal("0.0073125")) == Decimal("0.00731250")
    assert amount_for(1, Decimal("0.018")) == Decimal("0.00000001")  # 0.000000005: half up, at the last place
    assert amount_for(3, Decimal("0.018")) == Decimal("0.00000002")  # 0.000000015
    assert amount_for(0, Decimal("0.018")) == Decimal("0")


def test_transitions_close_and_open_periods(sandbox):
    start = datetime(2026, 11, 3, 9, 15, 2, 123456, tzinfo=UTC)
    usage_transition(sandbox=sandbox, kind="running", at=start)
    usage_transition(sandbox=sandbox, kind="running", at=start + timedelta(seconds=5))  # a replay: nothing new
    paused_at = start + timedelta(seconds=10, microseconds=333)
    ended_at = start + timedelta(seconds=70, microseconds=999)
    usage_transition(sandbox=sandbox, kind="paused", at=paused_at)
    usage_transition(sandbox=sandbox, kind=None, at=ended_at)
    periods = list(UsagePeriod.objects.filter(sandbox=sandbox).order_by("started_at"))
    running_ms, paused_ms = epoch_ms(paused_at) - epoch_ms(start), epoch_ms(ended_at) - epoch_ms(paused_at)
    assert (running_ms, paused_ms) == (10_000, 60_001)  # the ends truncated to whole milliseconds, then subtracted
    assert [(p.kind, p.duration_ms) for p in periods] == [("running", running_ms), ("paused", paused_ms)]
    assert [(p.started_at, p.ended_at) for p in periods] == [(start, paused_at), (paused_at, ended_at)]
    assert periods[0].amount == expected(running_ms, rate("running", "tiny")) == Decimal("0.00002031")
    assert periods[1].amount == expected(paused_ms, rate("paused", "tiny")) == Decimal("0.00000500")
    report = usage(sandbox.team, start - timedelta(hours=1), start + timedelta(hours=1))
    assert Decimal(report["total"]) == Decimal("0.00002531")
    assert {line["group"]: line["seconds"] for line in report["lines"]} == {"running:tiny": 10.0, "paused:tiny": 60.001}


def test_the_database_refuses_a_second_open_period(sandbox):
    usage_transition(sandbox=sandbox, kind="running", at=timezone.now())
    with pytest.raises(IntegrityError), transaction.atomic():
        UsagePeriod.objects.create(
            team=sandbox.team, sandbox=sandbox, kind="running", unit_price=Decimal(1), started_at=timezone.now()
        )


@pytest.mark.django_db
def test_the_rows_a_sandbox_rewrites_carry_only_the_indexes_their_queries_use():
    # Each move of a sandbox's row and each write of its period updates every index of the table: the keys'
    # LIKE twins (PostgreSQL's varchar_pattern_ops) and the keys' own indexes that a pair already leads with
    # went (migrations sandboxes 0016, billing 0007); the partial unique indexes billing relies on stay.
    with connection.cursor() as cursor:
        found = {
            table: connection.introspection.get_constraints(cursor, table)
            for table in ("sandboxes_sandbox", "billing_usageperiod")
        }
    for table, constraints in found.items():
        single = [
            info["columns"][0]
            for info in constraints.values()
            if info["index"] and not info["unique"] and len(info["columns"]) == 1
        ]
        assert len(single) == len(set(single)), f"{table}: two indexes on one column: {sorted(single)}"
        for column in ("team_id", "host_id", "launch_id"):
            assert column not in single or table != "sandboxes_sandbox", f"{table}.{column}: a pair leads with it"
    open_ones = {name for name, info in found["billing_usageperiod"].items() if info["unique"] and info["index"]}
    assert {"one_open_period_per_sandbox", "one_open_period_per_snapshot", "one_open_period_per_endpoint"} <= open_ones


def test_a_launch_opens_its_periods_in_one_insert_and_keeps_an_open_one(make_sandbox):
    started = [make_sandbox(), make_sandbox(), make_sandbox()]
    at = {row.pk: datetime(2026, 12, 6, 8, 0, index, 250_000, tzinfo=UTC) for index, row in enumerate(started)}
    usage_transition(sandbox=started[0], kind="running", at=at[started[0].pk] - timedelta(seconds=30))  # reconciliation's
    assert open_running_periods(started, at) == 2  # the first one's open period stays, ours is dropped
    periods = {period.sandbox_id: period for period in UsagePeriod.objects.filter(sandbox__in=started)}
    assert len(periods) == 3
    assert periods[started[0].pk].started_at == at[started[0].pk] - timedelta(seconds=30)
    for row in started[1:]:
        period = UsagePeriod.objects.get(pk=periods[row.pk].pk)  # read back as the database holds it
        assert (period.kind, period.size, period.ended_at) == ("running", "tiny", None)
        assert period.started_at == at[row.pk] and period.started_ms == epoch_ms(at[row.pk])
        assert period.unit_price == rate("running", "tiny") and period.quantity_gib == Decimal(1)  # a field's default
        assert period.created_at is not None and period.team_id == row.team_id
    with pytest.raises(ValueError, match="not_a_column"):
        insert_each(UsagePeriod, [{"not_a_column": 1}])


def test_a_period_across_midnight_is_split_exactly_by_day(sandbox):
    started = datetime(2026, 11, 30, 23, 59, 30, 250_000, tzinfo=UTC)
    paused = datetime(2026, 12, 1, 0, 0, 10, 500_000, tzinfo=UTC)
    ended = datetime(2026, 12, 1, 0, 1, 0, 125_000, tzinfo=UTC)
    usage_transition(sandbox=sandbox, kind="running", at=started)
    usage_transition(sandbox=sandbox, kind="paused", at=paused)
    usage_transition(sandbox=sandbox, kind=None, at=ended)
    running, paused_rate = rate("running", "tiny"), rate("paused", "tiny")
    # Written out by hand: 29.750 s on the 30th; 10.500 s running and 49.625 s paused on the 1st.
    day_one = expected(29_750, running)
    day_two = expected(10_500, running) + expected(49_625, paused_rate)
    assert (day_one, day_two) == (Decimal("0.00006043"), Decimal("0.00002547"))

    report = usage(sandbox.team, datetime(2026, 11, 30, tzinfo=UTC), datetime(2026, 12, 2, tzinfo=UTC), "day")
    lines = {line["group"]: line for line in report["lines"]}
    assert lines["2026-11-30"]["seconds"] == 29.75 and Decimal(lines["2026-11-30"]["amount"]) == day_one
    assert lines["2026-12-01"]["seconds"] == 60.125 and Decimal(lines["2026-12-01"]["amount"]) == day_two
    assert Decimal(report["total"]) == day_one + day_two
    # One window over both days: the same milliseconds, the running ones rounded together.
    whole = usage(sandbox.team, datetime(2026, 11, 30, tzinfo=UTC), datetime(2026, 12, 2, tzinfo=UTC), "size")
    assert {line["group"]: line["seconds"] for line in whole["lines"]} == {"running:tiny": 40.25, "paused:tiny": 49.625}
    assert Decimal(whole["total"]) == expected(40_250, running) + expected(49_625, paused_rate)
    assert Decimal(whole["total"]).quantize(CENT) == (day_one + day_two).quantize(CENT)


def test_usage_clips_periods_to_the_window_edges_exactly(make_sandbox):
    window_start = datetime(2026, 11, 20, 12, 0, 0, 0, tzinfo=UTC)
    window_end = datetime(2026, 11, 20, 13, 0, 0, 0, tzinfo=UTC)
    periods = [  # (start, end or None for still open), each on its own sandbox
        (window_start - timedelta(hours=1), window_start + timedelta(minutes=15, milliseconds=250)),  # straddles the start
        (window_start + timedelta(minutes=30), window_start + timedelta(minutes=45, microseconds=999)),  # inside
        (window_start + timedelta(minutes=50, milliseconds=1), window_end + timedelta(minutes=10)),  # straddles the end
        (window_start - timedelta(hours=2), window_start),  # ends exactly where the window starts: not in it
        (window_end, window_end + timedelta(hours=1)),  # starts exactly where the window ends: not in it
        (window_start + timedelta(minutes=55, milliseconds=7), None),  # still open: counted to the window's end only
        (window_start - timedelta(milliseconds=1), window_start + timedelta(milliseconds=1)),  # 1 ms inside
    ]
    for start, end in periods:
        sandbox = make_sandbox()
        usage_transition(sandbox=sandbox, kind="running", at=start)
        if end is not None:
            usage_transition(sandbox=sandbox, kind=None, at=end)
    now = timezone.now()
    inside = [overlap_ms(start, end or now, window_start, window_end) for start, end in periods]
    assert inside == [900_250, 900_000, 599_999, 0, 0, 299_993, 1]
    report = usage(make_sandbox().team, window_start, window_end, "size")
    [line] = report["lines"]
    assert line["group"] == "running:tiny"
    assert line["seconds"] == sum(inside) / 1000 == 2_700.243
    assert line["periods"] == 5, "the two periods that only touch an edge are not in the window"
    assert Decimal(report["total"]) == expected(sum(inside), rate("running", "tiny")) == Decimal("0.00548487")
    # A window that starts where another ends: nothing counted twice, nothing lost.
    after = usage(make_sandbox().team, window_end, window_end + timedelta(hours=2), "size")
    after_ms = sum(overlap_ms(start, end or now, window_end, window_end + timedelta(hours=2)) for start, end in periods)
    whole = usage(make_sandbox().team, window_start, window_end + timedelta(hours=2), "size")
    assert whole["lines"][0]["seconds"] * 1000 == pytest.approx(sum(inside) + after_ms, abs=0.5)
    assert after["lines"][0]["seconds"] * 1000 == pytest.approx(after_ms, abs=0.5)


def test_statements_sum_to_the_cent(make_sandbox):
    """A month of a team's usage: 60 sandboxes of two sizes, running and paused in turns, many periods across
    midnight. Each period is billed as computed here; each day's line and each size's line is what its
    periods' clipped milliseconds cost; the day lines add up to the month; and to the cent the month is the
    sum of its periods' own amounts, however it is grouped."""
    generator = random.Random(20261201)
    month_start, month_end = datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 12, 1, tzinfo=UTC)
    made: list[tuple[str, str, datetime, datetime]] = []  # (kind, size, start, end)
    for index in range(60):
        size = "default" if index % 3 == 0 else "tiny"
        sandbox = make_sandbox(size)
        at = (
            month_start
            - timedelta(hours=6)
            + timedelta(seconds=generator.randrange(0, 29 * 86_400), microseconds=generator.randrange(10**6))
        )
        kind = "running"
        for _ in range(generator.randrange(1, 7)):
            usage_transition(sandbox=sandbox, kind=kind, at=at)
            end = at + timedelta(seconds=generator.randrange(1, 40_000), microseconds=generator.randrange(10**6))
            made.append((kind, size, at, end))
            at, kind = end, "paused" if kind == "running" else "running"
        usage_transition(sandbox=sandbox, kind=None, at=at)
    prices = {(kind, size): rate(kind, size) for kind in ("running", "paused") for size in ("tiny", "default")}

    # Each period, as billed: its own amount, rounded once.
    billed = {
        (row.kind, row.size, row.started_at): (row.duration_ms, row.amount)
        for row in UsagePeriod.objects.filter(team=make_sandbox().team)
    }
    assert len(billed) == len(made) > 150
    for kind, size, start, end in made:
        milliseconds = epoch_ms(end) - epoch_ms(start)
        assert billed[(kind, size, start)] == (milliseconds, expected(milliseconds, prices[(kind, size)]))

    # The month by day: each day's line is its clipped milliseconds per price, rounded per price.
    by_day = usage(make_sandbox().team, month_start, month_end, "day")
    day_lines = {line["group"]: Decimal(line["amount"]) for line in by_day["lines"]}
    days = [month_start + timedelta(days=offset) for offset in range(30)]
    for day in days:
        milliseconds: dict[tuple[str, str], int] = {}
        for kind, size, start, end in made:
            milliseconds[(kind, size)] = milliseconds.get((kind, size), 0) + overlap_ms(start, end, day, day + timedelta(days=1))
        amount = sum((expected(ms, prices[price]) for price, ms in milliseconds.items()), Decimal(0))
        assert day_lines.get(day.date().isoformat(), Decimal(0)) == amount, day
    assert Decimal(by_day["total"]) == sum(day_lines.values())

    # The month by size: each line its clipped milliseconds, rounded once.
    by_size = usage(make_sandbox().team, month_start, month_end, "size")
    size_lines = {line["group"]: Decimal(line["amount"]) for line in by_size["lines"]}
    for (kind, size), price in prices.items():
        milliseconds_in = sum(
            overlap_ms(start, end, month_start, month_end) for k, s, start, end in made if (k, s) == (kind, size)
        )
        assert size_lines[f"{kind}:{size}"] == expected(milliseconds_in, price)
    assert Decimal(by_size["total"]) == sum(size_lines.values())

    # To the cent, the month is the same whichever way it is grouped, and the same as the sum of
    # each period's share of the month billed on its own (rounding per period or per line moves
    # millionths of a cent, never a cent: checked away from a half-cent edge).
    per_period = sum(
        (expected(overlap_ms(start, end, month_start, month_end), prices[(kind, size)]) for kind, size, start, end in made),
        Decimal(0),
    )
    assert abs((per_period * 100) % 1 - Decimal("0.5")) > Decimal("0.001"), "pick another seed: the total sits on a half cent"
    cents = per_period.quantize(CENT, rounding=ROUND_HALF_UP)
    assert Decimal(by_day["total"]).quantize(CENT, rounding=ROUND_HALF_UP) == cents
    assert Decimal(by_size["total"]).quantize(CENT, rounding=ROUND_HALF_UP) == cents
    assert cents > Decimal("1.00"), f"a month of 60 sandboxes should cost more than {cents}"


def test_explicit_sizes_are_priced_from_their_shape(sandbox):
    sandbox.size, sandbox.cpu, sandbox.memory_mib = "", 2.0, 4096
    sandbox.save()
    period = usage_transition(sandbox=sandbox, kind="running", at=timezone.now())
    assert period.unit_price == Decimal("0.018")  # the same as the default size's card


def test_saved_state_is_billed_per_gib_hour_until_deleted_and_grouped_by_label(sandbox):
    snapshot = Snapshot.objects.create(team=sandbox.team, name="s", template="base", labels={"case": "kept"}, size_bytes=2**31)
    start = timezone.now() - timedelta(hours=3)
    saved_state_transition(snapshot=snapshot, gib=Decimal(2), at=start)
    saved_state_transition(snapshot=snapshot, gib=None, at=start + timedelta(hours=1))  # deleted
    period = UsagePeriod.objects.get(snapshot=snapshot)
    assert period.kind == "saved_state" and period.duration_ms == 3_600_000
    assert period.amount == Decimal("0.0004")  # 2 GiB for an hour at $0.0002 per GiB-hour
    report = usage(sandbox.team, start - timedelta(hours=1), timezone.now(), "label:case")
    assert {line["group"]: line["seconds"] for line in report["lines"]} == {"kept": 3600.0}
    assert usage(sandbox.team, start - timedelta(hours=1), timezone.now())["lines"][0]["group"] == "saved_state"


PLAIN_AMOUNT = r"^\d+\.\d{8}$"  # "decimal strings in USD" (GET /usage's own description)


def test_usage_amounts_are_plain_decimal_strings(sandbox):
    empty = usage(sandbox.team, timezone.now() - timedelta(days=1), timezone.now())
    start = datetime(2026, 11, 3, 9, 0, tzinfo=UTC)
    usage_transition(sandbox=sandbox, kind="running", at=start)
    usage_transition(sandbox=sandbox, kind=None, at=start + timedelta(milliseconds=3))  # 3 ms of tiny: $0.0000000061
    tiny = usage(sandbox.team, start, start + timedelta(hours=1))
    shown = [empty["total"], tiny["total"], tiny["lines"][0]["amount"]]
    assert Decimal(shown[1]) == expected(3, rate("running", "tiny")) == Decimal("0.00000001")
    assert all(re.match(PLAIN_AMOUNT, amount) for amount in shown), shown
