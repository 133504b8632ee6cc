"""The only place that queues work: each command, the queue that carries it, how long it stays valid.

Celery carries commands, not state.  A command names the end state it wants
for ids ("ensure these sandboxes run on this host"), so that a replay (a
worker killed mid-task, the task delivered again) does nothing twice.  A
command about a host's sandboxes travels on that host's queue, so the worker
that owns them runs it, and expires: a host that comes back late does not
replay stale commands.

A host has two queues: its bulk lane (``host.<name>``: teardowns, launches'
chunks, what reconciliation queues again) and its interactive lane
(``host.<name>.interactive``: what a person or a trainer is waiting on, a
snapshot or a single create), consumed by a worker process of its own, so
that hundreds of teardowns never sit in front of a snapshot.  Pause and
resume queue nothing: the web server asks the engine itself.

Commands are sent by name (``send_task``): nothing here imports the tasks,
and the tasks, which call the worker, never import back.  ``sandboxes.tasks``
registers a task under each ``Command``; a test checks that every one is.
Callers queue after their transaction commits (``transaction.on_commit``), so
no worker reads a row before it exists.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Any

from django.conf import settings

from console.celery import app

from .models import Host


class Command(StrEnum):
    """Every task, by the name it is registered under."""

    ENSURE_RUNNING = "sandboxes.tasks.ensure_running"
    ENSURE_GONE = "sandboxes.tasks.ensure_gone"
    ENSURE_SNAPSHOT_SAVED = "sandboxes.tasks.ensure_snapshot_saved"
    ENSURE_SNAPSHOT_GONE = "sandboxes.tasks.ensure_snapshot_gone"
    DISPATCH_LAUNCH = "sandboxes.tasks.dispatch_launch"
    REVOKE_DATA_TOKENS = "sandboxes.tasks.revoke_data_tokens"
    BUILD_TEMPLATE = "sandboxes.tasks.build_template"
    # Dedicated inference endpoints (grading/): a model server on a host, started and stopped by its engine.
    ENSURE_ENDPOINT_RUNNING = "grading.tasks.ensure_endpoint_running"
    ENSURE_ENDPOINT_GONE = "grading.tasks.ensure_endpoint_gone"


class Lane(StrEnum):
    """Which queue a command takes: any worker's, or one of the host's that owns its sandboxes (bulk work, or
    what someone waits on)."""

    CONTROL = "control"
    HOST = "host"
    INTERACTIVE = "interactive"


# Seconds a command stays valid on its queue; None: until a worker takes it.
EXPIRES: dict[Command, int | None] = {
    Command.ENSURE_RUNNING: 600,
    Command.ENSURE_GONE: 3600,
    Command.ENSURE_SNAPSHOT_SAVED: 600,
    Command.ENSURE_SNAPSHOT_GONE: 3600,
    Command.DISPATCH_LAUNCH: None,
    Command.REVOKE_DATA_TOKENS: 3600,  # past it, every token the key was given has expired anyway
    Command.BUILD_TEMPLATE: 3600,
    Command.ENSURE_ENDPOINT_RUNNING: 600,
    Command.ENSURE_ENDPOINT_GONE: 3600,
}


def queue_name(lane: Lane, host: Host | None = None) -> str:
    if lane is Lane.CONTROL:
        return str(settings.CELERY_TASK_DEFAULT_QUEUE)
    assert host is not None, "a host's lane names the host"
    return host.interactive_queue if lane is Lane.INTERACTIVE else host.queue


def send(command: Command, args: Sequence[Any], lane: Lane, host: Host | None = None) -> None:
    """Queue ``command``; whatever the broker raises when it refuses goes to the caller."""
    app.send_task(str(command), args=list(args), queue=queue_name(lane, host), expires=EXPIRES[command])


def ensure_running(host: Host, sandbox_ids: Sequence[str], *, interactive: bool = False) -> None:
    """The host's worker creates these sandboxes (those still queued or creating) on its engine. ``interactive``:
    a single create someone waits on, on the host's interactive lane (a launch's chunks and reconciliation's
    retries take the bulk one)."""
    lane = Lane.INTERACTIVE if interactive and len(sandbox_ids) == 1 else Lane.HOST
    send(Command.ENSURE_RUNNING, (host.name, list(sandbox_ids)), lane, host)


def ensure_gone(host: Host, sandbox_ids: Sequence[str]) -> None:
    """The host's worker destroys these sandboxes, a chunk per command (``FORKYARD_LAUNCH_CHUNK``)."""
    chunk = settings.FORKYARD_LAUNCH_CHUNK
    for start in range(0, len(sandbox_ids), chunk):
        send(Command.ENSURE_GONE, (host.name, list(sandbox_ids[start : start + chunk])), Lane.HOST, host)


def ensure_gone_on_hosts(stopping: Mapping[int, Sequence[str]]) -> None:
    """``ensure_gone`` for sandboxes on many hosts at once, by host id (a teardown, a kill by label)."""
    hosts = Host.objects.in_bulk(list(stopping))
    for host_id, sandbox_ids in stopping.items():
        if host_id in hosts and sandbox_ids:
            ensure_gone(hosts[host_id], sandbox_ids)


def ensure_snapshot_saved(host: Host, snapshot_id: str) -> None:
    """The engine of the host running its source sandbox takes the snapshot (someone waits: the interactive lane)."""
    send(Command.ENSURE_SNAPSHOT_SAVED, (host.name, snapshot_id), Lane.INTERACTIVE, host)


def ensure_snapshot_gone(host: Host, snapshot_id: str) -> None:
    """A host that holds a deleted snapshot forgets it."""
    send(Command.ENSURE_SNAPSHOT_GONE, (host.name, snapshot_id), Lane.HOST, host)


def dispatch_launch(launch_id: str, sealed_env: str) -> None:
    """Any worker makes the launch's sandboxes, in chunks placed on hosts with room; their environment
    travels sealed (``console.sealing``): a broker's message is data at rest too."""
    send(Command.DISPATCH_LAUNCH, (launch_id, sealed_env), Lane.CONTROL)


def build_template(build_id: str) -> None:
    """Any worker runs a template build: its steps reach the build sandbox's host through its engine link."""
    send(Command.BUILD_TEMPLATE, (build_id,), Lane.CONTROL)


def revoke_data_tokens(hosts: Iterable[Host], key_ids: Sequence[str]) -> None:
    """Every host's gateway refuses these keys' data tokens (``gateway_access``): on the interactive lane, so
    that no backlog of bulk work delays a revocation."""
    for host in hosts:
        send(Command.REVOKE_DATA_TOKENS, (host.name, list(key_ids)), Lane.INTERACTIVE, host)


def ensure_endpoint_running(host: Host, endpoint_id: str) -> None:
    """The host's engine runs the endpoint's model server (someone waits for it: the interactive lane)."""
    send(Command.ENSURE_ENDPOINT_RUNNING, (host.name, endpoint_id), Lane.INTERACTIVE, host)


def ensure_endpoint_gone(host: Host, endpoint_id: str) -> None:
    """The host's engine stops the endpoint's model server and forgets it."""
    send(Command.ENSURE_ENDPOINT_GONE, (host.name, endpoint_id), Lane.HOST, host)
