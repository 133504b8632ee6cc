"""Grading's writes: calls and grades recorded, endpoints deployed and deleted, retention set and purged.

A call's record is its metadata and its tokens on billing's meter
(``billing.models.MeteredUsage``, which statements and budgets read too),
written in one transaction after it answered; its content only for a team that keeps
content, sealed, with the day it must be gone. Endpoints are placed on a
host and their command queued once the row is committed
(``sandboxes.commands``), as sandboxes are.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Count
from django.utils import timezone

from billing.budgets import require_within
from billing.models import MeteredUsage
from billing.services import endpoint_transition, metered_record, tokens_metered
from console.audit import Act, Actor, audit_record
from console.db import one_writer
from console.errors import Conflict, InvalidRequest, Unavailable
from console.models import ApiKey, Team
from sandboxes import commands, placement
from sandboxes.models import Host

from .gateway import Outcome, forget_configs
from .models import Endpoint, Grade, InferenceCall, RetainedContent, ServedModel, TeamInference

MAX_ENDPOINTS_PER_HOST = 8


# --- calls and grades ---------------------------------------------------------------------


def _call_rows(
    outcome: Outcome, grade_id: str | None, prices: dict[tuple[str, str], Decimal]
) -> tuple[InferenceCall, list[MeteredUsage], RetainedContent | None]:
    call = InferenceCall(
        team_id=outcome.team_id,
        api_key_id=outcome.key_id,
        model=outcome.model[:200],
        upstream_id=outcome.upstream_id,
        endpoint_id=outcome.endpoint_id,
        grade_id=grade_id,
        stream=outcome.stream,
        status=outcome.status,
        error_code=outcome.error_code[:64],
        input_tokens=outcome.input_tokens,
        output_tokens=outcome.output_tokens,
        latency_ms=outcome.latency_ms,
        created_at=outcome.created_at,
    )
    records = tokens_metered(
        team_id=outcome.team_id,
        api_key_id=outcome.key_id,
        model=outcome.model,
        input_tokens=outcome.input_tokens,
        output_tokens=outcome.output_tokens,
        billed=outcome.endpoint_id is None,  # a team's own endpoint is paid for by its seconds
        at=outcome.created_at,
        prices=prices,
    )
    retained = None
    if outcome.content is not None and outcome.retain_days and grade_id is None:
        retained = RetainedContent(
            team_id=outcome.team_id,
            kind=RetainedContent.Kind.INFERENCE,
            call=call,
            content=outcome.content,
            created_at=outcome.created_at,
            expires_at=outcome.created_at + timedelta(days=outcome.retain_days),
        )
    return call, records, retained


def inference_calls_record(*, outcomes: Sequence[Outcome], grade_id: str | None = None) -> int:
    """Record calls that answered: metadata, tokens for billing, and kept content where the team keeps it."""
    calls, records, kept = [], [], []
    prices: dict[tuple[str, str], Decimal] = {}  # each rate card line read once a batch
    for outcome in outcomes:
        call, usage, retained = _call_rows(outcome, grade_id, prices)
        calls.append(call)
        records += usage
        if retained is not None:
            kept.append(retained)
    with one_writer(), transaction.atomic():
        InferenceCall.objects.bulk_create(calls)
        metered_record(records)
        RetainedContent.objects.bulk_create(kept)
    return len(calls)


def grade_record(
    *,
    team_id: str,
    key_id: str,
    model: str,
    score_field: str,
    outcomes: Sequence[Outcome],
    scores: Sequence[float | None],
    latency_ms: float,
    retain_days: int,
    content: list[dict[str, Any]] | None,
) -> Grade:
    """A grade's row, its items' calls and their tokens; its content (each item's messages, answer and score)
    only when ``retain_days``."""
    graded = [score for score in scores if score is not None]
    now = timezone.now()
    grade = Grade(
        team_id=team_id,
        api_key_id=key_id,
        model=model[:200],
        score_field=score_field,
        items=len(scores),
        succeeded=len(graded),
        failed=len(scores) - len(graded),
        mean_score=sum(graded) / len(graded) if graded else None,
        input_tokens=sum(outcome.input_tokens for outcome in outcomes),
        output_tokens=sum(outcome.output_tokens for outcome in outcomes),
        latency_ms=latency_ms,
        retained=bool(retain_days and content is not None),
        created_at=now,
    )
    with one_writer(), transaction.atomic():
        grade.save(force_insert=True)
        if grade.retained:
            RetainedContent.objects.create(
                team_id=team_id,
                kind=RetainedContent.Kind.GRADE,
                grade=grade,
                content={"items": content},
                created_at=now,
                expires_at=now + timedelta(days=retain_days),
            )
    inference_calls_record(outcomes=outcomes, grade_id=grade.id)
    return grade


# --- retention ---------------------------------------------------------------------------


@transaction.atomic
def team_inference_set(
    *, team: Team, retain_days: int | None = None, zero_retention: bool | None = None, actor: Actor | None = None
) -> TeamInference:
    """A team's retention (0 or up to 30 days: content kept that long) and whether it requires zero retention;
    a change is in the team's audit log (``retention.changed``: each setting from and to)."""
    settings, _ = TeamInference.objects.get_or_create(team=team)
    before = {"retain_days": Team.objects.get(pk=team.pk).retain_content_days, "zero_retention": settings.zero_retention}
    if retain_days is not None:
        if not 0 <= retain_days <= 30:
            raise InvalidRequest("invalid_request", "retention is 0 (off) to 30 days", field="retain_days")
        Team.objects.filter(pk=team.pk).update(retain_content_days=retain_days)
        team.retain_content_days = retain_days
    if zero_retention is not None:
        settings.zero_retention = zero_retention
        settings.save(update_fields=["zero_retention"])
    after = {"retain_days": before["retain_days"] if retain_days is None else retain_days, "zero_retention": settings.zero_retention}
    changed = {name: {"from": before[name], "to": after[name]} for name in after if before[name] != after[name]}
    if changed:
        audit_record(
            team=team, actor=actor, action=Act.RETENTION_CHANGED, target_type="team", target_id=team.pk, target=team.name,
            details=changed,
        )
    transaction.on_commit(forget_configs)
    return settings


def retained_content_purge(*, now: datetime | None = None) -> int:
    """Delete every kept content past its day (the periodic task calls it); how many were deleted."""
    now = now or timezone.now()
    total = 0
    while True:
        expired = list(RetainedContent.objects.filter(expires_at__lte=now).values_list("pk", flat=True)[:1000])
        if not expired:
            return total
        with one_writer(), transaction.atomic():
            total += RetainedContent.objects.filter(pk__in=expired).delete()[0]
        Grade.objects.filter(retained=True, content__isnull=True).update(retained=False)


# --- dedicated endpoints ------------------------------------------------------------------


def _host_for_endpoint() -> Host:
    """The live host running the fewest endpoints (an endpoint holds a model in memory: spread them)."""
    hosts = placement.live_hosts()
    if not hosts:
        raise Unavailable("no_capacity", "no host is online to run an endpoint")
    counts = dict(
        Endpoint.objects.filter(host__in=hosts, state__in=Endpoint.LIVE).values_list("host").annotate(n=Count("id")).order_by()
    )
    host = min(hosts, key=lambda candidate: (counts.get(candidate.pk, 0), candidate.name))
    if counts.get(host.pk, 0) >= MAX_ENDPOINTS_PER_HOST:
        raise Unavailable("no_capacity", "every host runs as many endpoints as it may; try again later", retry_after_s=30)
    return host


def endpoint_create(*, team: Team, api_key: ApiKey | None, model: ServedModel, name: str | None) -> Endpoint:
    """Record the endpoint on a host and queue its start there (once committed); refused (402) while a budget
    of the team or of the key is spent: an endpoint is billed for every second it holds its host."""
    require_within(team=team, key_id=api_key.pk if api_key is not None else None, labels={})
    host = _host_for_endpoint()
    try:
        with one_writer(), transaction.atomic():
            endpoint = Endpoint.objects.create(
                team=team, api_key=api_key, model=model, name=name or model.name, host=host, token=secrets.token_urlsafe(32)
            )
            transaction.on_commit(lambda: commands.ensure_endpoint_running(host, endpoint.id))
    except IntegrityError:
        raise Conflict(
            "endpoint_name_taken", f"the team already has a live endpoint named {name or model.name!r}", field="name"
        ) from None
    return endpoint


def endpoint_delete(*, endpoint: Endpoint) -> Endpoint:
    """Stop it (its host's worker removes its server); a queued one ends at once. Deleting twice is done."""
    now = timezone.now()
    with one_writer(), transaction.atomic():
        moved = Endpoint.objects.filter(pk=endpoint.pk, state__in=Endpoint.LIVE).exclude(state=Endpoint.State.STOPPING)
        if not moved.update(state=Endpoint.State.STOPPING, updated_at=now):
            endpoint.refresh_from_db()
            return endpoint
        endpoint.refresh_from_db()
        host = endpoint.host
        if host is not None:
            transaction.on_commit(lambda: commands.ensure_endpoint_gone(host, endpoint.id))
        transaction.on_commit(forget_configs)
    return endpoint


def endpoint_stop_for_budget(*, endpoint: Endpoint, scope: str, limit: str) -> Endpoint:
    """A budget it counts against is reached: it is deleted (an endpoint cannot be paused, and each second
    of it is billed), and says why (``GET /endpoints/{id}``: its error ``budget_reached``)."""
    Endpoint.objects.filter(pk=endpoint.pk, state__in=Endpoint.LIVE).exclude(state=Endpoint.State.STOPPING).update(
        error_code="budget_reached", error_message=f"deleted: the {scope} budget of ${limit} a month is reached"[:500]
    )
    return endpoint_delete(endpoint=endpoint)


# --- what the host's worker records ----------------------------------------------------------


def endpoint_started(*, endpoint: Endpoint, address: str, at: datetime) -> bool:
    """Its server runs (not yet answering): ``queued -> starting``, billed from now. False if it was deleted meanwhile."""
    with one_writer(), transaction.atomic():
        moved = Endpoint.objects.filter(pk=endpoint.pk, state=Endpoint.State.QUEUED).update(
            state=Endpoint.State.STARTING, address=address, started_at=at, updated_at=at
        )
        if moved:
            endpoint.refresh_from_db()
            endpoint_transition(endpoint=endpoint, running=True, at=at)
    return bool(moved)


def endpoint_observed(*, endpoint: Endpoint, state: str, restarts: int, reason: str, at: datetime) -> None:
    """What the engine reports of its server: ready, starting again, failed."""
    changes: dict[str, Any] = {"restarts": restarts, "updated_at": at}
    if state == "ready" and endpoint.state == Endpoint.State.STARTING:
        changes.update(state=Endpoint.State.READY, ready_at=endpoint.ready_at or at, error_code="", error_message="")
    elif state in ("starting", "restarting") and endpoint.state == Endpoint.State.READY:
        changes.update(state=Endpoint.State.STARTING)
    elif state == "failed" and endpoint.state in (Endpoint.State.STARTING, Endpoint.State.READY):
        changes.update(state=Endpoint.State.FAILED, error_code="server_failed", error_message=reason[:500], ended_at=at)
    elif endpoint.restarts == restarts:
        return
    with one_writer(), transaction.atomic():
        Endpoint.objects.filter(pk=endpoint.pk, state=endpoint.state).update(**changes)
        if changes.get("state") == Endpoint.State.FAILED:
            endpoint_transition(endpoint=endpoint, running=False, at=at)
    transaction.on_commit(forget_configs)


def endpoint_failed(*, endpoint: Endpoint, code: str, message: str, at: datetime) -> None:
    with one_writer(), transaction.atomic():
        Endpoint.objects.filter(pk=endpoint.pk, state__in=[Endpoint.State.QUEUED, Endpoint.State.STARTING]).update(
            state=Endpoint.State.FAILED, error_code=code[:64], error_message=message[:500], ended_at=at, updated_at=at
        )
        endpoint_transition(endpoint=endpoint, running=False, at=at)


def endpoint_gone(*, endpoint: Endpoint, at: datetime) -> None:
    """Its server is gone from its host: ``stopping -> deleted``, its billing closed then."""
    with one_writer(), transaction.atomic():
        Endpoint.objects.filter(pk=endpoint.pk, state=Endpoint.State.STOPPING).update(
            state=Endpoint.State.DELETED, ended_at=at, updated_at=at, token=""
        )
        endpoint_transition(endpoint=endpoint, running=False, at=at)
