"""A team's inference limits: requests and tokens per minute, in fixed one-minute windows.

Counted before a call (a request) and after it (its tokens): a call is
refused while this minute's requests are over the team's limit, or its
tokens already are, with ``429`` and ``Retry-After`` until the window turns.
With Redis configured, the counters live there (every web process shares
them); on the embedded default, in the web process's memory.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio
from django.conf import settings

from console.errors import OverLimit

WINDOW_S = 60
log = logging.getLogger("forkyard.grading.limits")
_counting: set[asyncio.Task[None]] = set()  # tokens on their way to the counters (kept from the collector)


@dataclass(frozen=True)
class Usage:
    requests: int
    tokens: int
    reset_s: float


def _window(now: float) -> tuple[int, float]:
    start = int(now // WINDOW_S) * WINDOW_S
    return start, start + WINDOW_S - now


class LocalCounters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._windows: dict[str, tuple[int, int, int]] = {}  # team -> (window start, requests, tokens)

    async def request(self, team_id: str) -> Usage:
        now = time.time()
        start, reset = _window(now)
        with self._lock:
            window, requests, tokens = self._windows.get(team_id, (start, 0, 0))
            if window != start:
                requests, tokens = 0, 0
            self._windows[team_id] = (start, requests + 1, tokens)
        return Usage(requests + 1, tokens, reset)

    async def add_tokens(self, team_id: str, count: int) -> None:
        start, _ = _window(time.time())
        with self._lock:
            window, requests, tokens = self._windows.get(team_id, (start, 0, 0))
            if window != start:
                requests, tokens = 0, 0
            self._windows[team_id] = (start, requests, tokens + count)


class RedisCounters:
    def __init__(self, url: str, prefix: str) -> None:
        self._url, self._prefix = url, prefix
        self._clients: dict[int, Any] = {}

    def _client(self) -> Any:
        loop = asyncio.get_running_loop()
        client = self._clients.get(id(loop))
        if client is None:
            client = self._clients[id(loop)] = redis.asyncio.Redis.from_url(self._url)
        return client

    def _keys(self, team_id: str, start: int) -> tuple[str, str]:
        return f"{self._prefix}:inference:{team_id}:{start}:requests", f"{self._prefix}:inference:{team_id}:{start}:tokens"

    async def request(self, team_id: str) -> Usage:
        start, reset = _window(time.time())
        requests_key, tokens_key = self._keys(team_id, start)
        pipeline = self._client().pipeline(transaction=False)  # one round trip; MULTI/EXEC would add two replies
        pipeline.incr(requests_key)
        pipeline.expire(requests_key, WINDOW_S * 2)
        pipeline.get(tokens_key)
        requests, _, tokens = await pipeline.execute()
        return Usage(int(requests), int(tokens or 0), reset)

    async def add_tokens(self, team_id: str, count: int) -> None:
        start, _ = _window(time.time())
        _, tokens_key = self._keys(team_id, start)
        pipeline = self._client().pipeline(transaction=False)
        pipeline.incrby(tokens_key, count)
        pipeline.expire(tokens_key, WINDOW_S * 2)
        await pipeline.execute()


_counters: LocalCounters | RedisCounters | None = None


def counters() -> LocalCounters | RedisCounters:
    global _counters
    if _counters is None:
        _counters = RedisCounters(settings.REDIS_URL, settings.REDIS_PREFIX) if settings.REDIS_URL else LocalCounters()
    return _counters


async def admit(team_id: str, requests_per_minute: int, tokens_per_minute: int) -> None:
    """Count this request; ``OverLimit`` (429, with Retry-After) if the team is over either limit this minute."""
    usage = await counters().request(team_id)
    retry_after = max(1, math.ceil(usage.reset_s))
    if usage.requests > requests_per_minute:
        raise OverLimit(
            "inference_rate_limited",
            f"over the team's limit of {requests_per_minute} inference requests per minute",
            details={"limit": requests_per_minute, "kind": "requests"},
            retry_after_s=retry_after,
        )
    if usage.tokens >= tokens_per_minute:
        raise OverLimit(
            "token_rate_limited",
            f"over the team's limit of {tokens_per_minute} tokens per minute",
            details={"limit": tokens_per_minute, "used": usage.tokens, "kind": "tokens"},
            retry_after_s=retry_after,
        )


async def spent(team_id: str, tokens: int) -> None:
    if tokens > 0:
        await counters().add_tokens(team_id, tokens)


def spent_soon(team_id: str, tokens: int) -> None:
    """Count a call's tokens without its answer waiting on it (a round trip to Redis): a task of its own,
    done long before the team's next call is admitted. A failure to count is logged, never the caller's."""
    if tokens <= 0:
        return
    task = asyncio.ensure_future(spent(team_id, tokens))
    _counting.add(task)
    task.add_done_callback(_counted)


def _counted(task: asyncio.Task[None]) -> None:
    _counting.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.error("counting tokens failed: %s", type(task.exception()).__name__)
