"""Metering: periods from transitions, exact money, one open period per sandbox."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import IntegrityError, transaction
from django.utils import timezone

from billing.models import UsagePeriod
from billing.selectors import usage
from billing.services import amount_for, install_default_prices, usage_transition
from console.keys import api_key_create
from console.services import team_create
from sandboxes.models import Sandbox

pytestmark = pytest.mark.django_db


@pytest.fixture
def sandbox():
    install_default_prices()
    team = team_create(name="Billing Co")
    key = api_key_create(team=team, name="k").key
    return Sandbox.objects.create(team=team, api_key=key, template="base", size="tiny", cpu=1, memory_mib=128, ttl_s=60)


def test_amounts_are_exact_and_rounded_once():
    assert amount_for(3_600_000, Decimal("0.0073125")) == Decimal("0.00731250")
    assert amount_for(1, Decimal("0.018")) == Decimal("0.00000001")  # half up, at the last place
    assert amount_for(0, Decimal("0.018")) == Decimal("0")


def test_transitions_close_and_open_periods(sandbox):
    start = timezone.now()
    usage_transition(sandbox=sandbox, kind="running", at=start)
    usage_transition(sandbox=sandbox, kind="running", at=start + timedelta(seconds=5))  # a replay: nothing new
    usage_transition(sandbox=sandbox, kind="paused", at=start + timedelta(seconds=10))
    usage_transition(sandbox=sandbox, kind=None, at=start + timedelta(seconds=70))
    periods = list(UsagePeriod.objects.filter(sandbox=sandbox).order_by("started_at"))
    assert [(p.kind, p.duration_ms) for p in periods] == [("running", 10_000), ("paused", 60_000)]
    assert periods[0].amount == amount_for(10_000, Decimal("0.0073125"))
    assert periods[1].amount == amount_for(60_000, Decimal("0.0003"))
    report = usage(sandbox.team, start - timedelta(hours=1), start + timedelta(hours=1))
    assert Decimal(report["total"]) == periods[0].amount + periods[1].amount
    assert {line["group"]: line["seconds"] for line in report["lines"]} == {"running:tiny": 10.0, "paused:tiny": 60.0}


def test_the_database_refuses_a_second_open_period(sandbox):
    usage_transition(sandbox=sandbox, kind="running", at=timezone.now())
    with pytest.raises(IntegrityError), transaction.atomic():
        UsagePeriod.objects.create(team=sandbox.team, sandbox=sandbox, kind="running", unit_price=Decimal(1), started_at=timezone.now())


def test_usage_clips_periods_to_the_window(sandbox):
    start = timezone.now() - timedelta(hours=2)
    usage_transition(sandbox=sandbox, kind="running", at=start)
    usage_transition(sandbox=sandbox, kind=None, at=start + timedelta(hours=2))
    window = usage(sandbox.team, start + timedelta(hours=1), start + timedelta(hours=3))
    assert window["lines"][0]["seconds"] == 3600.0
    assert Decimal(window["total"]) == amount_for(3_600_000, Decimal("0.0073125"))


def test_explicit_sizes_are_priced_from_their_shape(sandbox):
    sandbox.size, sandbox.cpu, sandbox.memory_mib = "", 2.0, 4096
    sandbox.save()
    period = usage_transition(sandbox=sandbox, kind="running", at=timezone.now())
    assert period.unit_price == Decimal("0.018")  # the same as the default size's card


def test_saved_state_is_billed_per_gib_hour_until_deleted_and_grouped_by_label(sandbox):
    from billing.services import saved_state_transition
    from sandboxes.models import Snapshot

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
