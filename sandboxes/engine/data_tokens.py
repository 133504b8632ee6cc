"""Data tokens: a short-lived, signed permission to use one sandbox through its host's gateway.

The control plane checks an API key once, then mints a token for a sandbox
of the key's team (``mint``); the SDK sends the sandbox's commands and small
files with it straight to the host that runs the sandbox (``gateway.py``),
which checks it (``verify``) with no database, no other process and no
network round trip: an HMAC-SHA256 over what the token grants, with the
host's own secret.

A token grants exactly one sandbox (the engine's id for it and its public
id), for one team and one key, until it expires (minutes, not hours). It
also carries what the gateway needs to answer as the API would: the team's
request rate and the region. Revoking a key reaches every gateway (its id is
pushed to each host: ``Gateway.revoke``); a token of a revoked key is refused
from then on, however long it had left.

Format: ``fyd1.<base64url(JSON of the grant)>.<base64url(HMAC)>``; the
signature covers the version and the grant, and is compared in constant
time.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

PREFIX = "fyd1"
SECRET_BYTES = 32


class TokenRefused(Exception):
    """A token the gateway will not take; ``code`` says why (``data_token_invalid`` or ``data_token_expired``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Grant:
    """What a data token allows: one sandbox of one team, through one key, until ``expires_at`` (Unix time)."""

    sandbox: str  # its public id, as the caller names it in the URL
    engine_id: str  # the engine's id for it
    team: str
    key: str  # the API key's id: revoking the key ends its tokens
    expires_at: int
    rate: int  # the team's requests per second
    region: str = ""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _signature(secret: bytes, payload: str) -> str:
    return _b64(hmac.new(secret, f"{PREFIX}.{payload}".encode(), hashlib.sha256).digest())


def mint(secret: bytes, grant: Grant) -> str:
    payload = _b64(json.dumps(asdict(grant), separators=(",", ":"), sort_keys=True).encode())
    return f"{PREFIX}.{payload}.{_signature(secret, payload)}"


def verify(secret: bytes, token: str, now: float) -> Grant:
    """The grant a token carries, if its signature is the host's and it has not expired."""
    version, _, rest = token.partition(".")
    payload, _, signature = rest.partition(".")
    if version != PREFIX or not payload or not signature:
        raise TokenRefused("data_token_invalid", "not a data token: get one from the API (the sandbox's data_path)")
    if not hmac.compare_digest(signature, _signature(secret, payload)):
        raise TokenRefused("data_token_invalid", "this data token was not issued for this host, or it was altered")
    try:
        grant = Grant(**json.loads(_unb64(payload)))
    except (ValueError, TypeError, binascii.Error) as error:
        raise TokenRefused("data_token_invalid", "a data token that does not read as a grant") from error
    if grant.expires_at <= now:
        raise TokenRefused("data_token_expired", "this data token has expired: the API's GET of the sandbox gives a new one")
    return grant


def host_secret(path: Path) -> bytes:
    """The host's signing secret, made once and kept (0600) so that its tokens outlive an engine restart."""
    try:
        secret = path.read_bytes()
        if len(secret) == SECRET_BYTES:
            return secret
    except FileNotFoundError:
        pass
    secret = os.urandom(SECRET_BYTES)
    write_private(path, secret)
    return secret


def write_private(path: Path, content: bytes) -> None:
    """Replace ``path`` with ``content``, readable by root only, whole or not at all."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(descriptor, content)
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    os.replace(temporary, path)
