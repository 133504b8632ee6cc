"""Fixtures for the SDK and CLI tests: clients of the real stack (tests/support/stack.py), and the CLI as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from forkyard import Client, Sandbox
from tests.support.stack import Stack
from tests.support.stack import Team as StackTeam

CLI = Path(sys.executable).with_name("forkyard")


@pytest.fixture
def fy(stack: Stack) -> Iterator[Client]:
    """Team A's client, with its admin key."""
    with Client(stack.url, stack.teams[0].key) as client:
        yield client


@pytest.fixture
def fy_b(stack: Stack, team_b: StackTeam) -> Iterator[Client]:
    """Team B's client: it must never see team A's objects."""
    with Client(stack.url, team_b.key) as client:
        yield client


@pytest.fixture
def sb(fy: Client) -> Iterator[Sandbox]:
    """A running tiny sandbox of team A, killed afterwards."""
    sandbox = fy.sandboxes.create(template="base", size="tiny", ttl_s=300, labels={"suite": "sdk"})
    yield sandbox
    sandbox.kill(wait=False)


Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def cli(stack: Stack) -> Run:
    """Runs the installed ``forkyard`` command against the stack, as team A."""

    def run(
        *args: str, key: str | None = None, stdin: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        environment = {**os.environ, "FORKYARD_URL": stack.url, "FORKYARD_API_KEY": key or stack.teams[0].key}
        command = [str(CLI)] if CLI.exists() else [sys.executable, "-m", "forkyard.cli"]
        return subprocess.run(command + list(args), env=environment, input=stdin, capture_output=True, text=True, timeout=timeout)

    return run
