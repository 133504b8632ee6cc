"""Celery tasks: dedicated endpoints on their hosts, and the purge of kept content.

Each fetches by id and calls the worker or a service; nothing else. The
endpoint commands are registered under ``sandboxes.commands.Command``'s
names, acked late and retried with backoff while the host's engine does not
answer, as the sandboxes' are.
"""

from __future__ import annotations

from typing import Any

from celery import Task, shared_task

from sandboxes.commands import Command
from sandboxes.engine.errors import Unavailable
from sandboxes.models import Host

from . import services, worker

COMMAND: dict[str, Any] = {"acks_late": True, "reject_on_worker_lost": True, "ignore_result": True}
RETRIED: dict[str, Any] = {**COMMAND, "bind": True, "autoretry_for": (Unavailable,), "retry_backoff": 1, "retry_backoff_max": 30}
PURGE = "grading.tasks.purge_retained_content"
PURGE_EVERY_S = 3600.0


@shared_task(name=str(Command.ENSURE_ENDPOINT_RUNNING), max_retries=20, **RETRIED)
def ensure_endpoint_running(self: Task[Any, Any], host_name: str, endpoint_id: str) -> str:
    return worker.endpoint_bring_up(Host.objects.get(name=host_name), endpoint_id)


@shared_task(name=str(Command.ENSURE_ENDPOINT_GONE), max_retries=50, **RETRIED)
def ensure_endpoint_gone(self: Task[Any, Any], host_name: str, endpoint_id: str) -> str:
    return worker.endpoint_take_down(Host.objects.get(name=host_name), endpoint_id)


@shared_task(name=PURGE, **COMMAND)
def purge_retained_content() -> int:
    """Kept prompts and outputs past their team's days, deleted (Celery beat runs it every hour)."""
    return services.retained_content_purge()
