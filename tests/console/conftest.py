"""Fixtures for the console: two teams, users in each role, and factories for their objects."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

from billing.models import UsagePeriod
from billing.services import amount_for
from console.keys import api_key_create
from console.models import ApiKey, Membership, Role, Team
from console.services import team_create
from sandboxes.models import Host, Launch, NetworkPolicy, Sandbox

PASSWORD = "a-long-enough-password"
TINY = Decimal("0.0073125")  # the tiny size's price per hour


@dataclass
class World:
    team_a: Team
    team_b: Team
    key_a: ApiKey
    key_b: ApiKey
    owner: User  # owner of team A
    admin: User  # admin of team A
    member: User  # member of team A
    stranger: User  # owner of team B only


@pytest.fixture(autouse=True)
def fast_passwords(settings: Any) -> None:
    # Real hashing costs a third of a second a user; these tests make dozens.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def _user(name: str, team: Team, role: str) -> User:
    user = User.objects.create_user(name, email=f"{name}@example.com", password=PASSWORD)
    Membership.objects.create(team=team, user=user, role=role)
    return user


@pytest.fixture
def world(db: Any) -> World:
    team_a, team_b = team_create(name="Team A"), team_create(name="Team B")
    return World(
        team_a=team_a,
        team_b=team_b,
        key_a=api_key_create(team=team_a, name="trainer").key,
        key_b=api_key_create(team=team_b, name="other-trainer").key,
        owner=_user("olive", team_a, Role.OWNER),
        admin=_user("adam", team_a, Role.ADMIN),
        member=_user("mel", team_a, Role.MEMBER),
        stranger=_user("bertha-of-b", team_b, Role.OWNER),
    )


def client_for(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def member_client(world: World) -> Client:
    return client_for(world.member)


@pytest.fixture
def admin_client(world: World) -> Client:
    return client_for(world.admin)


@pytest.fixture
def owner_client(world: World) -> Client:
    return client_for(world.owner)


@pytest.fixture
def host(db: Any) -> Host:
    # No engine listens here: commands sent to it fail as "host unavailable". Its capacity is what its agent
    # would have registered, so that admission takes what fits.
    return Host.objects.create(
        name="test-host", queue="host.test", engine_socket="/nonexistent/engine.sock", region="local",
        max_sandboxes=1000, cpus=2, memory_mib=8192,
    )


SandboxFactory = Callable[..., Sandbox]


@pytest.fixture
def make_sandbox(db: Any) -> SandboxFactory:
    def make(key: ApiKey, **fields: Any) -> Sandbox:
        values: dict[str, Any] = {"template": "base", "size": "tiny", "cpu": 1.0, "memory_mib": 128, "ttl_s": 600}
        values.update(fields)
        return Sandbox.objects.create(team=key.team, api_key=key, **values)

    return make


@pytest.fixture
def make_launch(db: Any) -> Callable[..., Launch]:
    def make(key: ApiKey, count: int = 3, **fields: Any) -> Launch:
        values: dict[str, Any] = {"template": "base", "size": "tiny", "cpu": 1.0, "memory_mib": 128, "ttl_s": 600}
        values.update(fields)
        launch = Launch.objects.create(team=key.team, api_key=key, count=count, **values)
        Sandbox.objects.bulk_create(
            Sandbox(team=key.team, api_key=key, launch=launch, launch_index=index, **values) for index in range(count)
        )
        return launch

    return make


@pytest.fixture
def make_policy(db: Any) -> Callable[..., NetworkPolicy]:
    def make(team: Team, name: str = "pypi", egress: list[dict[str, Any]] | None = None) -> NetworkPolicy:
        rules = egress if egress is not None else [{"host": "pypi.org", "cidr": None, "ports": [443], "protocol": "tcp"}]
        return NetworkPolicy.objects.create(team=team, name=name, egress=rules)

    return make


def usage_period(
    world: World,
    start: datetime,
    end: datetime | None = None,
    size: str = "tiny",
    key: ApiKey | None = None,
    price: Decimal = TINY,
) -> UsagePeriod:
    """A running period of team A's, closed (with its amount) if it has an end."""
    duration = int((end - start).total_seconds() * 1000) if end else None
    return UsagePeriod.objects.create(
        team=world.team_a,
        api_key=key or world.key_a,
        kind="running",
        size=size,
        unit_price=price,
        started_at=start,
        ended_at=end,
        duration_ms=duration,
        amount=amount_for(duration, price) if duration is not None else None,
    )
