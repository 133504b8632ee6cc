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
import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.dispatch import Signal
from django.utils import timezone

from .audit import Act, Actor, audit_record
from .errors import Conflict
from .models import ApiKey, Role, Team
from .permissions import describe_scopes, parse_label_limit, parse_scopes

PREFIX_BYTES = 6  # 12 hex characters
LAST_USED_GRANULARITY = timedelta(seconds=60)
# How long a web process trusts a key it checked (``remember``/``remembered``): a command
# through the API then costs no query for its key.  A revocation, or a change to the key,
# its team or the team's limits, made in this process is seen at once (``forget_keys``);
# made in another web process, within this many seconds.
RECENT_S = 5.0
_recent: dict[str, tuple[float, ApiKey, int]] = {}  # digest of the secret -> (until, the key, its team's requests per second)


@dataclass(frozen=True)
class NewKey:
    key: ApiKey
    secret: str  # shown once, never stored


def _digest(secret: str) -> str:
    signing_key = hashlib.sha256(b"forkyard api keys:" + settings.SECRET_KEY.encode()).digest()
    return hmac.new(signing_key, secret.encode(), hashlib.sha256).hexdigest()


def _new_secret() -> tuple[str, str]:
    prefix = secrets.token_hex(PREFIX_BYTES)
    return prefix, f"fy_{prefix}_{secrets.token_urlsafe(32)}"


@transaction.atomic
def api_key_create(
    *,
    team: Team,
    name: str,
    role: str = Role.ADMIN,
    created_by: User | None = None,
    expires_at: datetime | None = None,
    scopes: list[str] | None = None,
    label_limit: dict[str, str] | None = None,
    actor: Actor | None = None,
) -> NewKey:
    """A new key, its secret returned once; ``scopes`` and ``label_limit`` narrow it (``console.permissions``)."""
    prefix, secret = _new_secret()
    key = ApiKey.objects.create(
        team=team,
        name=name,
        role=role,
        prefix=prefix,
        digest=_digest(secret),
        created_by=created_by,
        expires_at=expires_at,
        scopes=parse_scopes(scopes or []),
        label_limit=parse_label_limit(label_limit),
    )
    audit_record(
        team=team,
        actor=actor or Actor(user=created_by),
        action=Act.KEY_CREATED,
        target_type="key",
        target_id=key.id,
        target=key.name,
        details={"role": role, "scopes": describe_scopes(key.scopes), "label_limit": key.label_limit, "prefix": prefix},
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


def remember(secret: str, key: ApiKey, requests_per_second: int) -> None:
    """Trust ``key`` (and its team's rate limit) for ``secret`` for ``RECENT_S`` seconds."""
    if len(_recent) > 100_000:
        _recent.clear()
    _recent[_digest(secret)] = (time.monotonic() + RECENT_S, key, requests_per_second)


def remembered(secret: str) -> tuple[ApiKey, int] | None:
    """The key checked for ``secret`` within ``RECENT_S``, still active, and its team's rate limit; None: look it up."""
    entry = _recent.get(_digest(secret))
    if entry is None or entry[0] < time.monotonic() or not entry[1].active:
        return None
    return entry[1], entry[2]


def forget_keys(*_: object, **__: object) -> None:
    """Trust no key checked before now (a key, a team or its limits changed)."""
    _recent.clear()


# Sent once a key is revoked (``key``: the key). A receiver may act on it: the sandboxes app tells every
# host's gateway to refuse the key's data tokens (``sandboxes.gateway_access``).
key_revoked = Signal()


@transaction.atomic
def api_key_revoke(*, key: ApiKey, actor: Actor | None = None) -> ApiKey:
    if ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now()):
        audit_record(team=key.team_id, actor=actor, action=Act.KEY_REVOKED, target_type="key", target_id=key.id, target=key.name)
        key_revoked.send(sender=ApiKey, key=key)
    transaction.on_commit(forget_keys)
    forget_keys()
    key.refresh_from_db()
    return key


@transaction.atomic
def api_key_rename(*, key: ApiKey, name: str, actor: Actor | None = None) -> ApiKey:
    before = key.name
    if name != before:
        ApiKey.objects.filter(pk=key.pk).update(name=name)
        audit_record(
            team=key.team_id, actor=actor, action=Act.KEY_RENAMED, target_type="key", target_id=key.id, target=name,
            details={"from": before, "to": name},
        )
    key.refresh_from_db()
    return key


@transaction.atomic
def api_key_rotate(*, key: ApiKey, actor: Actor | None = None) -> NewKey:
    """A new secret for the same key (its id, name, role, scopes and usage stay); the old secret stops working now."""
    rotated = ApiKey.objects.select_for_update().get(pk=key.pk)
    if not rotated.active:
        raise Conflict("key_not_active", "a revoked or expired key cannot be rotated: make a new one")
    prefix, secret = _new_secret()
    rotated.prefix, rotated.digest, rotated.rotated_at = prefix, _digest(secret), timezone.now()
    rotated.save(update_fields=["prefix", "digest", "rotated_at"])
    audit_record(
        team=key.team_id, actor=actor, action=Act.KEY_ROTATED, target_type="key", target_id=key.id, target=key.name,
        details={"prefix": prefix},
    )
    transaction.on_commit(forget_keys)
    forget_keys()
    return NewKey(key=rotated, secret=secret)


@transaction.atomic
def api_key_delete(*, key: ApiKey, actor: Actor | None = None) -> ApiKey:
    """Gone for good: it no longer authenticates nor lists; what it was used for stays, as "(console or deleted key)"."""
    audit_record(
        team=key.team_id, actor=actor, action=Act.KEY_DELETED, target_type="key", target_id=key.id, target=key.name,
        details={"prefix": key.prefix},
    )
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
    ApiKey.objects.filter(pk=key.pk).delete()
    transaction.on_commit(forget_keys)
    forget_keys()
    return key
