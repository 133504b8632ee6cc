"""Celery tasks: each fetches by id and calls lifecycle; queued only after commit.

Per-host tasks travel on ``host.<name>`` and carry ``expires`` so that a host
that comes back does not replay stale commands.  All are acked late and
rejected on worker loss: a killed worker's task is redelivered, and replays
are harmless because every command names an end state.
"""

from __future__ import annotations

import logging
from typing import Any, TypedDict

from celery import Task, shared_task
from django.conf import settings

from sandboxes.engine.errors import Unavailable

from . import lifecycle
from .models import Host

log = logging.getLogger("forkyard.tasks")


class CommandOptions(TypedDict):
    acks_late: bool
    reject_on_worker_lost: bool
    ignore_result: bool


COMMAND: CommandOptions = {"acks_late": True, "reject_on_worker_lost": True, "ignore_result": True}


@shared_task(bind=True, autoretry_for=(Unavailable,), retry_backoff=1, retry_backoff_max=30, max_retries=20, **COMMAND)
def ensure_running(self: Task[Any, Any], host_name: str, sandbox_ids: list[str]) -> dict[str, int]:
    host = Host.objects.get(name=host_name)
    return lifecycle.bring_up(host, sandbox_ids)


@shared_task(bind=True, autoretry_for=(Unavailable,), retry_backoff=1, retry_backoff_max=30, max_retries=50, **COMMAND)
def ensure_gone(self: Task[Any, Any], host_name: str, sandbox_ids: list[str]) -> int:
    host = Host.objects.get(name=host_name)
    return lifecycle.take_down(host, sandbox_ids)


@shared_task(bind=True, autoretry_for=(Unavailable,), retry_backoff=1, retry_backoff_max=30, max_retries=20, **COMMAND)
def ensure_snapshot_saved(self: Task[Any, Any], host_name: str, snapshot_id: str) -> str:
    from .snapshots import snapshot_take

    host = Host.objects.get(name=host_name)
    return snapshot_take(host, snapshot_id)


@shared_task(bind=True, autoretry_for=(Unavailable,), retry_backoff=1, retry_backoff_max=30, max_retries=50, **COMMAND)
def ensure_snapshot_gone(self: Task[Any, Any], host_name: str, snapshot_id: str) -> bool:
    from .snapshots import snapshot_forget

    host = Host.objects.get(name=host_name)
    return snapshot_forget(host, snapshot_id)


@shared_task(**COMMAND)
def dispatch_launch(launch_id: str, env: dict[str, str]) -> int:
    from .services import enqueue_bring_up

    return lifecycle.dispatch(launch_id, env, enqueue_bring_up)


@shared_task(**COMMAND)
def reconcile_host(host_name: str) -> dict[str, int]:
    host = Host.objects.get(name=host_name)
    return lifecycle.reconcile(host)


@shared_task(**COMMAND)
def reconcile_all() -> int:
    """Fan out one reconcile per live host, on that host's queue."""
    from .services import live_hosts

    hosts = live_hosts()
    for host in hosts:
        reconcile_host.apply_async(args=(host.name,), queue=host.queue, expires=settings.FORKYARD_RECONCILE_S)
    return len(hosts)
