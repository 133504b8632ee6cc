"""Secrets at rest: values sealed (Fernet: AES-128-CBC and an HMAC) under a key derived from SECRET_KEY.

A sandbox's environment may hold secrets, and waits in the database (and,
for a launch, in the broker's message) until its host's engine takes it; it
is then cleared.  A cleared value can outlive its row's update in the
database's write-ahead log, its free pages or a backup: sealed, what
outlives it is ciphertext.  ``SealedJSONField`` seals a model field that
way; ``seal``/``unseal`` a value that travels in a message.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
from typing import Any

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings
from django.db import models

PREFIX = "sealed:"


@functools.cache
def _fernet(secret_key: str) -> Fernet:
    return Fernet(base64.urlsafe_b64encode(hashlib.sha256(b"forkyard sealing:" + secret_key.encode()).digest()))


def seal(value: Any) -> str:
    """The value as JSON, sealed; "" for an empty one (nothing to keep secret)."""
    if not value:
        return ""
    return PREFIX + _fernet(settings.SECRET_KEY).encrypt(json.dumps(value).encode()).decode()


def unseal(token: str) -> Any:
    """What ``seal`` sealed ({} for ""); ``ValueError`` if it was not sealed under this deployment's key."""
    if not token:
        return {}
    if not token.startswith(PREFIX):
        return json.loads(token)  # written before values were sealed
    try:
        return json.loads(_fernet(settings.SECRET_KEY).decrypt(token[len(PREFIX) :].encode()))
    except InvalidToken:
        raise ValueError("a sealed value that this deployment's key does not open") from None


class SealedJSONField(models.TextField):  # type: ignore[type-arg]  # generic only in the stubs
    """A JSON value stored sealed (see ``seal``): the database holds ciphertext, Python sees the value."""

    # What django-stubs' plugin reads for the types assigned and read: a JSON value, not text.
    _pyi_private_set_type: Any
    _pyi_private_get_type: Any

    def from_db_value(self, value: str | None, expression: Any, connection: Any) -> Any:
        return unseal(value or "")

    def to_python(self, value: Any) -> Any:
        return unseal(value) if isinstance(value, str) else value

    def get_prep_value(self, value: Any) -> str:
        return seal(value)
