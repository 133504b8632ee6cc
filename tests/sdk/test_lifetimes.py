"""Sandboxes that die with their client: real client processes, killed (SIGKILL), stopped (SIGTERM), interrupted (SIGINT).

Each scenario is a Python process of its own using the SDK against the real
stack: it makes sandboxes and a launch, prints their ids, and waits to be
signalled.  The test then signals it and follows the sandboxes through the
API until they are gone, within a generous guard (never a timing).  Where a
lease's grace is long (600 s), only the client ending its lease explains
sandboxes gone in a minute; where it is short (a SIGKILL, which nothing can
catch), the lease's expiry does.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from forkyard import Client
from tests.support.stack import Stack

pytestmark = pytest.mark.root
ENDED = ("destroyed", "stopped", "failed")

MAKE = """
import asyncio, json, sys, time
from forkyard import AsyncClient, Client, LeaseOptions
TAG = sys.argv[1]

def made(sandboxes, launch, **extra):
    print(json.dumps({"sandboxes": [s.id for s in sandboxes], "launch": launch.id, **extra}), flush=True)
"""

SCENARIOS = {
    # A leased client killed outright: nothing runs in it, its heartbeats stop, the lease expires.
    "sigkill": """
fy = Client(lease=LeaseOptions(grace_s=3))
sandboxes = [fy.sandboxes.create(template="base", size="tiny", ttl_s=600, labels={"life": TAG}) for _ in range(2)]
launch = fy.launches.create(template="base", size="tiny", count=2, ttl_s=600, labels={"life": TAG})
list(launch.wait(timeout_s=120))
made(sandboxes, launch, lease=fy.lease.id)
time.sleep(600)
""",
    # kill_on_exit: SIGTERM ends the lease at once (its grace is long), then the process dies of the signal;
    # Ctrl-C's KeyboardInterrupt ends the process, and the lease with it (at exit).
    "kill-on-exit": """
fy = Client(kill_on_exit=True, lease=LeaseOptions(grace_s=600))
sandboxes = [fy.sandboxes.create(template="base", size="tiny", ttl_s=600, labels={"life": TAG}) for _ in range(2)]
launch = fy.launches.create(template="base", size="tiny", count=2, ttl_s=600, labels={"life": TAG})
made(sandboxes, launch, lease=fy.lease.id)
time.sleep(600)
""",
    # Context managers, Ctrl-C, no kill_on_exit: each `with` closes what it opened, and only that.
    "with-blocks": """
plain = Client()
kept = plain.sandboxes.create(template="base", size="tiny", ttl_s=600, labels={"life": TAG, "kept": "1"})
with Client(lease=LeaseOptions(grace_s=600)) as leased:
    owned = leased.sandboxes.create(template="base", size="tiny", ttl_s=600, labels={"life": TAG})
    with plain.sandboxes.create(template="base", size="tiny", ttl_s=600, labels={"life": TAG}) as scoped:
        with plain.launches.create(template="base", size="tiny", count=2, ttl_s=600, labels={"life": TAG}) as launch:
            list(launch.wait(timeout_s=120))
            made([owned, scoped], launch, kept=kept.id, lease=leased.lease.id)
            time.sleep(600)
""",
    # The async client's blocks, no kill_on_exit, work under asyncio.gather when the signal comes: Ctrl-C
    # (asyncio.run cancels the main task) and SIGTERM (the SDK's blocks cancel it the same way).
    "async-with-blocks": """
async def main():
    plain = AsyncClient()
    kept = await plain.sandboxes.create(template="base", size="tiny", ttl_s=600, labels={"life": TAG, "kept": "1"})
    async with AsyncClient(lease=LeaseOptions(grace_s=600)) as leased:
        owned = await leased.sandboxes.create(template="base", size="tiny", ttl_s=600, labels={"life": TAG})
        async with await plain.sandboxes.create(template="base", size="tiny", ttl_s=600, labels={"life": TAG}) as scoped:
            launch = await plain.launches.create(template="base", size="tiny", count=2, ttl_s=600, labels={"life": TAG})
            async with launch:
                async for _ in launch.wait(timeout_s=120):
                    pass
                made([owned, scoped], launch, kept=kept.id, lease=leased.lease.id)
                await asyncio.gather(*(asyncio.sleep(600) for _ in range(3)))
asyncio.run(main())
""",
    # The async client, kill_on_exit, SIGTERM in the middle of its event loop.
    "async-sigterm": """
async def main():
    fy = AsyncClient(kill_on_exit=True, lease=LeaseOptions(grace_s=600))
    sandboxes = [await fy.sandboxes.create(template="base", size="tiny", ttl_s=600, labels={"life": TAG}) for _ in range(2)]
    launch = await fy.launches.create(template="base", size="tiny", count=2, ttl_s=600, labels={"life": TAG})
    made(sandboxes, launch, lease=fy.lease.id)
    await asyncio.sleep(600)
asyncio.run(main())
""",
}


class ClientProcess:
    def __init__(self, stack: Stack, scenario: str, tag: str) -> None:
        environment = {**os.environ, "FORKYARD_URL": stack.url, "FORKYARD_API_KEY": stack.teams[0].key}
        script = textwrap.dedent(MAKE) + textwrap.dedent(SCENARIOS[scenario])
        self.process = subprocess.Popen(
            [sys.executable, "-c", script, tag], env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def made(self) -> dict[str, Any]:
        """What the client made, once it has (a guard against a hang, not a measure)."""
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], 180)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.process.kill()
            raise AssertionError(f"the client made nothing: {self.process.communicate(timeout=30)[1][-3000:]}")
        made: dict[str, Any] = json.loads(line)
        return made

    def signal(self, number: int) -> int:
        self.process.send_signal(number)
        return self.process.wait(timeout=60)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


@pytest.fixture
def client_process(stack: Stack, fy: Client) -> Iterator[Any]:
    started: list[ClientProcess] = []
    tags: list[str] = []

    def start(scenario: str) -> ClientProcess:
        tags.append(uuid.uuid4().hex[:8])
        started.append(ClientProcess(stack, scenario, tags[-1]))
        return started[-1]

    yield start
    for process in started:
        process.close()
    for tag in tags:
        fy.sandboxes.kill_all(label=f"life:{tag}")


def states(fy: Client, made: dict[str, Any]) -> dict[str, str]:
    found = {sandbox_id: fy.sandboxes.get(sandbox_id).state for sandbox_id in made["sandboxes"]}
    found.update({child.id: child.state for child in fy.launches.get(made["launch"]).sandboxes()})
    return found


def wait_gone(fy: Client, made: dict[str, Any], guard_s: float = 120) -> dict[str, str]:
    deadline = time.monotonic() + guard_s  # a guard against a hang, not a measure
    while True:
        now = states(fy, made)
        if all(state in ENDED for state in now.values()) or time.monotonic() > deadline:
            return now
        time.sleep(0.25)


def test_a_leased_client_killed_outright_loses_its_sandboxes_when_its_lease_expires(fy: Client, client_process: Any) -> None:
    client = client_process("sigkill")
    made = client.made()
    # Alive, it heartbeats: its sandboxes outlive the 3 s grace several times over.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert set(states(fy, made).values()) == {"running"}, "a heartbeaten lease lost its sandboxes"
        time.sleep(0.5)
    assert fy.leases.get(made["lease"]).active
    assert client.signal(signal.SIGKILL) == -signal.SIGKILL
    assert set(wait_gone(fy, made).values()) == {"destroyed"}
    lease = fy.leases.get(made["lease"])
    assert lease.state == "expired" and lease.sandboxes_alive == 0
    assert fy.launches.get(made["launch"]).state == "stopped"
    ended = [fy.sandboxes.get(sandbox_id).ended_at for sandbox_id in made["sandboxes"]]
    assert lease.expires_at is not None and all(when is not None and when >= lease.expires_at for when in ended), (
        "destroyed before its lease expired"
    )


@pytest.mark.parametrize(
    ("scenario", "number"),
    [("kill-on-exit", signal.SIGTERM), ("kill-on-exit", signal.SIGINT), ("async-sigterm", signal.SIGTERM)],
    ids=["sigterm", "sigint", "async-sigterm"],
)
def test_kill_on_exit_ends_the_clients_sandboxes_when_the_process_is_signalled(
    fy: Client, client_process: Any, scenario: str, number: int
) -> None:
    client = client_process(scenario)
    made = client.made()
    assert set(states(fy, made).values()) <= {"queued", "creating", "running"}
    status = client.signal(number)
    assert status in (-number, 128 + number, 1), status  # died of it (SIGTERM), or of its KeyboardInterrupt (SIGINT)
    assert set(wait_gone(fy, made).values()) == {"destroyed"}, "its 600 s lease was not ended"
    assert fy.leases.get(made["lease"]).state == "ended"


@pytest.mark.parametrize(
    ("scenario", "number", "status"),
    [
        ("with-blocks", signal.SIGINT, -signal.SIGINT),
        ("with-blocks", signal.SIGTERM, 128 + signal.SIGTERM),
        ("async-with-blocks", signal.SIGINT, -signal.SIGINT),
        ("async-with-blocks", signal.SIGTERM, 128 + signal.SIGTERM),
    ],
    ids=["ctrl-c", "sigterm", "async-ctrl-c-under-gather", "async-sigterm-under-gather"],
)
def test_context_managers_close_what_they_opened_on_ctrl_c_and_sigterm(
    fy: Client, client_process: Any, scenario: str, number: int, status: int
) -> None:
    """Without kill_on_exit: the blocks close as they unwind. The lease's grace is 600 s, so sandboxes gone in a
    minute were killed by their blocks. Ctrl-C ends the process as Python does (it dies of SIGINT once its
    KeyboardInterrupt unwound it); SIGTERM with 143, the status a process SIGTERM killed reports."""
    client = client_process(scenario)
    made = client.made()
    assert client.signal(number) == status
    assert set(wait_gone(fy, made).values()) == {"destroyed"}
    assert fy.leases.get(made["lease"]).state == "ended"
    assert fy.sandboxes.get(made["kept"]).state == "running", "a sandbox made outside any block was killed"
