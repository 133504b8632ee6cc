"""One launch across several engines as several hosts: placement spread, time to all running, time to all gone.

    sudo .venv/bin/python bench/hosts_bench.py [--count 4096] [--engines 3] [--backend embedded|postgres]
                                               [--overcommit 8] [--per-engine N] [--chunk 250] [--quick]
                                               [--group-size 64 [--group-cpu]] [--board]

Starts the product with --engines hosts (tests/support/stack.py: each an
engine of its own, with its own state directory, cgroup parent, network pool
and table, socket and TCP listener, and its own bulk and interactive workers
on its own queues), the control plane's clocks as a deployment runs them.
Then one launch of --count tiny sandboxes through the API, and measures:

* placement: each host's share, as the API reports it (``GET
  /launches/{id}/hosts``) and as each engine itself holds it;
* the time to all running (the API's progress), and when each host's last
  sandbox became ready;
* the teardown: the time until the API says the launch stopped, and until
  every engine holds none of it (what the kernel still holds is the truth).

One kernel serves every engine here, so their total is this machine's: the
count must fit the host (pid_max, memory: see docs/benchmarks.md), and each
engine reports the whole machine's memory, so admission's memory term counts
it once per engine (``--overcommit``: ``FORKYARD_MEMORY_OVERCOMMIT``; the
default 8 holds about 1,400 tiny sandboxes per 24 GiB host, so a run past
that on few engines needs more).  Each engine's own measure of the kernel's
memory per sandbox is recorded too, and overcounts here: it sees the other
engines' sandboxes grow the same kernel.  ``--chunk`` is the launch's chunk
(``FORKYARD_LAUNCH_CHUNK``: the unit placement spreads).  ``--quick`` (60
over 3 engines in chunks of 10) is a smoke run (hosts-quick-latest.json, not
kept). ``--group-size`` launches in memory groups of that size (the launch's
``memory_group_size``: what lets tens of thousands fit one kernel), and
``--group-cpu`` puts each group's CPU quota on the group
(``memory_group_cpu: "group"``); such a run is written as
hosts-<backend>-<engines>x<count>-grouped-latest.json. ``--board`` watches
the launch on the board's websocket meanwhile, as a viewer of the console
does, and records each pixel's lag from its sandbox's ready time to the
frame that drew it running (``bench/board_bench.py``'s measure, on a real
launch across hosts). Where the CPU went in each phase, by kind of
process (``bench/cpu_census.py``: the machine's PID 1, the engines, their
spawners and zygotes, the sandboxes themselves, the workers, the web
server, the board, kernel threads) is recorded as ``cpu_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.board_bench import lag_report, recorded_at, session_cookie, watch  # noqa: E402
from bench.cpu_census import CpuCensus  # noqa: E402
from bench.engine_bench import conclude, conditions, write_report  # noqa: E402
from tests.support.stack import PRODUCTION_TIMING, Stack, launch_members  # noqa: E402

POLL_S = 0.25
ANSWER_TIMEOUT_S = 30.0  # a status read slower than this counts as unanswered (the bench goes on)


class Polls:
    """How long the API took to answer each status read during a phase, and how many it left unanswered."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.unanswered = 0

    def get(self, api: httpx.Client, path: str) -> dict[str, Any] | None:
        started = time.monotonic()
        try:
            answer = api.get(path, timeout=ANSWER_TIMEOUT_S)
        except httpx.TimeoutException:
            self.unanswered += 1
            return None
        finally:
            self.seconds.append(time.monotonic() - started)
        return dict(answer.json())

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.seconds)
        return {
            "reads": len(ordered),
            "p50_s": round(ordered[len(ordered) // 2], 3) if ordered else None,
            "max_s": round(ordered[-1], 3) if ordered else None,
            "unanswered": self.unanswered,
        }


def engine_figures(stack: Stack) -> dict[str, dict[str, Any]]:
    """What each engine says of its host: the preflight's verdict and its kernel memory per sandbox."""
    figures = {}
    for name, engine in stack.engines().items():
        with engine.client() as direct:
            info = direct.info()
        preflight = info.get("preflight", {})
        figures[name] = {
            "fits": preflight.get("fits"),
            "limiting": preflight.get("limiting"),
            "to_set": preflight.get("to_set", []),
            "sandbox_overhead_kib": info.get("sandbox_overhead_kib"),
            "sandboxes": info.get("sandboxes"),
        }
    return figures


def timed(until: Any, timeout_s: float) -> float | None:
    """Seconds until ``until()`` holds, polled; None if it never did within ``timeout_s``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if until():
            return round(time.monotonic() - started, 2)
        time.sleep(POLL_S)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=4096)
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--backend", choices=("embedded", "postgres"), default="embedded")
    parser.add_argument("--overcommit", type=float, default=8.0, help="FORKYARD_MEMORY_OVERCOMMIT (default 8)")
    parser.add_argument("--per-engine", type=int, default=0, help="FORKYARD_ENGINE_MAX_SANDBOXES of each (default 40,000)")
    parser.add_argument("--chunk", type=int, default=250, help="FORKYARD_LAUNCH_CHUNK (default 250)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--quick", action="store_true", help="60 sandboxes over 3 engines: a smoke run")
    parser.add_argument("--group-size", type=int, default=1, help="the launch's memory_group_size (default 1: none)")
    parser.add_argument("--group-cpu", action="store_true", help='memory_group_cpu "group": a CPU quota a group')
    parser.add_argument("--board", action="store_true", help="watch the launch on the board: each pixel's lag")
    args = parser.parse_args()
    if args.quick:
        args.count, args.engines, args.chunk = 60, 3, 10
    work = Path(tempfile.mkdtemp(prefix="fy-hostsbench-", dir="/tmp"))
    os.chmod(work, 0o755)
    os.environ["FORKYARD_TEST_BACKEND"] = args.backend
    engine_env = {"FORKYARD_ENGINE_MAX_SANDBOXES": str(args.per_engine)} if args.per_engine else {}
    stack = Stack(
        work / "stack",
        backend=args.backend,
        timing=PRODUCTION_TIMING,
        hosts=args.engines,
        warm_pools="",
        engine_env=engine_env,
        env={"FORKYARD_MEMORY_OVERCOMMIT": str(args.overcommit), "FORKYARD_LAUNCH_CHUNK": str(args.chunk)},
    )
    report: dict[str, Any] = conditions(
        quick=args.quick,
        backend=args.backend,
        count=args.count,
        engines=args.engines,
        overcommit=args.overcommit,
        chunk=args.chunk,
        per_engine=args.per_engine or None,
        group_size=args.group_size,
        group_cpu="group" if args.group_cpu else "each",
        board=args.board,
    )
    try:
        stack.start()
        stack.set_limits(stack.teams[0], requests_per_second=100000, max_sandboxes=200000, max_launch_count=200000)
        report["hosts_before"] = engine_figures(stack)
        cookie = session_cookie(stack) if args.board else ""
        with stack.client() as api:
            body: dict[str, Any] = {
                "template": "base",
                "size": "tiny",
                "count": args.count,
                "ttl_s": 3600,
                "labels": {"bench": "hosts"},
            }
            if args.group_size > 1:
                body["memory_group_size"] = args.group_size
                body["memory_group_cpu"] = "group" if args.group_cpu else "each"
            census = CpuCensus()
            census.start()
            started = time.monotonic()
            created = api.post("/api/v1/launches", json=body)
            report["launch_status"] = created.status_code
            if created.status_code != 201:
                report["refused"] = created.json()
                raise SystemExit(f"the launch was refused: {created.text}")
            launch_id = created.json()["id"]
            seen: dict[str, Any] = {}
            viewer = threading.Thread(
                target=lambda: seen.update(asyncio.run(watch(stack, launch_id, args.count, cookie, args.timeout))),
                name="board",
                daemon=True,
            )
            if args.board:
                viewer.start()
            launch: dict[str, Any] = {}
            launching, tearing = Polls(), Polls()

            def all_running() -> bool:
                nonlocal launch
                launch = launching.get(api, f"/api/v1/launches/{launch_id}") or launch
                progress = launch.get("progress") or {"running": 0, "failed": 0}
                return bool(progress["running"] + progress["failed"] >= args.count or launch.get("state") == "failed")

            waited = timed(all_running, args.timeout)
            report["cpu_s"] = {"launch": census.phase()}
            report["status_reads_launching"] = launching.summary()
            report["all_running_s"] = round(time.monotonic() - started, 2) if waited is not None else None
            report["progress"] = launch.get("progress")
            report["shares"] = api.get(f"/api/v1/launches/{launch_id}/hosts").json()["hosts"]
            report["engine_counts"] = stack.held_by_engines(launch_id)
            members = launch_members(api, launch_id)
            created_at = datetime.fromisoformat(launch["created_at"]).timestamp()
            last_ready: dict[str, float] = {}
            for member in members:
                if member["ready_at"]:
                    ready = datetime.fromisoformat(member["ready_at"]).timestamp() - created_at
                    last_ready[member["host"]] = max(last_ready.get(member["host"], 0.0), ready)
            report["last_ready_s_by_host"] = {name: round(value, 2) for name, value in sorted(last_ready.items())}
            shares = [share["running"] for share in report["shares"]]
            report["spread"] = {
                "hosts": len(shares),
                "min": min(shares, default=0),
                "max": max(shares, default=0),
                "even_within_a_chunk": len(shares) == args.engines and max(shares) - min(shares) <= args.chunk,
            }
            report["hosts_at_peak"] = engine_figures(stack)
            if args.board:
                viewer.join(args.timeout)
                frames = seen.get("frames", [])
                report["board"] = {
                    "pixels_running_seen": len(seen.get("running", {})),
                    "messages": len(frames),
                    "bytes": sum(size for _, size in frames),
                    **(lag_report(seen, members, recorded_at(stack, launch_id)) if seen else {}),
                }
            torn = time.monotonic()
            api.delete(f"/api/v1/launches/{launch_id}")
            report["teardown_api_stopped_s"] = timed(
                lambda: (tearing.get(api, f"/api/v1/launches/{launch_id}") or {}).get("state") == "stopped", args.timeout
            )
            report["status_reads_tearing_down"] = tearing.summary()
            report["teardown_engines_empty_s"] = (
                round(time.monotonic() - torn, 2)
                if timed(lambda: not any(stack.held_by_engines(launch_id).values()), args.timeout) is not None
                else None
            )
            report["cpu_s"]["teardown"] = census.phase()
            census.stop()
        running = (report["progress"] or {}).get("running", 0)
        report["rate_per_s"] = round(running / report["all_running_s"], 1) if report["all_running_s"] else None
        report["commands"] = math.ceil(args.count / args.chunk)  # one ensure_running a chunk, on its host's queue
    finally:
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)
    conclude(report)
    print(json.dumps(report, indent=2, default=str))
    grouped = "-grouped" if args.group_size > 1 else ""
    name = "hosts-quick" if args.quick else f"hosts-{args.backend}-{args.engines}x{args.count}{grouped}"
    write_report(f"{name}-latest.json", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
