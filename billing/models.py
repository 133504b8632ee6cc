"""Metering: prices as data, usage from lifecycle transitions, never sampled.

Every sandbox has at most one open usage period (a partial unique index says
so); a transition closes the open one and opens the next.  Durations are
integer milliseconds; amounts are Decimal, rounded once per line.
"""

from __future__ import annotations

from decimal import Decimal

from django.db import models
from django.utils import timezone

from console.models import ApiKey, Team, public_id


class Price(models.Model):
    """A rate card line: a size (running), a paused size, saved state, a model's tokens, or a dedicated endpoint.

    Sizes are priced by ``size``; tokens (per million) and dedicated endpoints (per hour) by
    ``model``, where the line whose ``model`` is "" prices every model without a line of its own.
    """

    class Kind(models.TextChoices):
        RUNNING = "running"
        PAUSED = "paused"
        SAVED_STATE = "saved_state"
        INPUT_TOKENS = "input_tokens"  # an inference model's prompt tokens, per million
        OUTPUT_TOKENS = "output_tokens"  # its completion tokens, per million
        ENDPOINT = "endpoint"  # an hour of a dedicated endpoint serving a model
        DISK = "disk"  # a GiB-hour of a sandbox's disk beyond what its size includes, running or paused

    kind = models.CharField(max_length=16, choices=Kind.choices)
    size = models.CharField(max_length=32, blank=True)  # empty for saved state, tokens and endpoints
    # The model a token or endpoint line prices; "" is the line for every model without its own.
    model = models.CharField(max_length=200, blank=True)
    cpu = models.FloatField(null=True, blank=True)
    memory_mib = models.PositiveIntegerField(null=True, blank=True)
    # Per hour for sandboxes and endpoints; per GiB-hour for saved state and extra disk; per million tokens for tokens.
    amount = models.DecimalField(max_digits=14, decimal_places=8)
    currency = models.CharField(max_length=3, default="USD")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["kind", "size", "model"], name="one_price_per_kind_size_and_model")]

    def __str__(self) -> str:
        return f"{self.kind} {self.size or self.model or ''}: {self.amount} {self.currency}"


class UsagePeriod(models.Model):
    class Kind(models.TextChoices):
        RUNNING = "running"
        PAUSED = "paused"
        SAVED_STATE = "saved_state"
        ENDPOINT = "endpoint"  # a dedicated endpoint's model server holding its host (size: the model)

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="usage", db_index=False)
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, db_index=False)
    sandbox = models.ForeignKey(
        "sandboxes.Sandbox", null=True, blank=True, on_delete=models.SET_NULL, related_name="usage", db_index=False
    )
    snapshot = models.ForeignKey(
        "sandboxes.Snapshot", null=True, blank=True, on_delete=models.SET_NULL, related_name="usage", db_index=False
    )
    endpoint = models.ForeignKey(
        "grading.Endpoint", null=True, blank=True, on_delete=models.SET_NULL, related_name="usage", db_index=False
    )
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
    # Why this period was opened, when it was not the sandbox's own doing: "over_budget" (paused
    # by a budget that was reached, see Budget); statements show such periods on a line of their own.
    reason = models.CharField(max_length=16, blank=True, default="")

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
            models.UniqueConstraint(
                fields=["endpoint"],
                condition=models.Q(ended_at__isnull=True, endpoint__isnull=False),
                name="one_open_period_per_endpoint",
            ),
        ]
        indexes = [
            models.Index(fields=["team", "started_at"]),
            models.Index(fields=["team", "ended_at"]),
            # The other foreign keys, plain: no LIKE twin (see sandboxes.Sandbox's), and none for the team
            # (the pairs above lead with it). Each sandbox's period is written twice, each write every index.
            models.Index(fields=["api_key"]),
            models.Index(fields=["sandbox"]),
            models.Index(fields=["snapshot"]),
            models.Index(fields=["endpoint"]),
        ]

    def save(self, *args: object, **kwargs: object) -> None:
        """Keep the epoch-millisecond columns equal to the datetimes, whoever wrote them."""
        self.started_ms = int(self.started_at.timestamp() * 1000)
        self.ended_ms = int(self.ended_at.timestamp() * 1000) if self.ended_at is not None else None
        update_fields = kwargs.get("update_fields")
        if update_fields is not None:
            kwargs["update_fields"] = {*update_fields, "started_ms", "ended_ms"}  # type: ignore[misc]
        super().save(*args, **kwargs)  # type: ignore[arg-type]


class MeteredUsage(models.Model):
    """Usage counted rather than timed: a quantity (tokens) at a unit price, as one statement line kind.

    The one meter of inference tokens: the gateway records one row per call and kind after the
    call answered (``billing.services.tokens_metered``, written by ``grading.services``): ``kind``
    is a ``Price.Kind`` of tokens, ``item`` the model, ``unit_price`` its price per million tokens
    on the rate card when the call was made (0 through the team's own dedicated endpoint, whose
    seconds are what it pays for), ``amount`` rounded once per row.  Statements, budgets, the
    usage API and the usage page all read these rows; none holds what was said.
    """

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="metered_usage")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL)
    kind = models.CharField(max_length=16)
    item = models.CharField(max_length=200)  # the model
    quantity = models.BigIntegerField()  # tokens
    unit_price = models.DecimalField(max_digits=14, decimal_places=8)  # per million
    amount = models.DecimalField(max_digits=16, decimal_places=8)
    labels = models.JSONField(default=dict)
    at = models.DateTimeField(default=timezone.now)
    at_ms = models.BigIntegerField(default=0)

    class Meta:
        indexes = [models.Index(fields=["team", "at_ms"])]

    def save(self, *args: object, **kwargs: object) -> None:
        self.at_ms = int(self.at.timestamp() * 1000)
        super().save(*args, **kwargs)  # type: ignore[arg-type]


def budget_id() -> str:
    return public_id("budget")


class Budget(models.Model):
    """A monthly spending limit for a team, or for one of its keys, or for its sandboxes with a label.

    Spend is what the month's periods cost so far (open ones counted up to now).  At admission a
    create or launch whose cost for its TTL would take spend past ``monthly_limit`` is refused
    (402); when spend reaches it, the sandboxes in its scope are destroyed, or paused and destroyed
    after ``grace_s`` (``over_limit``).  Alerts go out once per month at each of ``alert_percents``.
    """

    class OverLimit(models.TextChoices):
        PAUSE = "pause", "Pause, then destroy after the grace period"
        DESTROY = "destroy", "Destroy at once"

    id = models.CharField(primary_key=True, max_length=32, default=budget_id, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="budgets")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.CASCADE, related_name="budgets")
    label = models.CharField(max_length=320, blank=True)  # "key=value": the sandboxes carrying it
    monthly_limit = models.DecimalField(max_digits=12, decimal_places=2)
    alert_percents = models.JSONField(default=list, blank=True)  # soft thresholds, e.g. [50, 80]
    over_limit = models.CharField(max_length=8, choices=OverLimit.choices, default=OverLimit.PAUSE)
    grace_s = models.PositiveIntegerField(default=3600)
    webhook_url = models.URLField(max_length=500, blank=True)
    notify_emails = models.JSONField(default=list, blank=True)  # beside the team's owners and admins
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["team"], condition=models.Q(api_key__isnull=True, label=""), name="one_team_budget"
            ),
            models.UniqueConstraint(
                fields=["team", "api_key"], condition=models.Q(api_key__isnull=False), name="one_budget_per_key"
            ),
            models.UniqueConstraint(fields=["team", "label"], condition=~models.Q(label=""), name="one_budget_per_label"),
        ]

    def __str__(self) -> str:
        return f"{self.scope} {self.monthly_limit}/month"

    @property
    def scope(self) -> str:
        if self.api_key_id:
            return f"key {self.api_key.name if self.api_key else self.api_key_id}"
        if self.label:
            return f"label {self.label}"
        return "team"

    @property
    def scope_code(self) -> str:
        """The refusal code that names this limit (402 at admission)."""
        return "key_budget_exceeded" if self.api_key_id else "label_budget_exceeded" if self.label else "team_budget_exceeded"

    def label_pair(self) -> tuple[str, str] | None:
        if not self.label:
            return None
        name, _, value = self.label.partition("=")
        return name, value


class BudgetAlert(models.Model):
    """An alert sent for a budget in a month at a percent of its limit (100: reached): once, by a unique constraint."""

    budget = models.ForeignKey(Budget, on_delete=models.CASCADE, related_name="alerts")
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="budget_alerts")
    month = models.DateField()  # its first day
    percent = models.PositiveSmallIntegerField()
    spent = models.DecimalField(max_digits=16, decimal_places=8)
    limit = models.DecimalField(max_digits=12, decimal_places=2)
    at = models.DateTimeField(default=timezone.now)
    emailed_to = models.JSONField(default=list, blank=True)
    webhook_status = models.CharField(max_length=64, blank=True)  # "200", "error: ...", "" (none set)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["budget", "month", "percent"], name="one_alert_per_threshold")]
        indexes = [models.Index(fields=["team", "at"])]


class BudgetStop(models.Model):
    """A sandbox stopped because a budget was reached: paused (destroyed at ``destroy_at``) or destroyed."""

    class Action(models.TextChoices):
        PAUSED = "paused"
        DESTROYED = "destroyed"

    budget = models.ForeignKey(Budget, null=True, on_delete=models.SET_NULL, related_name="stops")
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="budget_stops")
    sandbox = models.ForeignKey("sandboxes.Sandbox", on_delete=models.CASCADE, related_name="budget_stops")
    scope = models.CharField(max_length=400)  # the budget's, as it was: "team", "key trainer", ...
    limit = models.DecimalField(max_digits=12, decimal_places=2)
    action = models.CharField(max_length=10, choices=Action.choices)
    at = models.DateTimeField(default=timezone.now)
    destroy_at = models.DateTimeField(null=True, blank=True)  # paused: the end of its grace
    destroyed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["sandbox"], name="one_budget_stop_per_sandbox")]
        indexes = [models.Index(fields=["team", "at"]), models.Index(fields=["destroy_at"])]
