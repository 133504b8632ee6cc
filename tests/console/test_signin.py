"""Sign-in throttling: per account and per address, on the console's form and the admin's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.cache import cache
from django.test import Client

from console import throttle
from tests.console.conftest import PASSWORD, World

THROTTLED = "Too many failed sign-ins for this account or from this address"


@pytest.fixture(autouse=True)
def fresh_counters() -> Iterator[None]:
    cache.clear()
    yield
    cache.clear()


def sign_in(client: Client, url: str, username: str, password: str, address: str = "198.18.0.10") -> str:
    response = client.post(url, {"username": username, "password": password}, REMOTE_ADDR=address)
    return response.content.decode() if response.status_code == 200 else f"redirected to {response['Location']}"


@pytest.mark.parametrize("url", ["/login/", "/admin/login/"])
def test_an_account_is_refused_after_five_wrong_passwords_even_with_the_right_one(client: Client, world: World, url: str) -> None:
    if url.startswith("/admin"):
        User.objects.filter(pk__in=[world.owner.pk, world.admin.pk]).update(is_staff=True)
    for _ in range(throttle.PER_ACCOUNT):
        assert THROTTLED not in sign_in(client, url, "olive", "wrong-password")
    refused = sign_in(client, url, "olive", PASSWORD)
    assert THROTTLED in refused and "minutes" in refused
    assert THROTTLED in sign_in(client, url, "olive", PASSWORD, address="198.18.0.99"), "from another address too"
    assert sign_in(client, url, "adam", PASSWORD).startswith("redirected"), "another account is not locked out"


def test_an_address_is_refused_after_twenty_failures_across_accounts(client: Client, world: World) -> None:
    for attempt in range(throttle.PER_ADDRESS):
        sign_in(client, "/login/", f"nobody-{attempt}", "guess")
    assert THROTTLED in sign_in(client, "/login/", "mel", PASSWORD)
    assert sign_in(client, "/login/", "mel", PASSWORD, address="198.18.0.11").startswith("redirected")


def test_the_window_passes(client: Client, world: World, monkeypatch: Any) -> None:
    clock = [1_000_000.0]
    monkeypatch.setattr(throttle.time, "time", lambda: clock[0])
    for _ in range(throttle.PER_ACCOUNT):
        sign_in(client, "/login/", "mel", "wrong-password")
    assert THROTTLED in sign_in(client, "/login/", "mel", PASSWORD)
    clock[0] += throttle.WINDOW_S + 1
    assert sign_in(client, "/login/", "mel", PASSWORD).startswith("redirected")


def test_a_right_password_clears_the_accounts_count(client: Client, world: World) -> None:
    for _ in range(throttle.PER_ACCOUNT - 1):
        sign_in(client, "/login/", "mel", "wrong-password")
    assert sign_in(client, "/login/", "mel", PASSWORD).startswith("redirected")
    client.post("/logout/")
    for _ in range(throttle.PER_ACCOUNT - 1):
        assert THROTTLED not in sign_in(client, "/login/", "mel", "wrong-password")
