"""Per-team request rate limits, reported in every API response.

A fixed one-second window per team.  With Redis configured, the counters live
there (shared by every web process); on the embedded default there is one web
process, and they live in its memory.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from django.conf import settings


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    limit: int
    remaining: int
    reset_s: float

    @property
    def retry_after_s(self) -> int:
        return max(1, math.ceil(self.reset_s))

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

    def hit(self, team_id: str, limit: int) -> Verdict:
        now = time.time()
        window = int(now)
        with self._lock:
            current, count = self._windows.get(team_id, (window, 0))
            if current != window:
                current, count = window, 0
            count += 1
            self._windows[team_id] = (current, count)
        return Verdict(allowed=count <= limit, limit=limit, remaining=limit - count, reset_s=window + 1 - now)


class RedisLimiter:
    def __init__(self, url: str) -> None:
        import redis

        self._client = redis.Redis.from_url(url)

    def hit(self, team_id: str, limit: int) -> Verdict:
        now = time.time()
        window = int(now)
        key = f"fy:rate:{team_id}:{window}"
        pipeline = self._client.pipeline()
        pipeline.incr(key)
        pipeline.expire(key, 2)
        count = int(pipeline.execute()[0])
        return Verdict(allowed=count <= limit, limit=limit, remaining=limit - count, reset_s=window + 1 - now)


_limiter: LocalLimiter | RedisLimiter | None = None


def limiter() -> LocalLimiter | RedisLimiter:
    global _limiter
    if _limiter is None:
        _limiter = RedisLimiter(settings.REDIS_URL) if settings.REDIS_URL else LocalLimiter()
    return _limiter
