"""Fault injection: die like SIGKILL at a named step, so tests can prove recovery.

Set ``FORKYARD_ENGINE_CRASH_AT`` to a step name (see ``STEPS``) before the
engine starts; when it reaches that step it exits at once, without cleanup,
exactly as if it had been killed there.  Unset, each check is one dict lookup.
"""

from __future__ import annotations

import os

STEPS = (
    "create:recorded",  # record says creating; nothing in the kernel yet
    "create:cgroup",  # cgroup made and limited; no process
    "create:spawned",  # init running; record still says creating
    "destroy:recorded",  # record says destroying; init alive
    "destroy:killed",  # init dead; cgroup and socket remain
)
NETWORK_STEPS = (
    "create:network",  # a create with a policy: its veth, addresses and rules made; record still says creating
)
SNAPSHOT_STEPS = (
    "snapshot:copied",  # a half-made layer in .incoming-*; the sandbox runs
    "snapshot:frozen",  # likewise, and the sandbox frozen though its record says running
    "snapshot:layer",  # the layer in place; no record names it yet
)

_crash_at = os.environ.get("FORKYARD_ENGINE_CRASH_AT", "")


def reached(step: str) -> None:
    if _crash_at and step == _crash_at:
        os._exit(137)
