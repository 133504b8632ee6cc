"""Monthly statements: their total is the sum of the month's periods, to the cent and in fact exactly,
however the lines are grouped (by kind and size, by key, by label), as JSON and as CSV.

Expected amounts are computed here from the rule the product promises (ARCHITECTURE.md, "Billing"):
a period's milliseconds inside the month (an open one up to the moment asked), times its hourly
price (and GiB), over 3,600,000, rounded half up to 8 places once per period. Periods are made
directly, at moments the test picks (time moved), some wholly inside the month, some crossing its
start or its end, some still open, saved state with its GiB; and inference tokens counted at the
rate card's price per million.
"""

from __future__ import annotations

import csv
import io
import random
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

import pytest

from billing.models import Price, UsagePeriod
from billing.services import install_default_prices, usage_metered
from billing.statements import as_csv, as_dict, statement
from console.keys import api_key_create
from console.services import team_create

pytestmark = pytest.mark.django_db

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MONTH_START = datetime(2026, 11, 1, tzinfo=UTC)
MONTH_END = datetime(2026, 12, 1, tzinfo=UTC)
NOW = datetime(2026, 11, 25, 12, 0, 0, 500_000, tzinfo=UTC)  # the moment the statement is asked for
PRICES = {("running", "tiny"): Decimal("0.0073125"), ("running", "default"): Decimal("0.018"), ("paused", "tiny"): Decimal("0.0003")}


def ms(moment: datetime) -> int:
    return (moment - EPOCH) // timedelta(milliseconds=1)


def expected(milliseconds: int, per_hour: Decimal, gib: Decimal = Decimal(1)) -> Decimal:
    return (Decimal(milliseconds) * per_hour * gib / Decimal(3_600_000)).quantize(Decimal("0.00000001"), rounding=ROUND_HALF_UP)


def clipped(start: datetime, end: datetime | None) -> int:
    return max(0, min(ms(end) if end else ms(NOW), ms(MONTH_END), ms(NOW)) - max(ms(start), ms(MONTH_START)))


def test_a_statements_total_is_the_sum_of_its_periods_however_grouped() -> None:
    install_default_prices()
    team = team_create(name="Statement Co")
    trainer, evaluator = (api_key_create(team=team, name=name).key for name in ("trainer", "evaluator"))
    other_team = team_create(name="Someone else")
    chance = random.Random(20261125)
    owed = Decimal(0)
    for index in range(120):
        kind, size = chance.choice(list(PRICES))
        where = chance.random()
        if where < 0.6:  # wholly inside the month, closed
            start = MONTH_START + timedelta(milliseconds=chance.randrange(0, ms(NOW) - ms(MONTH_START) - 3_600_000))
            end: datetime | None = start + timedelta(milliseconds=chance.randrange(1, 3_600_000))
        elif where < 0.75:  # from last month into this one
            start = MONTH_START - timedelta(milliseconds=chance.randrange(1, 86_400_000))
            end = MONTH_START + timedelta(milliseconds=chance.randrange(1, 86_400_000))
        elif where < 0.85:  # still open: counted up to NOW
            start = NOW - timedelta(milliseconds=chance.randrange(1, 86_400_000))
            end = None
        else:  # outside it altogether
            start = MONTH_END + timedelta(hours=chance.randrange(1, 48))
            end = start + timedelta(hours=1)
        key = trainer if index % 3 else evaluator
        period = UsagePeriod(
            team=team, api_key=key, kind=kind, size=size, labels={"project": chance.choice(["rl", "eval"])} if index % 4 else {},
            unit_price=PRICES[(kind, size)], started_at=start, ended_at=end,
        )
        if end is not None:
            period.duration_ms = ms(end) - ms(start)
            period.amount = expected(period.duration_ms, period.unit_price)
        period.save()
        owed += expected(clipped(start, end), PRICES[(kind, size)])
    # Saved state: GiB-hours, one closed inside, one open.
    gib = Decimal("1.534211")
    for start, end in ((MONTH_START + timedelta(days=2), MONTH_START + timedelta(days=3, minutes=7)), (NOW - timedelta(hours=5), None)):
        period = UsagePeriod(
            team=team, api_key=trainer, kind="saved_state", size="", unit_price=Decimal("0.0002"), quantity_gib=gib,
            started_at=start, ended_at=end,
        )
        if end is not None:
            period.duration_ms = ms(end) - ms(start)
            period.amount = expected(period.duration_ms, period.unit_price, gib)
        period.save()
        owed += expected(clipped(start, end), Decimal("0.0002"), gib)
    # Inference tokens, priced per million from the rate card (the meter the gateway writes).
    Price.objects.create(kind="input_tokens", model="judge-small", amount=Decimal("0.25"))  # its own line, not the default
    Price.objects.create(kind="output_tokens", model="judge-small", amount=Decimal("1.10"))
    for tokens, kind in ((123_457, "input_tokens"), (9_999, "output_tokens"), (1_000_001, "input_tokens")):
        usage_metered(team_id=team.pk, api_key_id=evaluator.pk, kind=kind, item="judge-small", quantity=tokens, at=NOW - timedelta(hours=1))
        owed += (Decimal(tokens) * Price.objects.get(kind=kind, model="judge-small").amount / 1_000_000).quantize(Decimal("0.00000001"), rounding=ROUND_HALF_UP)
    UsagePeriod.objects.create(  # another team's: never on this statement
        team=other_team, kind="running", size="tiny", unit_price=Decimal(1000), started_at=MONTH_START + timedelta(days=1)
    )

    found = statement(team, "2026-11", label_keys=["project"], now=NOW)
    assert found.total == owed, "exactly the sum of the periods' amounts"
    assert found.total.quantize(Decimal("0.01")) == owed.quantize(Decimal("0.01"))
    assert sum((amount for _, amount in found.by_key), Decimal(0)) == owed
    assert sum((amount for _, amount in found.by_label["project"]), Decimal(0)) == owed
    assert {name for name, _ in found.by_key} == {"trainer", "evaluator"}
    assert {value for value, _ in found.by_label["project"]} <= {"rl", "eval", "(none)"}
    kinds = {line.kind for line in found.lines}
    assert {"running", "paused", "saved_state", "input_tokens", "output_tokens"} <= kinds
    [output] = [line for line in found.lines if line.kind == "output_tokens"]
    assert (output.item, output.quantity, output.unit, output.count) == ("judge-small", 9_999, "tokens", 1)
    [saved] = [line for line in found.lines if line.kind == "saved_state"]
    assert saved.unit == "GiB-hours" and saved.count == 2

    # The API's JSON and the CSV say the same total.
    assert Decimal(as_dict(found)["total"]) == owed
    rows = list(csv.reader(io.StringIO(as_csv(found))))
    assert rows[0] == ["section", "kind", "item", "quantity", "unit", "unit_price", "amount", "currency"]
    [total] = [row for row in rows if row[0] == "total"]
    assert Decimal(total[6]) == owed
    assert sum(Decimal(row[6]) for row in rows if row[0] == "line") == owed
    assert sum(Decimal(row[6]) for row in rows if row[0] == "key") == owed


def test_a_past_month_is_complete_and_a_future_one_empty() -> None:
    install_default_prices()
    team = team_create(name="Quiet Co")
    past = statement(team, "2026-10", now=NOW)
    assert past.complete and past.total == 0 and past.lines == []
    assert not statement(team, "2026-11", now=NOW).complete
