"""API keys: shown once, stored as a prefix and an HMAC, checked in constant time."""

from datetime import timedelta

import pytest
from django.utils import timezone

from console.keys import api_key_authenticate, api_key_create, api_key_revoke
from console.models import ApiKey
from console.services import team_create

pytestmark = pytest.mark.django_db


@pytest.fixture
def team():
    return team_create(name="Keys Inc")


def test_the_secret_is_not_stored(team):
    new = api_key_create(team=team, name="ci")
    assert new.secret.startswith(f"fy_{new.key.prefix}_")
    stored = ApiKey.objects.get(pk=new.key.pk)
    assert new.secret not in (stored.digest, stored.prefix, stored.name)
    assert len(stored.digest) == 64


def test_authenticate_accepts_only_the_exact_active_key(team):
    new = api_key_create(team=team, name="ci")
    assert api_key_authenticate(new.secret).pk == new.key.pk
    assert api_key_authenticate(new.secret[:-1] + ("A" if new.secret[-1] != "A" else "B")) is None
    assert api_key_authenticate("fy_" + "0" * 12 + "_x") is None
    assert api_key_authenticate("not a key") is None
    api_key_revoke(key=new.key)
    assert api_key_authenticate(new.secret) is None


def test_expired_keys_are_refused(team):
    new = api_key_create(team=team, name="old", expires_at=timezone.now() - timedelta(seconds=1))
    assert api_key_authenticate(new.secret) is None


def test_last_used_is_written_at_most_once_a_minute(team):
    new = api_key_create(team=team, name="busy")
    api_key_authenticate(new.secret)
    first = ApiKey.objects.get(pk=new.key.pk).last_used_at
    api_key_authenticate(new.secret)
    assert ApiKey.objects.get(pk=new.key.pk).last_used_at == first
