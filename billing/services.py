"""Metering writes: open and close usage periods at lifecycle transitions.

A transition closes the sandbox's open period (if any) and opens the next in
one transaction; the partial unique index ``one_open_period_per_sandbox``
guarantees there is never more than one open, whatever races.  Durations are
integer milliseconds; amounts are Decimal, rounded once per period.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal
from typing import TYPE_CHECKING

from django.db import IntegrityError, transaction

from .models import Price, UsagePeriod

if TYPE_CHECKING:  # for types only: billing does not depend on sandboxes at run time
    from sandboxes.models import Sandbox, Snapshot

MS_PER_HOUR = Decimal(3_600_000)
AMOUNT_QUANTUM = Decimal("0.00000001")
DEFAULT_PRICES = [
    # (kind, size, cpu, memory_mib, amount per hour, or per GiB-hour for saved state)
    (Price.Kind.RUNNING, "tiny", 1.0, 128, Decimal("0.0073125")),
    (Price.Kind.RUNNING, "default", 2.0, 4096, Decimal("0.018")),
    (Price.Kind.PAUSED, "tiny", 1.0, 128, Decimal("0.0003")),
    (Price.Kind.PAUSED, "default", 2.0, 4096, Decimal("0.0012")),
    (Price.Kind.SAVED_STATE, "", None, None, Decimal("0.0002")),
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
    return created


def hourly_price(kind: str, size: str, cpu: float, memory_mib: int) -> Decimal:
    price = Price.objects.filter(kind=kind, size=size).values_list("amount", flat=True).first()
    if price is not None:
        return Decimal(price)
    running = (Decimal(str(cpu)) * CPU_HOUR + Decimal(memory_mib) / Decimal(1024) * MEMORY_GIB_HOUR).quantize(AMOUNT_QUANTUM)
    return running if kind == Price.Kind.RUNNING else (running / 20).quantize(AMOUNT_QUANTUM)


def amount_for(duration_ms: int, unit_price: Decimal, quantity: Decimal = Decimal(1)) -> Decimal:
    return (Decimal(duration_ms) * unit_price * quantity / MS_PER_HOUR).quantize(AMOUNT_QUANTUM, rounding=ROUND_HALF_UP)


def _close(period: UsagePeriod, at: datetime) -> UsagePeriod:
    ended = max(at, period.started_at)
    period.ended_at = ended
    period.ended_ms = int(ended.timestamp() * 1000)
    period.duration_ms = max(0, period.ended_ms - int(period.started_at.timestamp() * 1000))
    period.amount = amount_for(period.duration_ms, period.unit_price, period.quantity_gib)
    period.save(update_fields=["ended_at", "ended_ms", "duration_ms", "amount"])
    return period


@transaction.atomic
def usage_transition(*, sandbox: Sandbox, kind: str | None, at: datetime) -> UsagePeriod | None:
    """Close the sandbox's open period at ``at``; open one of ``kind`` (None: nothing more to bill)."""
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
                unit_price=hourly_price(kind, sandbox.size, sandbox.cpu, sandbox.memory_mib),
                started_at=at,
            )
    except IntegrityError:
        # Someone else opened it between our read and write: theirs stands.
        return UsagePeriod.objects.filter(sandbox=sandbox, ended_at__isnull=True).first()


def open_running_periods(sandboxes: Sequence[Sandbox], ready: dict[str, datetime]) -> int:
    """The first running period of sandboxes that just started, in one insert
    (a launch starts hundreds at once). Call inside the transaction that moved
    them to running; one that already has an open period keeps it."""
    prices: dict[tuple[str, float, int], Decimal] = {}
    periods = []
    for sandbox in sandboxes:
        shape = (sandbox.size, sandbox.cpu, sandbox.memory_mib)
        if shape not in prices:
            prices[shape] = hourly_price(Price.Kind.RUNNING, *shape)
        at = ready[sandbox.id]
        periods.append(
            UsagePeriod(
                team_id=sandbox.team_id,
                api_key_id=sandbox.api_key_id,
                sandbox_id=sandbox.id,
                kind=UsagePeriod.Kind.RUNNING,
                size=sandbox.size or "custom",
                labels=sandbox.labels,
                unit_price=prices[shape],
                started_at=at,
                started_ms=int(at.timestamp() * 1000),  # bulk_create skips save()
            )
        )
    # The partial unique index keeps an existing open period (reconciliation's) and drops ours.
    return len(UsagePeriod.objects.bulk_create(periods, ignore_conflicts=True))


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
