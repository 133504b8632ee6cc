"""Metering writes: open and close usage periods at lifecycle transitions, and count tokens.

A transition closes the sandbox's open period (if any) and opens the next in
one transaction; the partial unique index ``one_open_period_per_sandbox``
guarantees there is never more than one open, whatever races.  Durations are
integer milliseconds; amounts are Decimal, rounded once per period.  A
dedicated endpoint's time is a period too (``endpoint_transition``); tokens
through the inference gateway are counted rows (``MeteredUsage``: the one
meter that statements, budgets and the usage API and page read), priced per
million from the rate card by model (``model_price``).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal
from typing import TYPE_CHECKING

from django.db import IntegrityError, transaction

from console.db import insert_each, update_each
from sandboxes.engine.sizes import DEFAULT_SIZES, included_disk_mib

from .models import MeteredUsage, Price, UsagePeriod

if TYPE_CHECKING:  # for types only: billing does not depend on the sandboxes or grading apps at run time
    from grading.models import Endpoint
    from sandboxes.models import Sandbox, Snapshot

MS_PER_HOUR = Decimal(3_600_000)
TOKENS_PER_UNIT = Decimal(1_000_000)  # a model's price is per million tokens
AMOUNT_QUANTUM = Decimal("0.00000001")
GIB = Decimal(2**30)
GIB_QUANTUM = Decimal("0.000001")  # UsagePeriod.quantity_gib keeps six places
# The shipped sizes' shapes are the engine's own table (see sandboxes/sizes.py).
TINY, DEFAULT = DEFAULT_SIZES["tiny"], DEFAULT_SIZES["default"]
DEFAULT_PRICES = [
    # (kind, size, cpu, memory_mib, amount per hour, or per GiB-hour for saved state)
    (Price.Kind.RUNNING, "tiny", TINY.cpu, TINY.memory_mib, Decimal("0.0073125")),
    (Price.Kind.RUNNING, "default", DEFAULT.cpu, DEFAULT.memory_mib, Decimal("0.018")),
    (Price.Kind.PAUSED, "tiny", TINY.cpu, TINY.memory_mib, Decimal("0.0003")),
    (Price.Kind.PAUSED, "default", DEFAULT.cpu, DEFAULT.memory_mib, Decimal("0.0012")),
    (Price.Kind.SAVED_STATE, "", None, None, Decimal("0.0002")),
    # Disk a create asks for beyond its size's own (tiny 1 GiB, default 10 GiB), per GiB-hour while it runs or
    # is paused: the price of saved state.
    (Price.Kind.DISK, "", None, None, Decimal("0.0002")),
]
# Lines for every model without one of its own (an operator adds a model's own line, ``model`` set):
# tokens per million through an operator's upstream, and a dedicated endpoint per hour.  Tokens
# through a team's own dedicated endpoint cost nothing: its seconds are what it pays for.
DEFAULT_MODEL_PRICES = [
    (Price.Kind.INPUT_TOKENS, Decimal("0.15")),
    (Price.Kind.OUTPUT_TOKENS, Decimal("0.60")),
    (Price.Kind.ENDPOINT, Decimal("0.036")),
]
# Explicit sizes are priced per vCPU-hour and per GiB-hour of memory, from the
# default size's card: 2 vCPU + 4 GiB = $0.018/h.
CPU_HOUR = Decimal("0.0065")
MEMORY_GIB_HOUR = Decimal("0.00125")


def install_default_prices() -> int:
    created = 0
    for kind, size, cpu, memory_mib, amount in DEFAULT_PRICES:
        _, made = Price.objects.get_or_create(
            kind=kind, size=size, defaults={"cpu": cpu, "memory_mib": memory_mib, "amount": amount}
        )
        created += int(made)
    for kind, amount in DEFAULT_MODEL_PRICES:
        _, made = Price.objects.get_or_create(kind=kind, size="", model="", defaults={"amount": amount})
        created += int(made)
    return created


def model_price(kind: str, model: str) -> Decimal:
    """A model's price for ``kind`` (per million tokens, or per hour of an endpoint): its own line, else the
    line for every model, else nothing."""
    lines = dict(Price.objects.filter(kind=kind, size="", model__in=[model, ""]).values_list("model", "amount"))
    price = lines.get(model, lines.get(""))
    return Decimal(price) if price is not None else Decimal(0)


def hourly_price(kind: str, size: str, cpu: float, memory_mib: int, disk_mib: int = 0) -> Decimal:
    """A sandbox's price per hour: its size's line (or an explicit shape's, per vCPU and GiB), and for a
    running or paused one with a disk larger than its size's (``disk_mib``), the rate card's disk line for
    each GiB more."""
    price = Price.objects.filter(kind=kind, size=size, model="").values_list("amount", flat=True).first()
    if price is not None:
        hourly = Decimal(price)
    else:
        running = (Decimal(str(cpu)) * CPU_HOUR + Decimal(memory_mib) / Decimal(1024) * MEMORY_GIB_HOUR).quantize(AMOUNT_QUANTUM)
        hourly = running if kind == Price.Kind.RUNNING else (running / 20).quantize(AMOUNT_QUANTUM)
    extra_mib = max(0, disk_mib - included_disk_mib(size, cpu, memory_mib)) if disk_mib else 0
    if extra_mib and kind in (Price.Kind.RUNNING, Price.Kind.PAUSED):
        disk = Price.objects.filter(kind=Price.Kind.DISK, size="", model="").values_list("amount", flat=True).first()
        if disk is not None:
            hourly = (hourly + Decimal(disk) * Decimal(extra_mib) / Decimal(1024)).quantize(AMOUNT_QUANTUM)
    return hourly


def gib_of(size_bytes: int) -> Decimal:
    """Saved state's billed quantity: a layer's size in GiB, to the places a period keeps."""
    return (Decimal(size_bytes) / GIB).quantize(GIB_QUANTUM)


def amount_for(duration_ms: int, unit_price: Decimal, quantity: Decimal = Decimal(1)) -> Decimal:
    return (Decimal(duration_ms) * unit_price * quantity / MS_PER_HOUR).quantize(AMOUNT_QUANTUM, rounding=ROUND_HALF_UP)


CLOSED_FIELDS = ["ended_at", "ended_ms", "duration_ms", "amount"]


def _ended(period: UsagePeriod, at: datetime) -> UsagePeriod:
    """The period's end fields set for ``at`` (never before it started), not yet saved."""
    ended = max(at, period.started_at)
    period.ended_at = ended
    period.ended_ms = int(ended.timestamp() * 1000)
    period.duration_ms = max(0, period.ended_ms - int(period.started_at.timestamp() * 1000))
    period.amount = amount_for(period.duration_ms, period.unit_price, period.quantity_gib)
    return period


def _close(period: UsagePeriod, at: datetime) -> UsagePeriod:
    _ended(period, at).save(update_fields=CLOSED_FIELDS)
    return period


@transaction.atomic
def usage_transition(*, sandbox: Sandbox, kind: str | None, at: datetime, reason: str = "") -> UsagePeriod | None:
    """Close the sandbox's open period at ``at``; open one of ``kind`` (None: nothing more to bill).
    ``reason``: why the next period opens when it is not the sandbox's own doing (``"over_budget"``)."""
    current = UsagePeriod.objects.select_for_update().filter(sandbox=sandbox, ended_at__isnull=True).first()
    if current is not None:
        if current.kind == kind:
            return current  # a replay of the same transition
        _close(current, at)
    if kind is None:
        return None
    try:
        with transaction.atomic():
            return UsagePeriod.objects.create(
                team_id=sandbox.team_id,
                api_key_id=sandbox.api_key_id,
                sandbox=sandbox,
                kind=kind,
                size=sandbox.size or "custom",
                labels=sandbox.labels,
                unit_price=hourly_price(kind, sandbox.size, sandbox.cpu, sandbox.memory_mib, sandbox.disk_mib),
                started_at=at,
                reason=reason,
            )
    except IntegrityError:
        # Someone else opened it between our read and write: theirs stands.
        return UsagePeriod.objects.filter(sandbox=sandbox, ended_at__isnull=True).first()


def close_periods(ended: dict[str, datetime]) -> int:
    """Close the open periods of many sandboxes that ended, each at its own time, in one update (a
    teardown ends hundreds at once). Call inside the transaction that moved them; how many closed."""
    periods = list(
        UsagePeriod.objects.select_for_update().filter(sandbox_id__in=list(ended), ended_at__isnull=True).order_by("pk")
    )
    for period in periods:
        assert period.sandbox_id is not None
        _ended(period, ended[period.sandbox_id])
    update_each(
        UsagePeriod, CLOSED_FIELDS, [(period.pk, [getattr(period, name) for name in CLOSED_FIELDS]) for period in periods]
    )
    return len(periods)


def open_running_periods(sandboxes: Sequence[Sandbox], ready: dict[str, datetime]) -> int:
    """The first running period of sandboxes that just started, in one insert
    (a launch starts hundreds at once). Call inside the transaction that moved
    them to running; one that already has an open period keeps it."""
    return open_periods(sandboxes, ready, kind=UsagePeriod.Kind.RUNNING)


def open_periods(sandboxes: Sequence[Sandbox], at: dict[str, datetime], *, kind: str, reason: str = "") -> int:
    """A period of ``kind`` for each of these sandboxes from its time in ``at``, in one insert; call inside
    the transaction that moved them, after their open periods closed (``close_periods``)."""
    prices: dict[tuple[str, float, int, int], Decimal] = {}
    periods = []
    for sandbox in sandboxes:
        shape = (sandbox.size, sandbox.cpu, sandbox.memory_mib, sandbox.disk_mib)
        if shape not in prices:
            prices[shape] = hourly_price(kind, *shape)
        started = at[sandbox.id]
        periods.append(
            {
                "team_id": sandbox.team_id,
                "api_key_id": sandbox.api_key_id,
                "sandbox_id": sandbox.id,
                "kind": kind,
                "size": sandbox.size or "custom",
                "labels": sandbox.labels,
                "unit_price": prices[shape],
                "started_at": started,
                "started_ms": int(started.timestamp() * 1000),  # save() is not called
                "reason": reason,
            }
        )
    # The partial unique index keeps an existing open period (reconciliation's) and drops ours.
    return insert_each(UsagePeriod, periods)


@transaction.atomic
def saved_state_transition(*, snapshot: Snapshot, gib: Decimal | None, at: datetime) -> UsagePeriod | None:
    """Saved state is billed per GiB-hour from creation to deletion (gib None: deleted)."""
    current = UsagePeriod.objects.select_for_update().filter(snapshot=snapshot, ended_at__isnull=True).first()
    if current is not None:
        _close(current, at)
    if gib is None:
        return None
    return UsagePeriod.objects.create(
        team_id=snapshot.team_id,
        api_key_id=snapshot.api_key_id,
        snapshot=snapshot,
        kind=UsagePeriod.Kind.SAVED_STATE,
        labels=snapshot.labels,
        unit_price=hourly_price(Price.Kind.SAVED_STATE, "", 0, 0),
        quantity_gib=gib,
        started_at=at,
    )


@transaction.atomic
def endpoint_transition(*, endpoint: Endpoint, running: bool, at: datetime) -> UsagePeriod | None:
    """A dedicated endpoint is billed per second while its model server holds its host: open its period
    (``running``) or close it; a replay changes nothing (the partial unique index keeps one open)."""
    current = UsagePeriod.objects.select_for_update().filter(endpoint=endpoint, ended_at__isnull=True).first()
    if current is not None:
        if running:
            return current
        _close(current, at)
        return None
    if not running:
        return None
    try:
        with transaction.atomic():
            return UsagePeriod.objects.create(
                team_id=endpoint.team_id,
                api_key_id=endpoint.api_key_id,
                endpoint=endpoint,
                kind=UsagePeriod.Kind.ENDPOINT,
                size=endpoint.model_id[:32],
                unit_price=model_price(Price.Kind.ENDPOINT, endpoint.model_id),
                started_at=at,
            )
    except IntegrityError:
        return UsagePeriod.objects.filter(endpoint=endpoint, ended_at__isnull=True).first()


# --- counted usage: inference tokens ----------------------------------------------------------------

COUNTED_KINDS = (Price.Kind.INPUT_TOKENS, Price.Kind.OUTPUT_TOKENS)


def token_amount(quantity: int, unit_price: Decimal) -> Decimal:
    """What ``quantity`` tokens cost at ``unit_price`` per million, rounded once."""
    return (Decimal(max(0, quantity)) * unit_price / TOKENS_PER_UNIT).quantize(AMOUNT_QUANTUM, rounding=ROUND_HALF_UP)


def _metered(
    *,
    team_id: str,
    api_key_id: str | None,
    kind: str,
    item: str,
    quantity: int,
    unit_price: Decimal,
    at: datetime,
    labels: dict[str, str] | None = None,
) -> MeteredUsage:
    if kind not in COUNTED_KINDS:
        raise ValueError(f"not a counted kind: {kind}")
    return MeteredUsage(
        team_id=team_id,
        api_key_id=api_key_id,
        kind=kind,
        item=item[:200],
        quantity=max(0, quantity),
        unit_price=unit_price,
        amount=token_amount(quantity, unit_price),
        labels=labels or {},
        at=at,
        at_ms=int(at.timestamp() * 1000),  # bulk_create skips save()
    )


def usage_metered(
    *,
    team_id: str,
    api_key_id: str | None,
    kind: str,
    item: str,
    quantity: int,
    at: datetime,
    labels: dict[str, str] | None = None,
) -> MeteredUsage:
    """Counted usage, one statement line kind: ``quantity`` tokens of ``kind`` (``Price.Kind.INPUT_TOKENS`` or
    ``OUTPUT_TOKENS``) of model ``item``, priced from the rate card now (``model_price``), rounded once."""
    row = _metered(
        team_id=team_id,
        api_key_id=api_key_id,
        kind=kind,
        item=item,
        quantity=quantity,
        unit_price=model_price(kind, item),
        at=at,
        labels=labels,
    )
    row.save(force_insert=True)
    return row


def tokens_metered(
    *,
    team_id: str,
    api_key_id: str | None,
    model: str,
    input_tokens: int,
    output_tokens: int,
    billed: bool,
    at: datetime,
    prices: dict[tuple[str, str], Decimal] | None = None,
) -> list[MeteredUsage]:
    """The meter's rows (not saved: the gateway writes a batch of calls at once) of one call's tokens, one per
    kind with a count; ``billed`` False (the team's own dedicated endpoint) prices them at nothing.
    ``prices``: the rate card lines already read for this batch, filled as they are read."""
    prices = prices if prices is not None else {}
    rows = []
    for kind, quantity in ((Price.Kind.INPUT_TOKENS, input_tokens), (Price.Kind.OUTPUT_TOKENS, output_tokens)):
        if quantity <= 0:
            continue
        if billed and (kind, model) not in prices:
            prices[(kind, model)] = model_price(kind, model)
        unit_price = prices[(kind, model)] if billed else Decimal(0)
        rows.append(
            _metered(
                team_id=team_id, api_key_id=api_key_id, kind=kind, item=model, quantity=quantity, unit_price=unit_price, at=at
            )
        )
    return rows


def metered_record(rows: Sequence[MeteredUsage]) -> int:
    """Write rows made by ``tokens_metered`` (inside the caller's transaction); how many."""
    return len(MeteredUsage.objects.bulk_create(rows))
