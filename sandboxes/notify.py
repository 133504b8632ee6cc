"""Telling an API request that its sandbox has settled.

The API queues a create (or destroy) for a host's worker and, by default,
answers once the sandbox is running (or gone).  With Redis, the worker
publishes on a channel per sandbox and the request wakes at once; on the
embedded default the request polls the database row, a few milliseconds apart.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Iterable, Set
from typing import TYPE_CHECKING, Any

from django.conf import settings

from console.db import db

from .models import Sandbox

if TYPE_CHECKING:
    import redis

POLL_S = 0.002  # a create settles within tens of milliseconds: look often, then less
POLL_FAST_FOR_S = 0.25
POLL_MAX_S = 0.05


def _channel(sandbox_id: str) -> str:
    return f"fy:sandbox:{sandbox_id}"


@functools.cache
def _publisher(url: str) -> redis.Redis:
    """One client (and connection pool) per process: a worker publishes after
    every batch it records, and a connection each time cost a TCP handshake."""
    import redis

    return redis.Redis.from_url(url)


def publish(sandbox_ids: Iterable[str]) -> None:
    if not settings.REDIS_URL:
        return
    pipeline = _publisher(settings.REDIS_URL).pipeline()
    for sandbox_id in sandbox_ids:
        pipeline.publish(_channel(sandbox_id), b"1")
    pipeline.execute()


def _state(sandbox_id: str) -> Sandbox:
    return Sandbox.objects.select_related("host").get(pk=sandbox_id)


async def wait_until(sandbox_id: str, settled: Set[str], timeout_s: float) -> Sandbox:
    """The sandbox once its state is in ``settled``, or as it is at the timeout."""
    deadline = time.monotonic() + timeout_s
    if settings.REDIS_URL:
        return await _wait_redis(sandbox_id, settled, deadline)
    fast_until = time.monotonic() + POLL_FAST_FOR_S
    delay = POLL_S
    while True:
        sandbox = await db(_state)(sandbox_id)
        if sandbox.state in settled or time.monotonic() >= deadline:
            return sandbox
        await asyncio.sleep(delay)
        if time.monotonic() > fast_until:
            delay = min(delay * 1.5, POLL_MAX_S)


async def _wait_redis(sandbox_id: str, settled: Set[str], deadline: float) -> Sandbox:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(settings.REDIS_URL)
    pubsub = client.pubsub()
    await pubsub.subscribe(_channel(sandbox_id))
    try:
        while True:
            # Subscribed before looking, so a publish between the two is not lost.
            sandbox = await db(_state)(sandbox_id)
            remaining = deadline - time.monotonic()
            if sandbox.state in settled or remaining <= 0:
                return sandbox
            await pubsub.get_message(ignore_subscribe_messages=True, timeout=min(remaining, 1.0))
    finally:
        await pubsub.unsubscribe()
        # redis annotates PubSub.aclose from 8.2 on, not before: called through Any, it type-checks with either.
        aclose: Any = pubsub.aclose
        await aclose()
        await client.aclose()
