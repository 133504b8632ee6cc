"""The host agent: a thread in each host's Celery worker, started when the worker is ready.

Every ``FORKYARD_RECONCILE_S`` it records the host's heartbeat and capacity
(registering the host the first time, with its templates), reconciles the
host's rows with its engine, and takes its turn at the fleet's watch (hosts
whose heartbeat stopped: ``worker.fleet``).  It calls the engine and the database directly,
not through the broker, so it keeps the record honest even while the broker
is down. Other apps add a pass of their own for the host (``PASSES``: grading's
dedicated endpoints), run after the sandboxes' in the same loop.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from billiard.process import current_process
from celery.signals import beat_embedded_init, worker_ready, worker_shutting_down
from django.conf import settings
from django.db import close_old_connections

from console.db import truncate_write_ahead_log
from sandboxes.engine.kernel import PR_SET_PDEATHSIG, Kernel

from .models import Host
from .worker.budgets import enforce_budgets
from .worker.fleet import watch_fleet
from .worker.heartbeat import host_heartbeat
from .worker.reconcile import reconcile

log = logging.getLogger("forkyard.agent")
_stop = threading.Event()
# More work for each pass, by other apps (they append at their AppConfig.ready): each takes the host
# and returns what it fixed, by kind.
PASSES: list[Callable[[Host], dict[str, int]]] = []


def agent_loop(name: str, socket_path: str, interval_s: float) -> None:
    while not _stop.is_set():
        close_old_connections()
        try:
            host = host_heartbeat(name, socket_path)
            counts = reconcile(host)
            for extra in PASSES:
                counts.update(_pass(extra, host))
            if any(counts.values()):
                log.info("reconciled %s: %s", name, counts)
            stopped = enforce_budgets(host)
            if any(stopped.values()):
                log.info("budgets on %s: %s", name, stopped)
            truncate_write_ahead_log()
        except Exception as error:  # noqa: BLE001 - the agent must outlive any one failure
            log.warning("host agent %s: %s", name, error)
        try:
            # Not behind its own host's pass: a host whose engine is down still watches the others.
            watch_fleet(name)
        except Exception as error:  # noqa: BLE001 - the agent must outlive any one failure
            log.warning("fleet watch from %s: %s", name, error)
        _stop.wait(interval_s)


def _pass(extra: Callable[[Host], dict[str, int]], host: Host) -> dict[str, Any]:
    try:
        return extra(host)
    except Exception as error:  # noqa: BLE001 - one app's pass failing must not stop the others
        log.warning("host agent pass %s: %s", getattr(extra, "__name__", extra), error)
        return {}


@worker_ready.connect
def start_agent(**_: object) -> None:
    if os.environ.get("FORKYARD_HOST_AGENT", "1") != "1":
        return
    thread = threading.Thread(
        target=agent_loop,
        args=(settings.FORKYARD_HOST_NAME, settings.FORKYARD_ENGINE_SOCKET, settings.FORKYARD_RECONCILE_S),
        name="forkyard-host-agent",
        daemon=True,
    )
    thread.start()
    log.info("host agent for %s started", settings.FORKYARD_HOST_NAME)


@worker_shutting_down.connect
def stop_agent(**_: object) -> None:
    _stop.set()


@beat_embedded_init.connect
def die_with_the_worker(**_: object) -> None:
    """`celery worker -B` runs beat in a child process. A worker killed with
    SIGKILL (the faults it must survive) left that child scheduling on its own,
    for good, and twice once the worker came back; now the kernel kills it with
    its parent."""
    worker = getattr(current_process(), "_parent_pid", None)  # set by the worker before it forked
    Kernel().prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if worker is not None and os.getppid() != worker:  # the worker died before the line above
        os._exit(0)
