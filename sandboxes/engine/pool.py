"""Warm pools: sandboxes created ahead of need, so that a create is a claim.

A pool is kept per (template, size) with a target count.  A create that names
a pooled template and size, and no explicit ``id``, takes a ready sandbox: its
record gets the caller's labels, env and TTL, and the pool refills in the
background.  A pooled sandbox has never run a command and is never shown in
listings until claimed; it is created exactly like any other (same
namespaces, limits and filter), only earlier.

Refills run at most ``FILL_CONCURRENCY`` at a time, so a pool never starves
the creates that callers wait for; and they wait until claims pause for
``REFILL_AFTER_S`` (or the pool is down to a quarter of its target), so that
a burst of claims (a launch forking a snapshot 1,000 times) is not slowed by
its own refills.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Mapping
from typing import Any, Protocol

from .config import EngineConfig
from .errors import EngineError, InvalidRequest
from .store import SandboxRecord
from .template_store import TemplateStore

log = logging.getLogger("forkyard.engine.pool")
FILL_CONCURRENCY = 2
REFILL_AFTER_S = 0.25
MAX_TARGET = 1024


class PoolOwner(Protocol):
    """What warm pools need of the engine that owns them (``engine.Engine`` is one).

    A protocol rather than the engine itself, so that the engine imports this
    module and not the other way round.
    """

    @property
    def config(self) -> EngineConfig: ...

    @property
    def templates(self) -> TemplateStore: ...

    @property
    def sandboxes(self) -> Mapping[str, SandboxRecord]: ...

    async def create_record(self, args: dict[str, Any], pool: str = "") -> SandboxRecord: ...

    async def destroy(self, sandbox_id: Any, reason: str = "destroyed") -> dict[str, Any]: ...


def pool_name(template: str, size: str) -> str:
    return f"{template}/{size}"


def parse_targets(text: str) -> dict[str, int]:
    """``base:tiny=16,python:default=2`` -> {"base/tiny": 16, "python/default": 2}."""
    targets: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, count = item.partition("=")
        template, _, size = key.partition(":")
        if not template or not size or not count.isdigit():
            raise ValueError(f"bad warm pool entry {item!r}: want template:size=count")
        targets[pool_name(template, size)] = int(count)
    return targets


class WarmPools:
    def __init__(self, engine: PoolOwner, targets: dict[str, int]) -> None:
        self.engine = engine
        self.targets = dict(targets)
        self.ready: dict[str, deque[str]] = {}
        self.filling: dict[str, int] = {}
        self.claims = 0
        self.misses = 0
        self.backoff: dict[str, float] = {}
        self._semaphore = asyncio.Semaphore(FILL_CONCURRENCY)
        self._tasks: set[asyncio.Task[None]] = set()
        self._refill: asyncio.TimerHandle | None = None

    def adopt(self, record: SandboxRecord) -> None:
        """A pooled sandbox found at recovery goes back to its pool."""
        self.ready.setdefault(record.pool, deque()).append(record.id)

    def claim(self, template: str, size: str) -> SandboxRecord | None:
        name = pool_name(template, size)
        queue = self.ready.get(name)
        while queue:
            record = self.engine.sandboxes.get(queue.popleft())
            if record is not None and record.state == "running" and record.pool == name:
                self.claims += 1
                self._fill_when_quiet(low=len(queue) < self.targets.get(name, 0) // 4)
                return record
        if self.targets.get(name):
            self.misses += 1
            self.fill()
        return None

    def _fill_when_quiet(self, low: bool) -> None:
        """Refill once claims pause (every claim pushes the refill back), or now
        if the pool is down to a quarter of its target."""
        if self._refill is not None:
            self._refill.cancel()
            self._refill = None
        if low:
            self.fill()
            return
        self._refill = asyncio.get_running_loop().call_later(REFILL_AFTER_S, self._quiet)

    def _quiet(self) -> None:
        self._refill = None
        self.fill()

    def forget(self, sandbox_id: str) -> None:
        for queue in self.ready.values():
            try:
                queue.remove(sandbox_id)
            except ValueError:
                continue

    def set_target(self, template: Any, size: Any, count: Any) -> dict[str, Any]:
        if not isinstance(template, str) or not isinstance(size, str):
            raise InvalidRequest("template and size must be names", field="template")
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_TARGET:
            raise InvalidRequest(f"count must be an integer from 0 to {MAX_TARGET}", field="count")
        self.engine.templates.get(template)
        if size not in self.engine.config.sizes:
            raise InvalidRequest(f"unknown size {size!r}", field="size")
        name = pool_name(template, size)
        self.targets[name] = count
        surplus = len(self.ready.get(name, ())) - count
        for _ in range(max(0, surplus)):
            sandbox_id = self.ready[name].pop()
            self._spawn(self.engine.destroy(sandbox_id, reason="pool shrunk"))
        self.fill()
        return self.status()[name]

    def status(self) -> dict[str, dict[str, int]]:
        names = set(self.targets) | set(self.ready)
        return {
            name: {
                "target": self.targets.get(name, 0),
                "ready": len(self.ready.get(name, ())),
                "filling": self.filling.get(name, 0),
            }
            for name in sorted(names)
        }

    def fill(self) -> None:
        """Start whatever refills the targets call for."""
        for name, target in self.targets.items():
            missing = target - len(self.ready.get(name, ())) - self.filling.get(name, 0)
            for _ in range(max(0, missing)):
                self.filling[name] = self.filling.get(name, 0) + 1
                self._spawn(self._fill_one(name))

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fill_one(self, name: str) -> None:
        template, _, size = name.partition("/")
        failed = False
        try:
            async with self._semaphore:
                if self.targets.get(name, 0) <= len(self.ready.get(name, ())):
                    return
                record = await self.engine.create_record({"template": template, "size": size}, pool=name)
            self.ready.setdefault(name, deque()).append(record.id)
            self.backoff.pop(name, None)
        except EngineError as error:
            failed = True
            delay = self.backoff[name] = min(60.0, self.backoff.get(name, 0.5) * 2)
            log.warning("warm pool %s could not refill (retrying in %.0fs): %s", name, delay, error)
        finally:
            self.filling[name] -= 1
        if failed and self.filling[name] == 0:
            await asyncio.sleep(self.backoff[name])
            self.fill()
