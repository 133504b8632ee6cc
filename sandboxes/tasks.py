"""Celery tasks: each fetches its host by name and calls the worker; nothing else.

Tasks are registered under the names of ``commands.Command``, which is how
everything else sends them.  All are acked late and rejected on worker loss:
a killed worker's task is delivered again, and a replay is harmless because
every command names an end state.  A host's engine that does not answer is
retried with backoff; the command's ``expires`` bounds how long.
"""

from __future__ import annotations

from typing import Any

from celery import Task, shared_task

from sandboxes.engine.errors import Unavailable

from .commands import Command
from .models import Host
from .worker import bring_up, dispatch, heartbeat, snapshots, take_down, template_builds

# Every command: acked once done, given back if its worker dies, its result ignored.
COMMAND: dict[str, Any] = {"acks_late": True, "reject_on_worker_lost": True, "ignore_result": True}
RETRIED: dict[str, Any] = {**COMMAND, "bind": True, "autoretry_for": (Unavailable,), "retry_backoff": 1, "retry_backoff_max": 30}


@shared_task(name=str(Command.ENSURE_RUNNING), max_retries=20, **RETRIED)
def ensure_running(self: Task[Any, Any], host_name: str, sandbox_ids: list[str]) -> dict[str, int]:
    return bring_up.bring_up(Host.objects.get(name=host_name), sandbox_ids)


@shared_task(name=str(Command.ENSURE_GONE), max_retries=50, **RETRIED)
def ensure_gone(self: Task[Any, Any], host_name: str, sandbox_ids: list[str]) -> int:
    return take_down.take_down(Host.objects.get(name=host_name), sandbox_ids)


@shared_task(name=str(Command.ENSURE_SNAPSHOT_SAVED), max_retries=20, **RETRIED)
def ensure_snapshot_saved(self: Task[Any, Any], host_name: str, snapshot_id: str) -> str:
    return snapshots.snapshot_take(Host.objects.get(name=host_name), snapshot_id)


@shared_task(name=str(Command.ENSURE_SNAPSHOT_GONE), max_retries=50, **RETRIED)
def ensure_snapshot_gone(self: Task[Any, Any], host_name: str, snapshot_id: str) -> bool:
    return snapshots.snapshot_forget(Host.objects.get(name=host_name), snapshot_id)


@shared_task(name=str(Command.DISPATCH_LAUNCH), **COMMAND)
def dispatch_launch(launch_id: str, sealed_env: str) -> int:
    return dispatch.dispatch(launch_id, sealed_env)


@shared_task(name=str(Command.BUILD_TEMPLATE), max_retries=5, **RETRIED)
def build_template(self: Task[Any, Any], build_id: str) -> str:
    return template_builds.build(build_id)


@shared_task(name=str(Command.REVOKE_DATA_TOKENS), max_retries=20, **RETRIED)
def revoke_data_tokens(self: Task[Any, Any], host_name: str, key_ids: list[str]) -> int:
    return heartbeat.revoke_data_tokens(Host.objects.get(name=host_name), key_ids)
