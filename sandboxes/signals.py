"""The host agent: a thread in each host's Celery worker.

Every few seconds it records the host's heartbeat and capacity (registering
the host the first time, with its templates) and reconciles the host's rows
with its engine.  It calls the engine and the database directly, not through
the broker, so it keeps the record honest even while the broker is down.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from celery.signals import beat_embedded_init, worker_ready, worker_shutting_down
from django.conf import settings
from django.db import close_old_connections

log = logging.getLogger("forkyard.agent")
_stop = threading.Event()


def agent_loop(name: str, socket_path: str, interval_s: float) -> None:
    from . import lifecycle

    while not _stop.is_set():
        close_old_connections()
        try:
            host = lifecycle.host_heartbeat(name, socket_path)
            counts = lifecycle.reconcile(host)
            if any(counts.values()):
                log.info("reconciled %s: %s", name, counts)
        except Exception as error:  # noqa: BLE001 - the agent must outlive any one failure
            log.warning("host agent %s: %s", name, error)
        _stop.wait(interval_s)


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
    from billiard.process import current_process

    from sandboxes.engine.kernel import PR_SET_PDEATHSIG, Kernel

    worker = getattr(current_process(), "_parent_pid", None)  # set by the worker before it forked
    Kernel().prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if worker is not None and os.getppid() != worker:  # the worker died before the line above
        os._exit(0)


def wait_for_host(name: str, timeout_s: float = 30.0) -> bool:
    """For scripts and tests: True once the host has registered."""
    from .models import Host

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if Host.objects.filter(name=name).exists():
            return True
        time.sleep(0.1)
    return False
