"""API keys from the console: the secret is shown once, and revoking works."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import reverse

from console.keys import api_key_authenticate
from console.models import ApiKey
from tests.console.conftest import World

pytestmark = pytest.mark.django_db


def test_the_secret_is_shown_once(admin_client: Client, world: World) -> None:
    response = admin_client.post(reverse("console:key-new"), {"name": "trainer-2", "role": "member", "expires_in_days": "30"})
    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]  # and no cache keeps it
    secret = re.search(r'<pre class="copyable" id="new-secret">(fy_[A-Za-z0-9_-]+)</pre>', response.content.decode())
    assert secret, "the new secret is on the page"
    key = api_key_authenticate(secret.group(1))
    assert key is not None and key.name == "trainer-2" and key.role == "member" and key.expires_at is not None
    assert key.created_by == world.admin
    listing = admin_client.get(reverse("console:keys")).content.decode()
    assert "trainer-2" in listing and key.prefix in listing
    assert secret.group(1) not in listing  # never again
    assert secret.group(1).split("_", 2)[2] not in listing  # nor its secret part alone


def test_revoking_a_key_stops_it(admin_client: Client, world: World) -> None:
    from console.keys import api_key_create

    new = api_key_create(team=world.team_a, name="old")
    assert api_key_authenticate(new.secret) is not None
    response = admin_client.post(reverse("console:key-revoke", args=[new.key.id]), follow=True)
    assert b"is revoked" in response.content
    assert ApiKey.objects.get(pk=new.key.pk).revoked_at is not None
    assert api_key_authenticate(new.secret) is None
    assert admin_client.get(reverse("console:key-revoke", args=[new.key.id])).status_code == 405  # POST only
