"""Sign-in throttling: failed sign-ins counted per account and per address, in the cache.

After ``PER_ACCOUNT`` failures for one username, or ``PER_ADDRESS`` from one
address, within ``WINDOW_S``, further attempts are refused (even with the
right password) until the window has passed, with a sentence that says so.
Guessing a password at the rate the console answers took seconds a try
before; now an account gets five guesses a quarter hour.  The counters live
in the cache: one web process's memory on the embedded default, Redis (shared
by every web process) in production.
"""

from __future__ import annotations

import hashlib
import time

from django.core.cache import cache

WINDOW_S = 15 * 60
PER_ACCOUNT = 5
PER_ADDRESS = 20


def _keys(username: str, address: str) -> list[tuple[str, int]]:
    account = hashlib.sha256(username.strip().lower().encode()).hexdigest()[:32]  # no raw usernames as cache keys
    return [(f"signin:account:{account}", PER_ACCOUNT), (f"signin:address:{address}", PER_ADDRESS)]


def wait_s(username: str, address: str) -> int:
    """Seconds until this account and address may try again (0: now)."""
    now = time.time()
    waits = [0]
    for key, limit in _keys(username, address):
        failures = [at for at in cache.get(key, []) if now - at < WINDOW_S]
        if len(failures) >= limit:
            waits.append(int(failures[-limit] + WINDOW_S - now) + 1)
    return max(waits)


def failed(username: str, address: str) -> None:
    now = time.time()
    for key, _ in _keys(username, address):
        failures = [at for at in cache.get(key, []) if now - at < WINDOW_S]
        cache.set(key, [*failures, now][-PER_ADDRESS:], WINDOW_S)


def succeeded(username: str, address: str) -> None:
    """A right password clears its account's count (not the address's: it may be guessing others)."""
    cache.delete(_keys(username, address)[0][0])
