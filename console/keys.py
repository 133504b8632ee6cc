"""API keys: a secret shown once, kept as a visible prefix and an HMAC.

A key reads ``fy_<prefix>_<secret>``.  We store the prefix (to find the row)
and HMAC-SHA256 of the whole key under a key derived from SECRET_KEY (so a
leaked database does not hand out working keys), and compare digests in
constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from .models import ApiKey, Role, Team

PREFIX_BYTES = 6  # 12 hex characters
LAST_USED_GRANULARITY = timedelta(seconds=60)


@dataclass(frozen=True)
class NewKey:
    key: ApiKey
    secret: str  # shown once, never stored


def _digest(secret: str) -> str:
    signing_key = hashlib.sha256(b"forkyard api keys:" + settings.SECRET_KEY.encode()).digest()
    return hmac.new(signing_key, secret.encode(), hashlib.sha256).hexdigest()


@transaction.atomic
def api_key_create(
    *, team: Team, name: str, role: str = Role.ADMIN, created_by: User | None = None, expires_at: datetime | None = None
) -> NewKey:
    prefix = secrets.token_hex(PREFIX_BYTES)
    secret = f"fy_{prefix}_{secrets.token_urlsafe(32)}"
    key = ApiKey.objects.create(
        team=team, name=name, role=role, prefix=prefix, digest=_digest(secret), created_by=created_by, expires_at=expires_at
    )
    return NewKey(key=key, secret=secret)


def api_key_authenticate(secret: str) -> ApiKey | None:
    """The active key for ``secret``, or None.  Never says which part was wrong."""
    parts = secret.split("_", 2)
    if len(parts) != 3 or parts[0] != "fy" or len(parts[1]) != PREFIX_BYTES * 2:
        return None
    key = ApiKey.objects.select_related("team", "team__limits").filter(prefix=parts[1]).first()
    if key is None or not hmac.compare_digest(key.digest, _digest(secret)) or not key.active:
        return None
    now = timezone.now()
    if key.last_used_at is None or now - key.last_used_at > LAST_USED_GRANULARITY:
        # One write a minute per key at most; conditional, so racing requests write once.
        ApiKey.objects.filter(pk=key.pk, last_used_at=key.last_used_at).update(last_used_at=now)
        key.last_used_at = now
    return key


def api_key_revoke(*, key: ApiKey) -> ApiKey:
    ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
    key.refresh_from_db()
    return key
