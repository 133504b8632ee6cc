"""Budgets: refused at admission (402), running sandboxes paused or destroyed when spend reaches the
limit, alerts once per threshold, by e-mail and webhook.

Time and prices are moved in the test: the rate card is set high (a tiny sandbox at $36 an hour,
a cent a second), and the enforcement pass is run at a moment the test picks, so that an hour of
spend passes in no time. The engine is the recording fake (tests/support/fake_engine.py), the
database and the transitions are the real ones, the webhook is a real HTTP server on loopback,
and the mail is Django's (its test outbox).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core import mail
from django.utils import timezone

from billing.budgets import BudgetFields, alerts_due, budget_create, require_within
from billing.models import Budget, BudgetAlert, BudgetStop, Price, UsagePeriod
from billing.selectors import budget_spend
from billing.services import endpoint_transition
from billing.statements import statement
from console.errors import OverBudget
from console.keys import api_key_create
from console.models import AuditEntry, Membership, Role
from console.services import team_create
from grading.models import Endpoint, ServedModel
from grading.services import endpoint_create
from sandboxes.commands import Command
from sandboxes.models import Sandbox
from sandboxes.schemas import SandboxCreate
from sandboxes.services.launches import launch_create
from sandboxes.services.sandboxes import sandbox_create
from sandboxes.worker import bring_up
from sandboxes.worker.budgets import enforce_budgets

pytestmark = pytest.mark.django_db(transaction=True)
S = Sandbox.State
PER_HOUR = Decimal("36")  # a cent a second
PAUSED_PER_HOUR = Decimal("3.6")


@pytest.fixture
def prices(key: Any) -> None:
    """The rate card, moved: tiny sandboxes at $36 an hour running, $3.60 paused."""
    Price.objects.filter(kind="running", size="tiny").update(amount=PER_HOUR)
    Price.objects.filter(kind="paused", size="tiny").update(amount=PAUSED_PER_HOUR)


def spec(**fields: Any) -> SandboxCreate:
    return SandboxCreate.model_validate({"template": "base", "size": "tiny", "ttl_s": 600, **fields})


def fields(limit: str, **extra: Any) -> BudgetFields:
    return BudgetFields(monthly_limit=Decimal(limit), alert_percents=extra.pop("alert_percents", []), **extra)


def running_sandboxes(cluster: Any, key: Any, count: int, **labels: str) -> tuple[Any, list[str]]:
    host = cluster.add_host("h1")
    rows = [
        Sandbox.objects.create(
            team=key.team, api_key=key, host=host, template="base", size="tiny", cpu=1.0, memory_mib=128, ttl_s=3600, labels=labels
        )
        for _ in range(count)
    ]
    ids = [row.pk for row in rows]
    assert bring_up.bring_up(host, ids)["running"] == count
    return host, ids


def test_a_create_whose_ttl_would_pass_the_team_budget_is_refused_402(team: Any, key: Any, prices: None, cluster: Any, sent: Any) -> None:
    cluster.add_host("h1")
    budget_create(team=team, fields=fields("1.00"))
    # 600 s at a cent a second is $6: over $1, refused before anything is recorded.
    with pytest.raises(OverBudget) as refused:
        sandbox_create(team=team, key=key, spec=spec(ttl_s=600))
    assert refused.value.code == "team_budget_exceeded"
    assert refused.value.details["limit"] == "1.00" and Decimal(refused.value.details["cost"]) == Decimal(6)
    assert "team budget is $1.00 a month" in refused.value.message
    assert not Sandbox.objects.exists()
    # 60 s is 60 cents: it fits.
    sandbox, created = sandbox_create(team=team, key=key, spec=spec(ttl_s=60))
    assert created and sandbox.state == S.QUEUED
    # A launch counts every sandbox: two of them for 60 s is $1.20, over the $1.
    with pytest.raises(OverBudget):
        launch_create(team=team, key=key, spec=spec(ttl_s=60), count=2)


def test_a_keys_and_a_labels_budget_name_themselves(team: Any, key: Any, prices: None, cluster: Any, sent: Any) -> None:
    cluster.add_host("h1")
    other = api_key_create(team=team, name="evaluator").key
    budget_create(team=team, key=key, fields=fields("0.50"))
    budget_create(team=team, label="project=rl", fields=fields("0.10"))
    with pytest.raises(OverBudget) as by_key:
        sandbox_create(team=team, key=key, spec=spec(ttl_s=60))
    assert by_key.value.code == "key_budget_exceeded" and by_key.value.details["scope"] == "key trainer"
    assert sandbox_create(team=team, key=other, spec=spec(ttl_s=60))[1], "another key's budget is not this one's"
    with pytest.raises(OverBudget) as by_label:
        sandbox_create(team=team, key=other, spec=spec(ttl_s=60, labels={"project": "rl"}))
    assert by_label.value.code == "label_budget_exceeded" and by_label.value.details["scope"] == "label project=rl"


def test_spend_counts_open_periods_up_to_the_moment_asked(team: Any, key: Any, prices: None, cluster: Any, sent: Any) -> None:
    _, ids = running_sandboxes(cluster, key, 2)
    budget = budget_create(team=team, fields=fields("100.00"))
    started = min(period.started_at for period in UsagePeriod.objects.filter(sandbox_id__in=ids))
    later = started + timedelta(minutes=10)
    # Two sandboxes, each at least 10 minutes (the later one a moment less) at $36/h: about $12.
    spent = budget_spend(budget, later)
    assert Decimal("11.9") < spent <= Decimal("12.00")


def test_running_sandboxes_are_paused_when_spend_reaches_the_limit_then_destroyed_after_grace(
    team: Any, key: Any, prices: None, cluster: Any, sent: Any
) -> None:
    host, ids = running_sandboxes(cluster, key, 3)
    outside = Sandbox.objects.create(  # the console's (no key): outside a key's budget
        team=team, api_key=None, host=host, template="base", size="tiny", cpu=1.0, memory_mib=128, ttl_s=3600
    )
    budget = budget_create(team=team, key=key, fields=fields("10.00", over_limit=Budget.OverLimit.PAUSE, grace_s=600))
    engine = cluster.engine(host)
    now = timezone.now()
    assert enforce_budgets(host, now=now + timedelta(seconds=60))["paused"] == 0, "$1.80 of $10: nothing to do"
    # Five minutes on: 3 x 300 s at a cent a second is $9; six minutes: $10.80, past the limit.
    crossed = now + timedelta(minutes=6)
    done = enforce_budgets(host, now=crossed)
    assert done["paused"] == 3
    assert sorted(args["id"] for op, args in engine.calls if op == "pause") == sorted(
        Sandbox.objects.filter(pk__in=ids).values_list("engine_id", flat=True)
    )
    assert set(Sandbox.objects.filter(pk__in=ids).values_list("state", flat=True)) == {S.PAUSED}
    assert engine.running() == [], "the engine itself has them paused"
    for sandbox_id in ids:
        running, paused = UsagePeriod.objects.filter(sandbox_id=sandbox_id).order_by("started_at")
        assert (running.kind, running.ended_at, running.reason) == ("running", crossed, "")
        assert (paused.kind, paused.started_at, paused.ended_at, paused.reason) == ("paused", crossed, None, "over_budget")
        assert paused.unit_price == PAUSED_PER_HOUR, "billed at the paused rate"
        stop = BudgetStop.objects.get(sandbox_id=sandbox_id)
        assert (stop.budget_id, stop.action, stop.destroy_at) == (budget.pk, "paused", crossed + timedelta(seconds=600))
    assert Sandbox.objects.get(pk=outside.pk).state == S.QUEUED, "a sandbox outside the budget's scope is left alone"
    with pytest.raises(OverBudget):  # resuming one is refused while the budget is spent
        require_within(team=team, key_id=key.pk, labels={}, now=crossed)

    # The statement says what was spent past the limit, and why: a line of its own at the paused rate.
    after = crossed + timedelta(minutes=5)
    month = statement(team, crossed.strftime("%Y-%m"), now=after)
    [over] = [line for line in month.lines if line.kind == "paused_over_budget"]
    assert (over.item, over.unit_price, over.count) == ("tiny", PAUSED_PER_HOUR, 3)
    assert over.amount == Decimal("3") * Decimal("300") * PAUSED_PER_HOUR / 3600  # 3 x 5 min at $3.60/h = $0.90
    [(state, past)] = month.past_limits()
    assert state.budget.pk == budget.pk and past > 0
    assert {stop.sandbox_id for stop in month.stops} == set(ids)

    assert enforce_budgets(host, now=crossed + timedelta(seconds=599))["grace_over"] == 0
    assert enforce_budgets(host, now=crossed + timedelta(seconds=601))["grace_over"] == 3
    assert set(Sandbox.objects.filter(pk__in=ids).values_list("state", flat=True)) == {S.STOPPING}
    assert sorted(sum((args[1] for args in sent.named(Command.ENSURE_GONE)), [])) == sorted(ids)


def test_with_destroy_chosen_the_sandboxes_are_destroyed_at_once(team: Any, key: Any, prices: None, cluster: Any, sent: Any) -> None:
    host, ids = running_sandboxes(cluster, key, 2)
    budget_create(team=team, fields=fields("1.00", over_limit=Budget.OverLimit.DESTROY))
    assert enforce_budgets(host, now=timezone.now() + timedelta(minutes=1))["destroyed"] == 2
    assert set(Sandbox.objects.filter(pk__in=ids).values_list("state", flat=True)) == {S.STOPPING}
    assert {stop.action for stop in BudgetStop.objects.filter(sandbox_id__in=ids)} == {"destroyed"}
    assert not [op for op, _ in cluster.engine(host).calls if op == "pause"]


class Hook(BaseHTTPRequestHandler):
    received: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Hook.received.append(json.loads(body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[str]:
    Hook.received = []
    server = HTTPServer(("127.0.0.1", 0), Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/budget"
    server.shutdown()
    server.server_close()


def test_alerts_go_out_once_per_threshold_by_mail_and_webhook(
    team: Any, key: Any, prices: None, cluster: Any, sent: Any, webhook: str
) -> None:
    admin = User.objects.create_user("ada", email="ada@example.com", password="x" * 12)
    Membership.objects.create(team=team, user=admin, role=Role.ADMIN)
    member = User.objects.create_user("mo", email="mo@example.com", password="x" * 12)
    Membership.objects.create(team=team, user=member, role=Role.MEMBER)
    host, _ = running_sandboxes(cluster, key, 1)
    budget = budget_create(
        team=team, fields=fields("6.00", alert_percents=[50, 80], webhook_url=webhook, notify_emails=("billing@example.com",))
    )
    now = timezone.now()
    mail.outbox.clear()
    # A cent a second: $3.60 after 6 minutes is 60 % of $6; twice asked, one alert.
    for _ in range(2):
        enforce_budgets(host, now=now + timedelta(minutes=6))
    assert list(BudgetAlert.objects.filter(budget=budget).values_list("percent", flat=True)) == [50]
    assert len(mail.outbox) == 1 and sorted(mail.outbox[0].to) == ["ada@example.com", "billing@example.com"]
    assert "50% spent" in mail.outbox[0].body
    # 9 minutes: $5.40, 90 %; then 11 minutes: past the limit.
    enforce_budgets(host, now=now + timedelta(minutes=9))
    enforce_budgets(host, now=now + timedelta(minutes=11))
    enforce_budgets(host, now=now + timedelta(minutes=12))
    alerts = list(BudgetAlert.objects.filter(budget=budget).order_by("percent"))
    assert [alert.percent for alert in alerts] == [50, 80, 100]
    assert len(mail.outbox) == 3 and "is reached" in mail.outbox[2].body
    assert [(hook["percent"], hook["reached"], hook["budget"]) for hook in Hook.received] == [
        (50, False, budget.pk),
        (80, False, budget.pk),
        (100, True, budget.pk),
    ]
    assert {alert.webhook_status for alert in alerts} == {"204"}
    reached = AuditEntry.objects.get(team=team, action="budget.reached")
    assert (reached.actor, reached.target_id) == ("forkyard", budget.pk)


def test_alerts_are_recorded_once_even_when_two_agents_run_at_once(team: Any, key: Any, prices: None, cluster: Any, sent: Any) -> None:
    running_sandboxes(cluster, key, 1)
    budget_create(team=team, fields=fields("1.00", alert_percents=[10]))
    moment = timezone.now() + timedelta(minutes=5)
    first, second = alerts_due(moment), alerts_due(moment)
    assert sorted(alert.percent for alert in first) == [10, 100] and second == []
    assert BudgetAlert.objects.count() == 2


def test_a_reached_budget_deletes_the_dedicated_endpoints_it_pays_for(team: Any, key: Any, cluster: Any, sent: Any) -> None:
    """An endpoint is billed per second and cannot be paused: when its team's budget is reached, the host's
    pass deletes it (its engine's server is then removed), and a deploy is refused while it stays reached."""
    host = cluster.add_host("h1")
    Price.objects.create(kind="endpoint", model="judge-model", amount=Decimal("36"))  # a cent a second
    served = ServedModel.objects.create(name="judge-model", path="/models/judge.gguf")
    now = timezone.now()
    mine = Endpoint.objects.create(
        team=team, api_key=key, model=served, name="judge", host=host, state=Endpoint.State.READY, address="http://127.0.0.1:9", token="t"
    )
    endpoint_transition(endpoint=mine, running=True, at=now - timedelta(minutes=5))  # $3 by now
    other_team = team_create(name="Elsewhere")
    theirs = Endpoint.objects.create(team=other_team, model=served, name="judge", host=host, state=Endpoint.State.READY, token="u")
    budget_create(team=team, fields=fields("1.00"))

    counts = enforce_budgets(host, now=now)
    assert counts["endpoints_deleted"] == 1
    mine.refresh_from_db()
    theirs.refresh_from_db()
    assert (mine.state, mine.error_code) == (Endpoint.State.STOPPING, "budget_reached"), mine.error_message
    assert "team budget" in mine.error_message
    assert theirs.state == Endpoint.State.READY, "another team's endpoint is untouched"
    assert sent.named(Command.ENSURE_ENDPOINT_GONE) == [[host.name, mine.pk]]
    # What it cost is on the statement, and the next deploy is refused while the budget stays reached.
    month = statement(team, now=now)
    [line] = [line for line in month.lines if line.kind == "endpoint"]
    assert line.item == "judge-model" and line.amount >= Decimal("3") and line.unit == "endpoint-hours"
    with pytest.raises(OverBudget) as refused:
        endpoint_create(team=team, api_key=key, model=served, name="again")
    assert refused.value.code == "team_budget_exceeded"
    assert "endpoints_deleted" not in enforce_budgets(host, now=now), "a second pass finds nothing more to delete"
