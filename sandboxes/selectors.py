"""Reads about sandboxes, always scoped to a team."""

from __future__ import annotations

from typing import Any, TypeVar, cast

from django.conf import settings
from django.db.models import Count, Model, Q, QuerySet, TextField
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast
from django.utils import timezone

from console.errors import ApiError, not_found
from console.models import Team

from .models import Launch, NetworkPolicy, Sandbox, Snapshot

Labelled = TypeVar("Labelled", bound=Model)  # a model with a ``labels`` JSON field


def sandbox_for(team: Team, sandbox_id: str) -> Sandbox:
    sandbox = Sandbox.objects.select_related("host").filter(team=team, pk=sandbox_id).first()
    if sandbox is None:
        raise not_found("sandbox", sandbox_id)
    return sandbox


def launch_for(team: Team, launch_id: str) -> Launch:
    launch = Launch.objects.filter(team=team, pk=launch_id).first()
    if launch is None:
        raise not_found("launch", launch_id)
    return launch


def snapshot_for(team: Team, snapshot_id: str) -> Snapshot:
    snapshot = (
        Snapshot.objects.select_related("host").filter(team=team, pk=snapshot_id).exclude(state=Snapshot.State.DELETED).first()
    )
    if snapshot is None:
        raise not_found("snapshot", snapshot_id)
    return snapshot


def policy_for(team: Team, policy_id: str) -> NetworkPolicy:
    policy = NetworkPolicy.objects.filter(team=team, pk=policy_id).first()
    if policy is None:
        raise not_found("network_policy", policy_id)
    return policy


def sandbox_out(sandbox: Sandbox) -> dict[str, Any]:
    return {
        "id": sandbox.id,
        "state": sandbox.state,
        "host": sandbox.host.name if sandbox.host_id and sandbox.host else None,
        "region": settings.FORKYARD_REGION,
        "template": sandbox.template,
        "snapshot": sandbox.snapshot_id,
        "size": sandbox.size or None,
        "cpu": sandbox.cpu,
        "memory_mib": sandbox.memory_mib,
        "ttl_s": sandbox.ttl_s,
        "network_policy": sandbox.network_policy_id,
        "labels": sandbox.labels,
        "launch": sandbox.launch_id,
        "created_at": sandbox.created_at,
        "ready_at": sandbox.ready_at,
        "expires_at": sandbox.expires_at,
        "ended_at": sandbox.ended_at,
        "error": {"code": sandbox.error_code, "message": sandbox.error_message} if sandbox.error_code else None,
    }


def with_label(rows: QuerySet[Labelled], label: str) -> QuerySet[Labelled]:
    """Filter by ``key=value`` or ``key`` (any value).

    The key is a JSON key taken literally (KeyTextTransform), never spliced
    into a lookup path: ``a__regex`` is a key, not a regex query.
    """
    key, separator, value = label.partition("=")
    if not key or len(key) > 63:
        raise ApiError("invalid_request", "label is key=value or key", field="label")
    if not separator:
        return rows.filter(labels__has_key=key)
    # Cast: a JSON key transform would read "1" as the JSON number 1.
    aliased = rows.alias(label_value=Cast(KeyTextTransform(key, "labels"), output_field=TextField()))
    # The same rows: the stubs' plugin loses a generic queryset's model through alias().
    return cast("QuerySet[Labelled]", aliased.filter(label_value=value))


def sandboxes_page(
    team: Team, state: str | None, label: str | None, limit: int, cursor: str | None
) -> tuple[list[Sandbox], str | None]:
    """Newest first, keyset-paginated: stays fast with 32,752 sandboxes in a team."""
    rows = Sandbox.objects.select_related("host").filter(team=team)
    if state:
        rows = rows.filter(state=state)
    if label:
        rows = with_label(rows, label)
    if cursor:
        from .listings import valid_cursor

        if valid_cursor(cursor) is None:
            raise ApiError("invalid_request", "cursor is not one this API gave out", field="cursor")
        created, _, last_id = cursor.partition("|")
        rows = rows.filter(Q(created_at__lt=created) | Q(created_at=created, id__lt=last_id))
    page = list(rows.order_by("-created_at", "-id")[: limit + 1])
    next_cursor = None
    if len(page) > limit:
        page = page[:limit]
        last = page[-1]
        next_cursor = f"{last.created_at.isoformat()}|{last.id}"
    return page, next_cursor


def launch_progress(launch: Launch) -> dict[str, int]:
    counts = dict(Sandbox.objects.filter(launch=launch).values_list("state").annotate(n=Count("id")).values_list("state", "n"))
    return {
        "requested": launch.count,
        "queued": counts.get(Sandbox.State.QUEUED, 0) + max(0, launch.count - sum(counts.values())),
        "creating": counts.get(Sandbox.State.CREATING, 0),
        "running": counts.get(Sandbox.State.RUNNING, 0) + counts.get(Sandbox.State.PAUSED, 0),
        "failed": counts.get(Sandbox.State.FAILED, 0),
        "ended": counts.get(Sandbox.State.DESTROYED, 0)
        + counts.get(Sandbox.State.STOPPED, 0)
        + counts.get(Sandbox.State.STOPPING, 0),
    }


def launch_out(launch: Launch) -> dict[str, Any]:
    progress = launch_progress(launch)
    end = launch.ready_at or launch.ended_at or timezone.now()
    elapsed = max(0.0, (end - launch.created_at).total_seconds())
    started = progress["running"] + progress["failed"] + progress["ended"]
    state = launch.state
    if state == Launch.State.CREATING and progress["queued"] == 0 and progress["creating"] == 0:
        state = Launch.State.READY  # every sandbox started; the row catches up at its chunk's end
    return {
        "id": launch.id,
        "state": state,
        "template": launch.template,
        "snapshot": launch.snapshot_id,
        "size": launch.size or None,
        "count": launch.count,
        "ttl_s": launch.ttl_s,
        "labels": launch.labels,
        "created_at": launch.created_at,
        "ready_at": launch.ready_at,
        "ended_at": launch.ended_at,
        "progress": progress,
        "elapsed_s": round(elapsed, 3),
        "rate_per_s": round(started / elapsed, 1) if elapsed > 0 else 0.0,
    }


def with_forks_alive(rows: QuerySet[Snapshot]) -> QuerySet[Snapshot]:
    """Each snapshot with ``forks_alive``, its live forks, counted by the database (no query per row)."""
    return rows.annotate(forks_alive=Count("sandboxes", filter=Q(sandboxes__state__in=Sandbox.LIVE)))


def snapshots_page(team: Team, state: str | None, label: str | None, limit: int, before: str | None) -> list[Snapshot]:
    """Newest first, keyset-paginated by id (``before``); deleted snapshots are not listed."""
    rows = Snapshot.objects.select_related("host").filter(team=team).exclude(state=Snapshot.State.DELETED)
    if state:
        rows = rows.filter(state=state)
    if label:
        rows = with_label(rows, label)
    if before:
        anchor = rows.filter(pk=before).values_list("created_at", flat=True).first()
        if anchor is None:
            raise not_found("snapshot", before)
        rows = rows.filter(Q(created_at__lt=anchor) | Q(created_at=anchor, id__lt=before))
    return list(with_forks_alive(rows).order_by("-created_at", "-id")[:limit])


def snapshot_out(snapshot: Snapshot) -> dict[str, Any]:
    forks_alive = getattr(snapshot, "forks_alive", None)
    if forks_alive is None:
        forks_alive = Sandbox.objects.filter(snapshot=snapshot, state__in=Sandbox.LIVE).count()
    return {
        "id": snapshot.id,
        "name": snapshot.name,
        "state": snapshot.state,
        "template": snapshot.template,
        "parent": snapshot.parent_id,
        "layer_id": snapshot.layer_id,
        "size_bytes": snapshot.size_bytes,
        "total_bytes": snapshot.total_bytes,
        "services": snapshot.services,
        "labels": snapshot.labels,
        "source_sandbox": snapshot.source_sandbox_id,
        "host": snapshot.host.name if snapshot.host_id and snapshot.host else None,
        "created_at": snapshot.created_at,
        "ready_at": snapshot.ready_at,
        "deleted_at": snapshot.deleted_at,
        "paused_ms": snapshot.paused_ms,
        "forks_alive": forks_alive,
        "error": {"code": snapshot.error_code or "snapshot_failed", "message": snapshot.error}
        if snapshot.state == Snapshot.State.FAILED
        else None,
    }


def policy_out(policy: NetworkPolicy) -> dict[str, Any]:
    return {
        "id": policy.id,
        "name": policy.name,
        "description": policy.description,
        "egress": policy.egress,
        "created_at": policy.created_at,
        "updated_at": policy.updated_at,
    }
