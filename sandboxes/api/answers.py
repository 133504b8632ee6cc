"""How each object looks in the API's answers (the schemas in ``sandboxes.schemas`` describe the same)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from django.conf import settings
from django.db.models import Model
from django.http import HttpRequest

from console.api_base import key_of
from console.pagination import Page
from console.selectors import limits_of

from .. import selectors, sizes
from ..gateway_access import Access, data_path
from ..models import Launch, Lease, NetworkPolicy, Sandbox, Snapshot, Template, TemplateBuild

Row = TypeVar("Row", bound=Model)
END_REASONS = Sandbox.END_REASONS


def access_of(request: HttpRequest) -> Access:
    """For whom a sandbox's data token is minted: the request's key, and its team's rate (as checked)."""
    key = key_of(request)
    return Access.of(key, getattr(request, "forkyard_rate", None) or limits_of(key.team).requests_per_second)


def sandbox_out(sandbox: Sandbox, access: Access | None = None) -> dict[str, Any]:
    """A sandbox as the API shows it; with ``access``, a running or paused one's ``data_path`` for that key."""
    return {
        "data_path": data_path(sandbox, access),
        "id": sandbox.id,
        "state": sandbox.state,
        "host": sandbox.host.name if sandbox.host_id and sandbox.host else None,
        "region": settings.FORKYARD_REGION,
        "template": sandbox.template,
        "snapshot": sandbox.snapshot_id,
        "size": sandbox.size or None,
        "cpu": sandbox.cpu,
        "memory_mib": sandbox.memory_mib,
        "disk_mib": sandbox.disk_mib or sizes.Shape(sandbox.size, sandbox.cpu, sandbox.memory_mib).included_disk_mib,
        "ttl_s": sandbox.ttl_s,
        "network_policy": sandbox.network_policy_id,
        "labels": sandbox.labels,
        "launch": sandbox.launch_id,
        "lease": sandbox.lease_id,
        "created_at": sandbox.created_at,
        "ready_at": sandbox.ready_at,
        "expires_at": sandbox.expires_at,
        "ended_at": sandbox.ended_at,
        "idle_timeout_s": sandbox.idle_timeout_s,
        "error": (
            {"code": sandbox.error_code, "message": sandbox.error_message}
            if sandbox.error_code and sandbox.error_code not in END_REASONS
            else None
        ),
        "end_reason": (
            {"code": sandbox.error_code, "message": sandbox.error_message} if sandbox.error_code in END_REASONS else None
        ),
    }


def launch_out(launch: Launch) -> dict[str, Any]:
    """A launch with its progress (one GROUP BY over its members)."""
    progress = selectors.launch_progress(launch)
    return {
        "id": launch.id,
        "state": progress.state,
        "template": launch.template,
        "snapshot": launch.snapshot_id,
        "size": launch.size or None,
        "count": launch.count,
        "memory_group_size": launch.memory_group_size,
        "memory_group_cpu": launch.memory_group_cpu,
        "ttl_s": launch.ttl_s,
        "idle_timeout_s": launch.idle_timeout_s,
        "labels": launch.labels,
        "lease": launch.lease_id,
        "created_at": launch.created_at,
        "ready_at": launch.ready_at,
        "ended_at": launch.ended_at,
        "progress": progress.counts(),
        "elapsed_s": progress.elapsed_s,
        "rate_per_s": progress.rate_per_s,
    }


def snapshot_out(snapshot: Snapshot) -> dict[str, Any]:
    forks_alive = getattr(snapshot, "forks_alive", None)
    if forks_alive is None:
        forks_alive = selectors.snapshot_users(snapshot)["forks_alive"]
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


def lease_out(lease: Lease) -> dict[str, Any]:
    """A lease, with ``sandboxes_alive`` as its selector counted it (``selectors.with_sandboxes_alive``)."""
    return {
        "id": lease.id,
        "state": lease.state,
        "grace_s": lease.grace_s,
        "created_at": lease.created_at,
        "heartbeat_at": lease.heartbeat_at,
        "expires_at": lease.expires_at,
        "ended_at": lease.ended_at,
        "sandboxes_alive": getattr(lease, "sandboxes_alive", 0),
    }


def template_out(template: Template) -> dict[str, Any]:
    return {
        "name": template.name,
        "description": template.description,
        "size_bytes": template.size_bytes,
        "created_at": template.created_at,
        "hosts": sorted(host.name for host in (template.snapshot.hosts if template.snapshot else template.hosts).all()),
        "public": template.team_id is None,
        "state": template.state,
        "snapshot": template.snapshot_id,
        "build": getattr(template, "last_build_id", None),
    }


def build_out(build: TemplateBuild) -> dict[str, Any]:
    steps = [
        {
            "name": step["name"],
            "kind": step["kind"],
            "state": step["state"],
            "seconds": step.get("seconds"),
            "snapshot": step.get("snapshot"),
        }
        for step in build.steps
    ]
    return {
        "id": build.pk,
        "template": build.template.name,
        "state": build.state,
        "steps": steps,
        "cached": build.state == TemplateBuild.State.READY and all(step["state"] == "cached" for step in steps),
        "failed_step": build.failed_step,
        "error": {"code": build.error_code, "message": build.error} if build.error_code else None,
        "error_output": build.error_output,
        "created_at": build.created_at,
        "ended_at": build.ended_at,
    }


def policy_out(policy: NetworkPolicy) -> dict[str, Any]:
    return {
        "id": policy.id,
        "name": policy.name,
        "description": policy.description,
        "egress": policy.egress,
        "same_launch": policy.same_launch,
        "created_at": policy.created_at,
        "updated_at": policy.updated_at,
    }


def page_out(name: str, page: Page[Row], shape: Callable[[Row], dict[str, Any]]) -> dict[str, Any]:
    """Every list answers the same way: its items under their plural, and the cursor of the next page."""
    return {name: [shape(row) for row in page.rows], "next_cursor": page.next_cursor}
