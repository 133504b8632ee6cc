"""Grading's reads: where a team's inference may go, its endpoints, grades and retained content.

Every read takes the team and finds only its objects: another team's
endpoint or grade is ``not found``, exactly as one nobody holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from django.db.models import Q, QuerySet

from billing.models import Budget
from billing.selectors import budget_spend, budgets_of, token_prices
from console.errors import not_found
from console.models import Team
from console.pagination import Page, keyset_page

from .models import Endpoint, Grade, InferenceCall, KeyInference, RetainedContent, ServedModel, TeamInference, Upstream


@dataclass(frozen=True)
class Route:
    """Where a call for ``model`` may go: an operator's upstream, or one of the team's dedicated endpoints."""

    model: str  # as the team names it
    target_model: str  # as the server names it
    base_url: str  # its OpenAI API's base (".../v1")
    secret: str
    timeout_s: float
    keeps_prompts: bool
    upstream_id: str | None = None
    endpoint_id: str | None = None

    @property
    def dedicated(self) -> bool:
        return self.endpoint_id is not None


@dataclass(frozen=True)
class BudgetSpent:
    """A budget inference counts against (the team's, or one of its keys'), and what it had spent when read."""

    budget: Budget
    spent: Decimal

    def applies_to(self, key_id: str) -> bool:
        return not self.budget.api_key_id or self.budget.api_key_id == key_id


@dataclass(frozen=True)
class GatewayConfig:
    """What the gateway needs to know of a team, read in one go and kept a moment (``grading.gateway``)."""

    team_id: str
    zero_retention: bool
    zero_retention_keys: frozenset[str]
    retain_days: int
    requests_per_minute: int
    tokens_per_minute: int
    routes: dict[str, tuple[Route, ...]] = field(default_factory=dict)
    # Budgets: read with the rest only when the team has some; with each upstream model's token prices.
    budgets: tuple[BudgetSpent, ...] = ()
    prices: dict[str, tuple[Decimal, Decimal]] = field(default_factory=dict)
    # What this process admitted since it read ``budgets`` (the most each call could cost), by budget.
    admitted: dict[str, Decimal] = field(default_factory=dict)

    def requires_zero_retention(self, key_id: str) -> bool:
        return self.zero_retention or key_id in self.zero_retention_keys


def gateway_config(team_id: str) -> GatewayConfig:
    """The team's settings and every route its calls may take (dedicated endpoints first, then upstreams)."""
    team = Team.objects.get(pk=team_id)
    settings = TeamInference.objects.filter(team_id=team_id).first() or TeamInference(team_id=team_id)
    keys = frozenset(KeyInference.objects.filter(key__team_id=team_id, zero_retention=True).values_list("key_id", flat=True))
    routes: dict[str, list[Route]] = {}
    ready = Endpoint.objects.filter(team_id=team_id, state=Endpoint.State.READY).exclude(address="")
    for endpoint in ready:
        routes.setdefault(endpoint.name, []).append(
            Route(
                model=endpoint.name,
                target_model=endpoint.name,
                base_url=f"{endpoint.address}/v1",
                secret=str(endpoint.token),
                timeout_s=600.0,
                keeps_prompts=False,  # our own server: it keeps nothing
                endpoint_id=endpoint.id,
            )
        )
    for upstream in Upstream.objects.filter(enabled=True).order_by("priority", "name"):
        for model in upstream.serves if isinstance(upstream.serves, list) else []:
            if not isinstance(model, str) or not model:
                continue
            target = (upstream.model_names or {}).get(model, model) if isinstance(upstream.model_names, dict) else model
            routes.setdefault(model, []).append(
                Route(
                    model=model,
                    target_model=str(target),
                    base_url=upstream.base_url.rstrip("/"),
                    secret=str(upstream.secret or ""),
                    timeout_s=float(upstream.timeout_s),
                    keeps_prompts=upstream.keeps_prompts,
                    upstream_id=upstream.id,
                )
            )
    # Label budgets count sandboxes carrying a label: a call carries none, so only the team's and keys' apply.
    budgets = tuple(BudgetSpent(budget, budget_spend(budget)) for budget in budgets_of(team) if not budget.label)
    priced = sorted(name for name, found in routes.items() if any(not route.dedicated for route in found)) if budgets else []
    return GatewayConfig(
        team_id=team_id,
        zero_retention=settings.zero_retention,
        zero_retention_keys=keys,
        retain_days=min(int(team.retain_content_days), 30),
        requests_per_minute=settings.requests_per_minute,
        tokens_per_minute=int(settings.tokens_per_minute),
        routes={name: tuple(found) for name, found in routes.items()},
        budgets=budgets,
        prices=token_prices(priced) if priced else {},
    )


def team_inference(team: Team) -> TeamInference:
    return TeamInference.objects.filter(team=team).first() or TeamInference(team=team)


# --- endpoints ---------------------------------------------------------------------------


def endpoints_of(team: Team) -> QuerySet[Endpoint]:
    return Endpoint.objects.filter(team=team).select_related("host", "model")


def endpoints_page(team: Team, *, cursor: str | None, limit: int, strict: bool = True) -> Page[Endpoint]:
    return keyset_page(endpoints_of(team), cursor=cursor, limit=limit, strict=strict)


def endpoint_for(team: Team, endpoint_id: str) -> Endpoint:
    endpoint = endpoints_of(team).filter(pk=endpoint_id).first()
    if endpoint is None:
        raise not_found("endpoint", endpoint_id)
    return endpoint


def served_models() -> list[ServedModel]:
    return list(ServedModel.objects.filter(enabled=True).order_by("name"))


def served_model(name: str) -> ServedModel:
    model = ServedModel.objects.filter(pk=name, enabled=True).first()
    if model is None:
        raise not_found("model", name, field="model")
    return model


# --- grades and calls ----------------------------------------------------------------------


def grades_page(team: Team, *, cursor: str | None, limit: int, strict: bool = True) -> Page[Grade]:
    return keyset_page(Grade.objects.filter(team=team), cursor=cursor, limit=limit, strict=strict)


def grade_for(team: Team, grade_id: str) -> Grade:
    grade = Grade.objects.filter(team=team, pk=grade_id).first()
    if grade is None:
        raise not_found("grade", grade_id)
    return grade


def retained_for_grade(grade: Grade) -> dict[str, Any] | None:
    row = RetainedContent.objects.filter(grade=grade, team_id=grade.team_id).first()
    return dict(row.content) if row is not None else None


def calls_page(team: Team, *, cursor: str | None, limit: int) -> Page[InferenceCall]:
    rows = InferenceCall.objects.filter(team=team, grade__isnull=True).select_related("api_key")
    return keyset_page(rows, cursor=cursor, limit=limit, strict=False)


def call_for(team: Team, call: str) -> InferenceCall:
    found = InferenceCall.objects.filter(team=team, pk=call).select_related("api_key").first()
    if found is None:
        raise not_found("call", call)
    return found


def retained_for_call(call: InferenceCall) -> dict[str, Any] | None:
    row = RetainedContent.objects.filter(call=call, team_id=call.team_id).first()
    return dict(row.content) if row is not None else None


def retained_count(team: Team) -> int:
    return RetainedContent.objects.filter(Q(team=team)).count()
