"""``/sandboxes/{id}/metrics`` and ``/launches/{id}/metrics``: what the kernel reports about them, read now from
their hosts' engines (each sandbox's cgroup and its disk's filesystem); nothing is stored."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

from django.http import HttpRequest
from django.utils import timezone
from ninja import Router

from console.api_base import ERRORS, key_of
from console.db import db
from sandboxes.engine.errors import EngineError, SandboxNotRunning

from .. import engine_link, selectors
from ..schemas import LaunchMetrics, SandboxMetrics

router = Router(tags=["metrics"])
SUMMED = (
    "cpu_s",
    "cpu_limit",
    "memory_bytes",
    "memory_peak_bytes",
    "memory_limit_bytes",
    "pids",
    "disk_used_bytes",
    "disk_files",
    "oom_kills",
)
PER_HOST = 16  # a launch's members measured at once on one host
MICROSECONDS = 1_000_000


def _metrics(sandbox_id: str, stats: dict[str, Any]) -> dict[str, Any]:
    return {
        "sandbox": sandbox_id,
        "at": timezone.now(),
        **{name: stats[name] for name in SandboxMetrics.model_fields if name in stats},
    }


@router.get("/sandboxes/{sandbox_id}/metrics", response={200: SandboxMetrics, **ERRORS}, summary="A sandbox's metrics")
async def sandbox_metrics(request: HttpRequest, sandbox_id: str) -> dict[str, Any]:
    """CPU time and share, memory now and at its peak, processes, disk used, OOM kills: read now from its
    cgroup and its disk, for a running or paused sandbox (`409 sandbox_not_running` otherwise)."""
    sandbox = await db(selectors.started_sandbox_for)(key_of(request).team_id, sandbox_id)
    assert sandbox.host is not None  # a started sandbox has a host
    try:
        async with engine_link.async_pool(sandbox.host.engine_socket).client() as client:
            stats = await client.call("stats", id=sandbox.engine_id)
    except EngineError as error:
        raise engine_link.refusal(error, sandbox) from None
    return _metrics(sandbox.id, stats)


@router.get("/launches/{launch_id}/metrics", response={200: LaunchMetrics, **ERRORS}, summary="A launch's metrics, summed")
async def launch_metrics(request: HttpRequest, launch_id: str) -> dict[str, Any]:
    """The same as a sandbox's, summed over the launch's running and paused members, each read from its
    host's engine (at most 16 at once a host). A member that ended meanwhile is left out; one whose host
    does not answer is counted in `unreachable`."""
    launch = await db(selectors.launch_for)(key_of(request).team, launch_id)
    members = await db(selectors.started_members)(launch)
    by_host: dict[str, list[str]] = defaultdict(list)
    for engine_socket, engine_id in members:
        by_host[engine_socket].append(engine_id)
    sums: dict[str, float] = dict.fromkeys(SUMMED, 0)
    counted = {"sandboxes": 0, "unreachable": 0}

    async def measure(engine_socket: str, engine_ids: list[str]) -> None:
        pool = engine_link.async_pool(engine_socket)
        turns = asyncio.Semaphore(PER_HOST)

        async def one(engine_id: str) -> None:
            async with turns:
                try:
                    async with pool.client() as client:
                        stats = await client.call("stats", id=engine_id)
                except SandboxNotRunning:
                    return  # it ended since the query
                except EngineError:
                    counted["unreachable"] += 1
                    return
            counted["sandboxes"] += 1
            for name in SUMMED:
                value = stats.get(name) or 0  # disk_files: null on a disk that counts bytes only
                # CPU time in whole microseconds, the kernel's unit: a sum of floats would end in a digit
                # that depends on the order the answers came in.
                sums[name] += round(value * MICROSECONDS) if name == "cpu_s" else value

        await asyncio.gather(*(one(engine_id) for engine_id in engine_ids))

    await asyncio.gather(*(measure(engine_socket, engine_ids) for engine_socket, engine_ids in by_host.items()))
    sums["cpu_s"] /= MICROSECONDS
    return {"launch": launch.id, "at": timezone.now(), **counted, **{name: value for name, value in sums.items()}}
