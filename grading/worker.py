"""What a host's worker does for dedicated endpoints, and what its host agent keeps in step.

``endpoint_bring_up`` (the ``ensure_endpoint_running`` command) asks the
host's engine for the endpoint's model server (``model_servers.ensure``:
idempotent) and records it ``starting`` with its address, billed from then.
``endpoint_take_down`` (``ensure_endpoint_gone``) has the engine remove it
and records it ``deleted``, its billing closed. ``endpoints_reconcile``, a
pass of each host agent (``grading.agent``), reads what the engine reports
of every server (ready, restarting after a death, failed) into the rows,
removes servers no live row names, and queues again a command that was
lost (a row still ``queued`` or ``stopping`` after ``FORKYARD_STUCK_AFTER_S``).
``endpoints_over_budget``, called by the host agent's budget pass for each
budget reached (``sandboxes.worker.budgets.REACHED``), deletes the live
endpoints of its scope on the host: the team's, or the key's.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from billing.selectors import BudgetState
from sandboxes import commands, engine_link
from sandboxes.engine import errors as engine_errors
from sandboxes.models import Host

from . import services
from .models import Endpoint

S = Endpoint.State


def _spec(endpoint: Endpoint) -> dict[str, Any]:
    model = endpoint.model
    return {
        "id": endpoint.id,
        "kind": model.server,
        "model": model.path,
        "name": endpoint.name,
        "token": str(endpoint.token),
        "context_length": model.context_length,
        "threads": model.threads,
    }


def endpoint_bring_up(host: Host, endpoint_id: str) -> str:
    """Its server running on the host's engine, and recorded; its state after (a replay changes nothing)."""
    endpoint = Endpoint.objects.select_related("model").get(pk=endpoint_id)
    if endpoint.state != S.QUEUED:
        return endpoint.state
    client = engine_link.engine(host.engine_socket)
    try:
        server = client.call("model_servers.ensure", **_spec(endpoint))
    except engine_errors.Unavailable:
        raise  # retried with backoff by the task
    except engine_errors.EngineError as error:
        services.endpoint_failed(endpoint=endpoint, code=error.code, message=error.message, at=timezone.now())
        return S.FAILED
    if not services.endpoint_started(endpoint=endpoint, address=server["address"], at=timezone.now()):
        client.call("model_servers.remove", id=endpoint.id)  # deleted while it was being started
        endpoint.refresh_from_db()
        if endpoint.state == S.STOPPING:
            services.endpoint_gone(endpoint=endpoint, at=timezone.now())
    endpoint.refresh_from_db()
    return endpoint.state


def endpoint_take_down(host: Host, endpoint_id: str) -> str:
    endpoint = Endpoint.objects.get(pk=endpoint_id)
    if endpoint.state != S.STOPPING:
        return endpoint.state
    engine_link.engine(host.engine_socket).call("model_servers.remove", id=endpoint.id)
    services.endpoint_gone(endpoint=endpoint, at=timezone.now())
    return S.DELETED


def endpoints_reconcile(host: Host) -> dict[str, int]:
    """The host's endpoint rows and its engine's model servers, made to agree (one agent pass)."""
    counts = {"endpoints_updated": 0, "servers_removed": 0, "endpoints_requeued": 0}
    rows = {row.id: row for row in Endpoint.objects.filter(host=host, state__in=Endpoint.LIVE).select_related("model")}
    if not rows and not Endpoint.objects.filter(host=host).exists():
        return counts  # a host that never ran an endpoint: no engine call
    client = engine_link.engine(host.engine_socket)
    servers = {server["id"]: server for server in client.call("model_servers.list")["servers"]}
    now = timezone.now()
    for server_id, server in servers.items():
        row = rows.get(server_id)
        if row is None or row.state == S.STOPPING:
            client.call("model_servers.remove", id=server_id)
            counts["servers_removed"] += 1
            if row is not None:
                services.endpoint_gone(endpoint=row, at=now)
            continue
        if row.state in Endpoint.HOLDING:
            services.endpoint_observed(
                endpoint=row, state=server["state"], restarts=int(server["restarts"]), reason=server.get("reason", ""), at=now
            )
            counts["endpoints_updated"] += 1
    stuck = now - timedelta(seconds=settings.FORKYARD_STUCK_AFTER_S)
    for row in rows.values():
        if row.id in servers:
            continue
        if row.state == S.STOPPING:
            services.endpoint_gone(endpoint=row, at=now)  # its server is gone already
        elif row.state in Endpoint.HOLDING:
            # Its server is not on the engine (a host's state lost): start it again from the row.
            client.call("model_servers.ensure", **_spec(row))
            counts["endpoints_requeued"] += 1
        elif row.state == S.QUEUED and row.updated_at < stuck:
            Endpoint.objects.filter(pk=row.pk, state=S.QUEUED).update(updated_at=now)
            commands.ensure_endpoint_running(host, row.id)
            counts["endpoints_requeued"] += 1
    return counts


def endpoints_over_budget(host: Host, state: BudgetState, now: datetime) -> dict[str, int]:
    """The live endpoints on ``host`` that a reached budget pays for, deleted; how many."""
    budget = state.budget
    if budget.label:
        return {}  # a label's budget counts sandboxes carrying it: an endpoint carries no labels
    rows = Endpoint.objects.filter(team_id=budget.team_id, host=host, state__in=Endpoint.LIVE).exclude(state=S.STOPPING)
    if budget.api_key_id:
        rows = rows.filter(api_key_id=budget.api_key_id)
    deleted = 0
    for endpoint in rows.order_by("pk"):
        services.endpoint_stop_for_budget(endpoint=endpoint, scope=budget.scope, limit=str(budget.monthly_limit))
        deleted += 1
    return {"endpoints_deleted": deleted} if deleted else {}
