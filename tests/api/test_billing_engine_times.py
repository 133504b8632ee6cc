"""Billing through the real stack follows the engine's clock: from the moment the engine had the sandbox
ready (not the request), to the moment the engine ended it (its TTL here; not when the control plane
noticed), for exactly the price an independent calculation gives.

The expected amount is computed here from the API's own `ready_at`/`ended_at` and the rate card: the
ends as whole epoch milliseconds, their difference times the hourly price / 3,600,000, rounded half up to
8 places (ARCHITECTURE.md, "Billing"); never by asking `billing.services`.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import pytest

pytestmark = pytest.mark.root

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
TTL_S = 3


def epoch_ms(moment: datetime) -> int:
    return (moment - EPOCH) // timedelta(milliseconds=1)


def expected(milliseconds: int, per_hour: Decimal) -> Decimal:
    return (Decimal(milliseconds) * per_hour / Decimal(3_600_000)).quantize(Decimal("0.00000001"), rounding=ROUND_HALF_UP)


def moment(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def engine_moment(epoch_s: float) -> datetime:
    """The engine keeps times as epoch seconds (a float); the control plane stores them to the microsecond."""
    return datetime.fromtimestamp(epoch_s, tz=UTC)


def periods_of(stack: Any, sandbox_id: str) -> list[dict[str, Any]]:
    """The sandbox's billed periods, straight from the database."""
    code = (
        "import json; from billing.models import UsagePeriod; "
        f"rows = UsagePeriod.objects.filter(sandbox_id={sandbox_id!r}).order_by('started_at'); "
        "print(json.dumps([{'kind': r.kind, 'size': r.size, 'unit_price': str(r.unit_price), 'started_at': r.started_at.isoformat(), "
        "'ended_at': r.ended_at and r.ended_at.isoformat(), 'duration_ms': r.duration_ms, 'amount': str(r.amount)} for r in rows]))"
    )
    return list(json.loads(stack.shell(code).strip().splitlines()[-1]))


def rate_card(stack: Any) -> dict[str, Decimal]:
    code = (
        "import json; from billing.models import Price; "
        "print(json.dumps({f'{p.kind}:{p.size}': str(p.amount) for p in Price.objects.all()}))"
    )
    return {name: Decimal(amount) for name, amount in json.loads(stack.shell(code).strip().splitlines()[-1]).items()}


def test_a_sandbox_ended_by_its_ttl_is_billed_from_the_engines_ready_time_to_its_end(stack, api):
    prices = rate_card(stack)
    assert prices["running:default"] == Decimal("0.018"), "PRODUCT.md's price for the default size"
    case = f"ttl-{uuid.uuid4().hex[:8]}"
    # The default size has no warm pool in the test stack: a cold create, so the engine's ready time
    # comes measurably after the request.
    response = api.post(
        "/api/v1/sandboxes", json={"template": "base", "size": "default", "ttl_s": TTL_S, "labels": {"case": case}}
    )
    assert response.status_code == 201, response.text
    sandbox = response.json()
    with stack.engine.client() as engine:
        [record] = [record for record in engine.list() if record.get("key") == sandbox["id"]]
    assert record["state"] == "running"

    deadline = time.monotonic() + 60  # a guard against a hang: a TTL of 3 s ends within seconds
    while (current := api.get(f"/api/v1/sandboxes/{sandbox['id']}").json())["state"] not in ("destroyed", "stopped"):
        assert time.monotonic() < deadline, f"the sandbox outlived its TTL of {TTL_S} s: {current}"
        time.sleep(0.2)
    with stack.engine.client() as engine:
        tombstone = engine.get(record["id"])
    assert (tombstone["state"], tombstone["reason"]) == ("destroyed", "ttl expired"), tombstone
    assert current["state"] == "destroyed"

    created, ready, ended = moment(current["created_at"]), moment(current["ready_at"]), moment(current["ended_at"])
    # The times the API shows (to the millisecond) are the engine's own.
    engine_ready, engine_ended = engine_moment(tombstone["ready_at"]), engine_moment(tombstone["ended_at"])
    assert (epoch_ms(ready), epoch_ms(ended)) == (epoch_ms(engine_ready), epoch_ms(engine_ended))
    assert created < ready, "the request came before the engine had it ready"
    # The TTL ended it, not anything earlier: its end is at or after the engine's expiry.
    assert tombstone["ended_at"] >= tombstone["expires_at"] and tombstone["expires_at"] - tombstone[
        "created_at"
    ] == pytest.approx(TTL_S)

    # One period, from the engine's ready time to its end time, for the amount computed here.
    milliseconds = epoch_ms(ended) - epoch_ms(ready)
    assert milliseconds >= (TTL_S - 1) * 1000
    [period] = periods_of(stack, sandbox["id"])
    assert (period["kind"], period["size"], Decimal(period["unit_price"])) == ("running", "default", prices["running:default"])
    # (the database keeps microseconds: the engine's times exactly)
    assert moment(period["started_at"]) == engine_ready, "billing starts when the engine had it ready, not at the request"
    assert moment(period["ended_at"]) == engine_ended, (
        "billing stops when the engine ended it, not when the control plane noticed"
    )
    assert period["duration_ms"] == milliseconds
    amount = expected(milliseconds, prices["running:default"])
    assert Decimal(period["amount"]) == amount

    # The API's usage says the same, and nothing before ready or after the end is billed.
    def billed(start: datetime, end: datetime) -> list[dict[str, Any]]:
        lines = api.get(
            "/api/v1/usage", params={"group_by": "label:case", "start": start.isoformat(), "end": end.isoformat()}
        ).json()["lines"]
        return [line for line in lines if line["group"] == case]

    [line] = billed(created - timedelta(minutes=1), ended + timedelta(minutes=1))
    assert (Decimal(line["amount"]), line["seconds"], line["periods"]) == (amount, round(milliseconds / 1000, 3), 1)

    def nothing(lines: list[dict[str, Any]]) -> bool:
        return all(line["seconds"] == 0 and Decimal(line["amount"]) == 0 for line in lines)

    if epoch_ms(ready) > epoch_ms(created):
        assert nothing(billed(created, ready)), "billed between the request and the engine's ready time"
    time.sleep(1.5)  # a period left open would have grown by now
    assert nothing(billed(ended, ended + timedelta(minutes=1))), "billed after the sandbox was gone"
    [again] = billed(created - timedelta(minutes=1), datetime.now(UTC) + timedelta(minutes=1))
    assert Decimal(again["amount"]) == amount
