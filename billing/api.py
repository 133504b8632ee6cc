"""``/usage`` (what the team used and what it costs; a month's statement, as JSON or CSV) and ``/budgets``."""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from ninja import Router, Schema
from ninja.params.functions import Query
from pydantic import ConfigDict, Field

from console.api_base import ERRORS, QueryTime, key_of
from console.audit import Actor
from console.db import db
from console.errors import invalid, not_found
from console.models import ApiKey

from . import budgets, selectors, statements
from .models import Budget
from .selectors import usage

router = Router(tags=["usage"])
# A label key (as sandboxes' labels have them), and up to five of them, comma-separated.
LABEL_KEY = r"[A-Za-z0-9][A-Za-z0-9_.\-/]{0,62}"
LABEL_KEYS = rf"^{LABEL_KEY}(,{LABEL_KEY}){{0,4}}$"


class UsageLine(Schema):
    group: str
    seconds: float
    amount: str
    periods: int


class StatementLine(Schema):
    kind: str = Field(description="running, paused, paused_over_budget, saved_state, endpoint, input_tokens, output_tokens")
    title: str
    item: str = Field(description="the size, or the model (endpoints, tokens); empty for saved state")
    unit: str = Field(description="what quantity counts: sandbox-hours, GiB-hours, endpoint-hours or tokens")
    quantity: str
    unit_price: str = Field(description="per hour, per GiB-hour, or per million tokens")
    amount: str
    count: int = Field(description="periods, or calls")


class KeyAmount(Schema):
    key: str
    amount: str


class LabelAmount(Schema):
    value: str
    amount: str


class BudgetSpend(Schema):
    id: str
    scope: str
    limit: str
    spent: str
    reached: bool


class BudgetStopOut(Schema):
    sandbox: str
    scope: str
    action: str
    at: datetime
    destroy_at: datetime | None


class StatementOut(Schema):
    month: str
    start: datetime
    end: datetime
    as_of: datetime = Field(description="open periods are counted up to this moment")
    complete: bool = Field(description="the month is over: nothing will change")
    currency: str
    total: str = Field(description="the sum of every line: each period's amount, exactly")
    lines: list[StatementLine]
    by_key: list[KeyAmount]
    by_label: dict[str, list[LabelAmount]]
    budgets: list[BudgetSpend]
    stopped_by_budgets: list[BudgetStopOut]


class TokenLine(Schema):
    model: str
    input_tokens: int
    output_tokens: int
    amount: str


class UsageOut(Schema):
    start: datetime
    end: datetime
    group_by: str
    currency: str
    total: str
    lines: list[UsageLine]
    statement: StatementOut | None = Field(None, description="with `month`: the month's statement")
    tokens: list[TokenLine]


@router.get("/usage", response={200: UsageOut, **ERRORS}, summary="Usage and cost; a month's statement (JSON or CSV)")
async def get_usage(
    request: HttpRequest,
    start: QueryTime | None = None,
    end: QueryTime | None = None,
    group_by: str = "size",
    month: str | None = Query(None, description="YYYY-MM: the month's statement (start and end are the month's)"),
    label_keys: str | None = Query(
        None, pattern=LABEL_KEYS, description="with `month`: the label keys the statement also sums by, comma-separated (5 at most)"
    ),
    format: str = Query("json", description="json, or csv (the statement with `month`; else the lines)"),
) -> Any:
    """Sandbox-seconds and cost in [start, end) (default: the last 24 hours), grouped by
    `size`, `key`, `day` or `label:<key>` (a dedicated endpoint's seconds are the line
    `endpoint:<model>`), open periods counted up to now; `tokens`: the inference gateway's
    tokens by model and their cost; `total` counts both. Amounts are decimal strings in USD.
    With `month`, the window is that month and `statement` carries its statement: a line per
    kind, item and price (running and paused sandboxes by size, paused past a budget's limit,
    saved state, dedicated endpoints and inference tokens by model), the same money by key and
    by the `label_keys` asked for, and the budgets. `format=csv` answers `text/csv` instead."""
    key = key_of(request)
    if format not in ("json", "csv"):
        raise invalid("format is json or csv", field="format")
    if group_by not in ("size", "key", "day", "all") and not group_by.startswith("label:"):
        raise invalid("group_by is size, key, day, all or label:<key>", field="group_by")
    found = None
    if month is not None:
        if start is not None or end is not None:
            raise invalid("give a month, or a start and an end: not both", field="month")
        start, end = statements.parse_month(month)
        keys = label_keys.split(",") if label_keys else []
        found = await db(statements.statement)(key.team, month, label_keys=keys)
    end = end or timezone.now()
    start = start or end - timedelta(days=1)
    if start >= end:
        raise invalid("start must be before end", field="start")
    if format == "csv":
        if found is not None:
            text, name = statements.as_csv(found), f"forkyard-{found.month}.csv"
        else:
            text, name = _lines_csv(await db(usage)(key.team, start, end, group_by)), "forkyard-usage.csv"
        response = HttpResponse(text, content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = f'attachment; filename="{name}"'
        return response
    answer: dict[str, Any] = await db(usage)(key.team, start, end, group_by)
    answer["statement"] = statements.as_dict(found) if found is not None else None
    return answer


def _lines_csv(report: dict[str, Any]) -> str:
    rows = ["group,seconds,periods,amount,currency"]
    for line in report["lines"]:
        group = '"' + line["group"].replace('"', '""') + '"'
        rows.append(f"{group},{line['seconds']},{line['periods']},{line['amount']},{report['currency']}")
    for tokens in report["tokens"]:  # counted, not timed: no seconds; the total counts them
        group = '"tokens:' + tokens["model"].replace('"', '""') + '"'
        rows.append(f"{group},,,{tokens['amount']},{report['currency']}")
    rows.append(f"total,,,{report['total']},{report['currency']}")
    return "\n".join(rows) + "\n"


# --- budgets ---------------------------------------------------------------------------------------


class BudgetIn(Schema):
    model_config = ConfigDict(extra="forbid")

    monthly_limit: Decimal = Field(..., ge=0, description="USD a calendar month (UTC)")
    alert_percents: list[int] = Field(default_factory=lambda: [50, 80], description="soft thresholds; 100 is always alerted")
    over_limit: str = Field(Budget.OverLimit.PAUSE, description="pause (then destroy after grace_s) or destroy")
    grace_s: int = Field(3600, ge=0, le=30 * 24 * 3600)
    webhook_url: str = Field("", max_length=500, description="POSTed a JSON alert at each threshold")
    notify_emails: list[str] = Field(default_factory=list, max_length=20, description="besides the team's owners and admins")


class BudgetCreate(BudgetIn):
    api_key: str | None = Field(None, description="a key's budget (its id); with neither this nor label: the team's")
    label: str = Field("", max_length=320, description="key=value: the sandboxes carrying this label")


class BudgetOut(Schema):
    id: str
    scope: str
    api_key: str | None
    label: str
    monthly_limit: str
    alert_percents: list[int]
    over_limit: str
    grace_s: int
    webhook_url: str
    notify_emails: list[str]
    spent: str = Field(description="this month so far, open periods counted up to now")
    reached: bool
    created_at: datetime
    updated_at: datetime


class BudgetList(Schema):
    budgets: list[BudgetOut]


class Deleted(Schema):
    id: str
    deleted: bool


def _fields(payload: BudgetIn) -> budgets.BudgetFields:
    return budgets.BudgetFields(
        monthly_limit=payload.monthly_limit,
        alert_percents=payload.alert_percents,
        over_limit=payload.over_limit,
        grace_s=payload.grace_s,
        webhook_url=payload.webhook_url,
        notify_emails=tuple(payload.notify_emails),
    )


def _budget_out(budget: Budget) -> dict[str, Any]:
    spent = selectors.budget_spend(budget)
    return {
        "id": budget.pk,
        "scope": budget.scope,
        "api_key": budget.api_key_id,
        "label": budget.label,
        "monthly_limit": str(budget.monthly_limit),
        "alert_percents": budget.alert_percents,
        "over_limit": budget.over_limit,
        "grace_s": budget.grace_s,
        "webhook_url": budget.webhook_url,
        "notify_emails": budget.notify_emails,
        "spent": format(spent.quantize(Decimal("0.00000001")), "f"),
        "reached": spent >= budget.monthly_limit,
        "created_at": budget.created_at,
        "updated_at": budget.updated_at,
    }


def _list(team: Any) -> dict[str, Any]:
    return {"budgets": [_budget_out(budget) for budget in selectors.budgets_of(team)]}


def _key_of_team(team: Any, key_id: str | None) -> ApiKey | None:
    if key_id is None:
        return None
    key = ApiKey.objects.filter(team=team, pk=key_id).first()
    if key is None:
        raise not_found("key", key_id, field="api_key")
    return key


@router.get("/budgets", response={200: BudgetList, **ERRORS}, summary="The team's budgets and their spend")
async def list_budgets(request: HttpRequest) -> dict[str, Any]:
    return await db(_list)(key_of(request).team)


def _create(team: Any, payload: BudgetCreate, actor: Actor) -> dict[str, Any]:
    made = budgets.budget_create(
        team=team, fields=_fields(payload), key=_key_of_team(team, payload.api_key), label=payload.label, actor=actor
    )
    return _budget_out(made)


@router.post("/budgets", response={201: BudgetOut, **ERRORS}, summary="Set a budget (admin keys)")
async def create_budget(request: HttpRequest, payload: BudgetCreate) -> tuple[int, dict[str, Any]]:
    """A monthly limit for the team, one of its keys (`api_key`) or a label (`label`: `key=value`)."""
    return 201, await db(_create)(key_of(request).team, payload, Actor.of(request))


@router.get("/budgets/{budget_id}", response={200: BudgetOut, **ERRORS}, summary="A budget and its spend")
async def get_budget(request: HttpRequest, budget_id: str) -> dict[str, Any]:
    budget = await db(selectors.budget_for)(key_of(request).team, budget_id)
    return await db(_budget_out)(budget)


def _update(budget: Budget, payload: BudgetIn, actor: Actor) -> dict[str, Any]:
    return _budget_out(budgets.budget_update(budget=budget, fields=_fields(payload), actor=actor))


@router.put("/budgets/{budget_id}", response={200: BudgetOut, **ERRORS}, summary="Change a budget (admin keys)")
async def update_budget(request: HttpRequest, budget_id: str, payload: BudgetIn) -> dict[str, Any]:
    budget = await db(selectors.budget_for)(key_of(request).team, budget_id)
    return await db(_update)(budget, payload, Actor.of(request))


@router.delete("/budgets/{budget_id}", response={200: Deleted, **ERRORS}, summary="Remove a budget (admin keys)")
async def delete_budget(request: HttpRequest, budget_id: str) -> dict[str, Any]:
    budget = await db(selectors.budget_for)(key_of(request).team, budget_id)
    await db(budgets.budget_delete)(budget=budget, actor=Actor.of(request))
    return {"id": budget_id, "deleted": True}
