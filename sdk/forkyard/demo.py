"""The product's demo, through the public API: ``python -m forkyard.demo [--count N]``.

Launches N sandboxes of the ``base`` template in one call, runs a command in
each, prints a few outputs and how fast it all went (launch to all running,
exec p50/p95 through the API), then tears the launch down.  It uses only the
SDK (``AsyncClient``), with FORKYARD_URL and FORKYARD_API_KEY from the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Sequence

from ._terminal import ProgressBar
from .aio import AsyncClient, AsyncLaunch, AsyncSandbox
from .errors import ForkyardError
from .models import ExecResult

COMMAND = 'echo "sandbox {index} is $(hostname)"; uname -sr'
SHOWN = 3


class Pacer:
    """Spaces request starts so that a burst stays under the team's request rate (429s would only add retries)."""

    def __init__(self, per_second: float) -> None:
        self.interval = 1.0 / per_second if per_second > 0 else 0.0
        self.next_start = time.monotonic()
        self.lock = asyncio.Lock()

    async def wait(self) -> None:
        async with self.lock:
            now = time.monotonic()
            delay = self.next_start - now
            self.next_start = max(now, self.next_start) + self.interval
        if delay > 0:
            await asyncio.sleep(delay)


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


async def run_each(sandboxes: list[AsyncSandbox], pacer: Pacer, concurrency: int) -> list[tuple[int, ExecResult, float]]:
    """(index, result, seconds through the API) for a command in every sandbox, ``concurrency`` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int, sandbox: AsyncSandbox) -> tuple[int, ExecResult, float]:
        async with gate:
            await pacer.wait()
            started = time.perf_counter()
            result = await sandbox.exec(COMMAND.format(index=index), timeout_s=30)
            return index, result, time.perf_counter() - started

    return list(await asyncio.gather(*(one(index, sandbox) for index, sandbox in enumerate(sandboxes))))


def report(
    count: int, launch: AsyncLaunch, to_running_s: float, runs: list[tuple[int, ExecResult, float]], exec_s: float, total_s: float
) -> None:
    progress = launch.progress
    for index, result, _ in runs[:SHOWN]:
        print(f"  [{index}] " + result.stdout.strip().replace("\n", " | "))
    if len(runs) > SHOWN:
        print(f"  ... and {len(runs) - SHOWN} more")
    print()
    print(
        f"launch   {progress.running} running, {progress.failed} failed of {count} in {to_running_s:.2f} s "
        f"({progress.running / to_running_s if to_running_s else 0:.1f} sandboxes/s; server: {launch.elapsed_s:.2f} s, {launch.rate_per_s:.1f}/s)"
    )
    if runs:
        api_ms = [seconds * 1000 for _, _, seconds in runs]
        inside_ms = [result.duration_ms for _, result, _ in runs]
        failed = sum(1 for _, result, _ in runs if not result.ok)
        print(
            f"exec     {len(runs)} commands ({failed} failed) in {exec_s:.2f} s ({len(runs) / exec_s if exec_s else 0:.0f}/s): "
            f"p50 {statistics.median(api_ms):.1f} ms, p95 {percentile(api_ms, 0.95):.1f} ms through the API "
            f"(in the sandbox: p50 {statistics.median(inside_ms):.1f} ms)"
        )
    print(f"total    {total_s:.2f} s")


async def demo(count: int, template: str, size: str, concurrency: int, progress: bool) -> int:
    async with AsyncClient() as fy:
        me = await fy.me()
        print(f"forkyard demo: {count} sandboxes of {template} ({size}) at {fy.url}, team {me.team_name}")
        started = time.monotonic()
        launch = await fy.launches.create(template=template, size=size, count=count, ttl_s=600, labels={"forkyard-demo": "1"})
        try:
            bar = ProgressBar(sys.stderr, enabled=progress)
            try:
                sandboxes = await launch.wait(timeout_s=300, poll_s=0.1, on_progress=bar.draw)
            finally:
                bar.finish()
            to_running_s = time.monotonic() - started
            running = [sandbox for sandbox in sandboxes if sandbox.running]
            pacer = Pacer(me.limits.requests_per_second * 0.8)
            exec_started = time.monotonic()
            runs = await run_each(running, pacer, concurrency)
            report(count, launch, to_running_s, runs, time.monotonic() - exec_started, time.monotonic() - started)
        finally:
            await launch.kill()
            print(f"killed   launch {launch.id}")
        return 0 if launch.progress.failed == 0 and all(result.ok for _, result, _ in runs) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m forkyard.demo", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--count", type=int, default=100, help="how many sandboxes (default: 100)")
    parser.add_argument("--template", default="base")
    parser.add_argument("--size", default="tiny")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=2,
        help="commands in flight at once (default: 2; more queue up in the server and only add latency)",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="draw a progress bar on stderr (default: when it is a terminal)",
    )
    args = parser.parse_args(argv)
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    try:
        return asyncio.run(demo(args.count, args.template, args.size, max(1, args.concurrency), progress))
    except ForkyardError as error:
        print(f"error [{error.code}]: {error.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
