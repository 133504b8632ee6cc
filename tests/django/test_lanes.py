"""Which queue each command takes (``sandboxes.commands``): what someone waits on (a snapshot, a single create)
on the host's interactive lane; teardowns, launches' chunks and reconciliation's retries on its bulk lane."""

from __future__ import annotations

from typing import Any

import pytest

from sandboxes.commands import Command
from sandboxes.models import Sandbox
from sandboxes.schemas import SandboxCreate
from sandboxes.services.launches import launch_create
from sandboxes.services.sandboxes import sandbox_create, sandbox_destroy
from sandboxes.services.snapshots import snapshot_create
from sandboxes.worker import dispatch

pytestmark = pytest.mark.django_db(transaction=True)


def _queues(sent: Any, command: Command) -> list[str]:
    return [queue for name, _, queue, _ in sent.commands if name == str(command)]


def test_interactive_commands_take_the_hosts_interactive_lane(cluster: Any, key: Any, sent: Any, make_row: Any) -> None:
    host = cluster.add_host("h1")
    assert host.interactive_queue == "host.h1.interactive"
    spec = SandboxCreate.model_validate({"template": "base", "size": "tiny", "wait": False})
    sandbox, created = sandbox_create(team=key.team, key=key, spec=spec, direct=False)
    assert created and _queues(sent, Command.ENSURE_RUNNING) == ["host.h1.interactive"]

    running = make_row(Sandbox.State.RUNNING, host=host, engine_id="sb-engine-1")
    snapshot_create(team=key.team, key=key, sandbox=running, name="s", labels={}, services=[])
    assert _queues(sent, Command.ENSURE_SNAPSHOT_SAVED) == ["host.h1.interactive"]

    sandbox_destroy(sandbox=running)
    assert _queues(sent, Command.ENSURE_GONE) == ["host.h1"]

    launch, _ = launch_create(
        team=key.team, key=None, spec=SandboxCreate.model_validate({"template": "base", "size": "tiny"}), count=3
    )
    dispatch.dispatch(launch.pk, "")
    assert _queues(sent, Command.ENSURE_RUNNING) == ["host.h1.interactive", "host.h1"], "a launch's chunk is bulk work"
