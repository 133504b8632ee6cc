"""Fixtures for the control plane tested in-process: a team, hosts, a fake engine per host, the commands sent.

The database is the real one (SQLite, or PostgreSQL on the second pass);
the engine is ``tests.support.fake_engine`` (its real self is tested in
``tests/engine``); the commands a test's code queues are recorded rather
than handed to a broker nobody here consumes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.utils import timezone

from billing.services import install_default_prices
from console.keys import api_key_create
from console.models import ApiKey, Team
from console.services import team_create
from sandboxes import commands, engine_link
from sandboxes.models import Host, Launch, Sandbox, Template
from tests.support.fake_engine import FakeEngine


@dataclass
class Sent:
    """The commands queued, in order; ``then`` runs a callback when one of a name is sent (once)."""

    commands: list[tuple[str, list[Any], str, int | None]] = field(default_factory=list)  # (name, args, queue, expires)
    callbacks: dict[str, Callable[[list[Any]], None]] = field(default_factory=dict)

    def named(self, command: commands.Command) -> list[list[Any]]:
        return [args for name, args, _, _ in self.commands if name == str(command)]

    def then(self, command: commands.Command, callback: Callable[[list[Any]], None]) -> None:
        self.callbacks[str(command)] = callback


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Sent:
    record = Sent()

    def send_task(name: str, args: list[Any], queue: str, expires: int | None) -> None:
        record.commands.append((name, args, queue, expires))
        callback = record.callbacks.pop(name, None)
        if callback is not None:
            callback(args)

    monkeypatch.setattr(commands.app, "send_task", send_task)
    return record


@dataclass
class Cluster:
    """Hosts registered as their agents would register them, each with its fake engine."""

    engines: dict[str, FakeEngine] = field(default_factory=dict)

    def add_host(self, name: str, max_sandboxes: int = 1000) -> Host:
        address = f"/fake/{name}.sock"
        self.engines[address] = FakeEngine(max_sandboxes=max_sandboxes)
        host = Host.objects.create(
            name=name,
            queue=f"host.{name}",
            engine_socket=address,
            region="local",
            max_sandboxes=max_sandboxes,
            last_heartbeat=timezone.now(),
        )
        template, _ = Template.objects.get_or_create(name="base", team=None)
        template.hosts.add(host)
        return host

    def engine(self, host: Host) -> FakeEngine:
        return self.engines[host.engine_socket]


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    made = Cluster()
    with engine_link.connected_to(lambda address: made.engines[address]):
        yield made


@pytest.fixture
def key(db: Any) -> ApiKey:
    install_default_prices()
    team = team_create(name="Rollouts")
    return api_key_create(team=team, name="trainer").key


@pytest.fixture
def team(key: ApiKey) -> Team:
    return key.team


@pytest.fixture
def make_row(key: ApiKey) -> Callable[..., Sandbox]:
    """A sandbox row in any state, as the control plane records one (tiny, from base)."""

    def make(state: str = Sandbox.State.QUEUED, **fields: Any) -> Sandbox:
        values: dict[str, Any] = {"template": "base", "size": "tiny", "cpu": 1.0, "memory_mib": 128, "ttl_s": 600, "state": state}
        values.update(fields)
        return Sandbox.objects.create(team=key.team, api_key=key, **values)

    return make


@pytest.fixture
def make_launch_row(key: ApiKey) -> Callable[..., Launch]:
    def make(count: int = 4, **fields: Any) -> Launch:
        values: dict[str, Any] = {"template": "base", "size": "tiny", "cpu": 1.0, "memory_mib": 128, "ttl_s": 600}
        values.update(fields)
        return Launch.objects.create(team=key.team, api_key=key, count=count, **values)

    return make
