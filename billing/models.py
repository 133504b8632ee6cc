"""Metering: prices as data, usage from lifecycle transitions, never sampled.

Every sandbox has at most one open usage period (a partial unique index says
so); a transition closes the open one and opens the next.  Durations are
integer milliseconds; amounts are Decimal, rounded once per line.
"""

from __future__ import annotations

from decimal import Decimal

from django.db import models
from django.utils import timezone

from console.models import ApiKey, Team


class Price(models.Model):
    """A rate card line: a size (running), a paused size, or saved state."""

    class Kind(models.TextChoices):
        RUNNING = "running"
        PAUSED = "paused"
        SAVED_STATE = "saved_state"

    kind = models.CharField(max_length=12, choices=Kind.choices)
    size = models.CharField(max_length=32, blank=True)  # empty for saved state
    cpu = models.FloatField(null=True, blank=True)
    memory_mib = models.PositiveIntegerField(null=True, blank=True)
    # Per hour for sandboxes; per GiB-hour for saved state.
    amount = models.DecimalField(max_digits=14, decimal_places=8)
    currency = models.CharField(max_length=3, default="USD")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["kind", "size"], name="one_price_per_kind_and_size")]

    def __str__(self) -> str:
        return f"{self.kind} {self.size or ''}: {self.amount} {self.currency}"


class UsagePeriod(models.Model):
    class Kind(models.TextChoices):
        RUNNING = "running"
        PAUSED = "paused"
        SAVED_STATE = "saved_state"

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="usage")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL)
    sandbox = models.ForeignKey("sandboxes.Sandbox", null=True, blank=True, on_delete=models.SET_NULL, related_name="usage")
    snapshot = models.ForeignKey("sandboxes.Snapshot", null=True, blank=True, on_delete=models.SET_NULL, related_name="usage")
    kind = models.CharField(max_length=12, choices=Kind.choices)
    size = models.CharField(max_length=32, blank=True)
    labels = models.JSONField(default=dict)
    # The price in force when the period opened, per hour (or per GiB-hour);
    # for saved state, the GiB it holds.
    unit_price = models.DecimalField(max_digits=14, decimal_places=8)
    quantity_gib = models.DecimalField(max_digits=14, decimal_places=6, default=Decimal(1))
    started_at = models.DateTimeField()
    # started_at as epoch milliseconds: lets the database sum open periods'
    # running time on every backend (the board's "cost so far").
    started_ms = models.BigIntegerField(default=0)
    ended_at = models.DateTimeField(null=True, blank=True)
    ended_ms = models.BigIntegerField(null=True, blank=True)  # likewise, for ended periods
    duration_ms = models.BigIntegerField(null=True, blank=True)
    amount = models.DecimalField(max_digits=16, decimal_places=8, null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["sandbox"],
                condition=models.Q(ended_at__isnull=True, sandbox__isnull=False),
                name="one_open_period_per_sandbox",
            ),
            models.UniqueConstraint(
                fields=["snapshot"],
                condition=models.Q(ended_at__isnull=True, snapshot__isnull=False),
                name="one_open_period_per_snapshot",
            ),
        ]
        indexes = [models.Index(fields=["team", "started_at"]), models.Index(fields=["team", "ended_at"])]

    def save(self, *args: object, **kwargs: object) -> None:
        """Keep the epoch-millisecond columns equal to the datetimes, whoever wrote them."""
        self.started_ms = int(self.started_at.timestamp() * 1000)
        self.ended_ms = int(self.ended_at.timestamp() * 1000) if self.ended_at is not None else None
        update_fields = kwargs.get("update_fields")
        if update_fields is not None:
            kwargs["update_fields"] = {*update_fields, "started_ms", "ended_ms"}  # type: ignore[misc]
        super().save(*args, **kwargs)  # type: ignore[arg-type]
