"""Per-team request rate limits, reported in every API response.

A fixed one-second window per team.  With Redis configured, the counters live
there (shared by every web process); on the embedded default there is one web
process, and they live in its memory.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio
from django.conf import settings

from .errors import OverLimit


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    limit: int
    remaining: int
    reset_s: float

    @property
    def retry_after_s(self) -> int:
        return max(1, math.ceil(self.reset_s))

    def refusal(self) -> OverLimit:
        return OverLimit(
            "rate_limited", f"over the team's limit of {self.limit} requests per second", retry_after_s=self.retry_after_s
        )

    def headers(self) -> dict[str, str]:
        return {
            "X-RateLimit-Limit": str(self.limit),
            "X-RateLimit-Remaining": str(max(0, self.remaining)),
            "X-RateLimit-Reset": str(max(1, math.ceil(self.reset_s))),
        }


class LocalLimiter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._windows: dict[str, tuple[int, int]] = {}
        self._previous: dict[str, tuple[int, int]] = {}  # each team's last whole window, for the limits page

    def hit(self, team_id: str, limit: int) -> Verdict:
        now = time.time()
        window = int(now)
        with self._lock:
            current, count = self._windows.get(team_id, (window, 0))
            if current != window:
                self._previous[team_id] = (current, count)
                current, count = window, 0
            count += 1
            self._windows[team_id] = (current, count)
        return Verdict(allowed=count <= limit, limit=limit, remaining=limit - count, reset_s=window + 1 - now)

    async def ahit(self, team_id: str, limit: int) -> Verdict:
        return self.hit(team_id, limit)  # memory only: no need to leave the event loop

    def last_second(self, team_id: str) -> int:
        """Requests counted in the last whole second (this process's: the embedded default has one web process)."""
        wanted = int(time.time()) - 1
        for window, count in (self._windows.get(team_id, (0, 0)), self._previous.get(team_id, (0, 0))):
            if window == wanted:
                return count
        return 0


class RedisLimiter:
    def __init__(self, url: str) -> None:
        self._url = url
        self._client = redis.Redis.from_url(url)
        self._async_clients: dict[int, Any] = {}

    def hit(self, team_id: str, limit: int) -> Verdict:
        now = time.time()
        window = int(now)
        pipeline = self._client.pipeline()
        pipeline.incr(f"fy:rate:{team_id}:{window}")
        pipeline.expire(f"fy:rate:{team_id}:{window}", 2)
        return self._verdict(int(pipeline.execute()[0]), limit, now)

    async def ahit(self, team_id: str, limit: int) -> Verdict:
        """``hit`` on the event loop's own connection: no thread per request."""
        now = time.time()
        window = int(now)
        pipeline = self._async_client().pipeline(transaction=False)  # one round trip, without MULTI/EXEC
        pipeline.incr(f"fy:rate:{team_id}:{window}")
        pipeline.expire(f"fy:rate:{team_id}:{window}", 2)
        return self._verdict(int((await pipeline.execute())[0]), limit, now)

    def last_second(self, team_id: str) -> int:
        """Requests counted in the last whole second, by every web process."""
        value = self._client.get(f"fy:rate:{team_id}:{int(time.time()) - 1}")
        return int(value or 0)

    def _async_client(self) -> Any:
        loop = asyncio.get_running_loop()
        client = self._async_clients.get(id(loop))
        if client is None:
            client = self._async_clients[id(loop)] = redis.asyncio.Redis.from_url(self._url)
        return client

    @staticmethod
    def _verdict(count: int, limit: int, now: float) -> Verdict:
        window = int(now)
        return Verdict(allowed=count <= limit, limit=limit, remaining=limit - count, reset_s=window + 1 - now)


_limiter: LocalLimiter | RedisLimiter | None = None


def limiter() -> LocalLimiter | RedisLimiter:
    global _limiter
    if _limiter is None:
        _limiter = RedisLimiter(settings.REDIS_URL) if settings.REDIS_URL else LocalLimiter()
    return _limiter
