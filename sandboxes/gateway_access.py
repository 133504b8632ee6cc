"""The data path straight to a sandbox's host: the ``data_path`` an API answer gives for a sandbox.

A running or paused sandbox's answer carries where its host's gateway
answers (``sandboxes.engine.gateway``) and a data token for it, minted here
for the caller's key (``sandboxes.engine.data_tokens``): the SDK sends that
sandbox's commands and small files there, and the web server never sees
them. Minting costs an HMAC, no query and no call: the host's signing key
came with its heartbeat (``worker.heartbeat``) and waits sealed in its row.

A token lives ``TOKEN_TTL_S`` (never past its key's own expiry); an answer
given later carries a new one. Revoking or deleting a key reaches every
host at once (``key_revoked`` below: ``commands.revoke_data_tokens``), so
no token outlives its key by more than the queue's delay.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import transaction

from console.models import ApiKey
from sandboxes.engine import data_tokens

from . import commands
from .models import Host, Sandbox

TOKEN_TTL_S = 600
STARTED = (Sandbox.State.RUNNING, Sandbox.State.PAUSED)
_secrets: dict[tuple[int, str], bytes] = {}  # (host id, its sealed key as stored) -> the key


@dataclass(frozen=True)
class Access:
    """Who a token is minted for: the caller's key, its team, and the team's requests per second."""

    key_id: str
    team_id: str
    rate: int
    key_expires_at: datetime | None = None

    @classmethod
    def of(cls, key: ApiKey, rate: int) -> Access:
        return cls(key_id=str(key.pk), team_id=str(key.team_id), rate=rate, key_expires_at=key.expires_at)


def _host_secret(host: Host) -> bytes | None:
    sealed = host.gateway_secret
    if not host.gateway_url or not sealed:
        return None
    cache_key = (host.pk, str(sealed))
    secret = _secrets.get(cache_key)
    if secret is None:
        if len(_secrets) > 10_000:
            _secrets.clear()
        secret = _secrets[cache_key] = base64.b64decode(sealed)
    return secret


def data_path(sandbox: Sandbox, access: Access | None) -> dict[str, Any] | None:
    """``{url, token, expires_at}`` for a started sandbox whose host has a gateway; None otherwise (the SDK
    then goes through the API, which answers the same)."""
    if access is None or sandbox.state not in STARTED or sandbox.host is None or not sandbox.engine_id:
        return None
    secret = _host_secret(sandbox.host)
    if secret is None:
        return None
    expires_at = int(time.time()) + TOKEN_TTL_S
    if access.key_expires_at is not None:
        expires_at = min(expires_at, int(access.key_expires_at.timestamp()))
    grant = data_tokens.Grant(
        sandbox=sandbox.id,
        engine_id=sandbox.engine_id,
        team=access.team_id,
        key=access.key_id,
        expires_at=expires_at,
        rate=access.rate,
        region=settings.FORKYARD_REGION,
    )
    return {
        "url": sandbox.host.gateway_url,
        "token": data_tokens.mint(secret, grant),
        "expires_at": datetime.fromtimestamp(expires_at, UTC),
    }


def key_revoked(sender: Any = None, *, key: ApiKey, **_: Any) -> None:
    """A key revoked or deleted: once that commits, every host refuses its data tokens."""
    key_id = str(key.pk)
    transaction.on_commit(lambda: commands.revoke_data_tokens(Host.objects.exclude(state=Host.State.OFFLINE), [key_id]))
