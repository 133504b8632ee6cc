"""The board during a launch: websocket traffic, and lag from a sandbox ready to its pixel.

    sudo .venv/bin/python bench/board_bench.py [--count 4096] [--backend embedded|postgres]

Starts the product, opens the board's websocket for a new launch of --count
sandboxes (one per pixel), and records every frame.  Reports messages and
bytes per second while the launch runs, and for every sandbox the lag between
its ``ready_at`` (as recorded) and the frame that turned its pixel "running".
Goal: under one second of lag at 32,752 pixels.  The full size needs a host
that can hold 32,752 sandboxes (memory, pid_max); on a small host, run a
smaller count and say so.

    sudo .venv/bin/python bench/board_bench.py --simulate 1000 --count 32752

measures the board alone at full size: the launch's rows are made directly
and turned "running" at 1,000 a second in the database (no engine: each row's
``ready_at`` is the moment it turned), while the product's own ticker,
channel layer and websocket carry the pixels to the viewer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine_bench import conclude, conditions, write_report  # noqa: E402
from sandboxes.board.protocol import RUNNING, parse  # noqa: E402
from tests.support.stack import PRODUCTION_TIMING, Stack  # noqa: E402


def session_cookie(stack: Stack) -> str:
    """A signed-in session for team A's user, made directly (no console needed)."""
    team = stack.teams[0]
    code = (
        "from django.contrib.auth.models import User;"
        "from django.contrib.sessions.backends.db import SessionStore;"
        f"user = User.objects.get(username={team.username!r});"
        "store = SessionStore();"
        "store['_auth_user_id'] = str(user.pk);"
        "store['_auth_user_backend'] = 'django.contrib.auth.backends.ModelBackend';"
        "store['_auth_user_hash'] = user.get_session_auth_hash();"
        "store.create();"
        "print(store.session_key)"
    )
    return stack.shell(code).strip().splitlines()[-1]


async def watch(stack: Stack, launch_id: str, count: int, cookie: str, timeout_s: float) -> dict[str, Any]:
    import websockets

    frames: list[tuple[float, int]] = []
    became_running: dict[int, float] = {}
    started = time.monotonic()
    # The board's websockets are served by Daphne, apart from the HTTP server (uvicorn).
    url = f"ws://127.0.0.1:{stack.ws_port}/ws/board/{launch_id}/"
    headers = {"Cookie": f"sessionid={cookie}", "Origin": stack.url}
    async with websockets.connect(url, additional_headers=headers, max_size=None) as socket:
        snapshot_seq = -1
        while time.monotonic() - started < timeout_s and len(became_running) < count:
            try:
                data = await asyncio.wait_for(socket.recv(), 5)
            except TimeoutError:
                continue
            received = time.time()
            assert isinstance(data, bytes), "the board sends binary frames"
            frames.append((received, len(data)))
            message = parse(data)
            for section in message["sections"]:
                if section["launch"] != launch_id:
                    continue
                if message["kind"] == "S":
                    snapshot_seq = message["seq"]
                    for index, state in enumerate(section["states"]):
                        if state == RUNNING:
                            became_running.setdefault(index, received)
                elif message["kind"] == "D" and message["seq"] > snapshot_seq:
                    for start, length, state in section["runs"]:
                        if state == RUNNING:
                            for index in range(start, start + length):
                                became_running.setdefault(index, received)
    return {"frames": frames, "running": became_running}


SIMULATE = """
import time
from datetime import timedelta
from django.utils import timezone
from sandboxes.models import Launch, Sandbox
from console.models import ApiKey
key = ApiKey.objects.get(pk={key_id!r})
launch = Launch.objects.create(team_id=key.team_id, api_key=key, template="base", size="tiny", cpu=1, memory_mib=128,
                               ttl_s=600, count={count}, labels={{"board": "bench"}})
Sandbox.objects.bulk_create([Sandbox(team_id=key.team_id, api_key=key, launch=launch, launch_index=i, template="base",
    size="tiny", cpu=1, memory_mib=128, ttl_s=600, state="creating") for i in range({count})], batch_size=2000)
print("LAUNCH", launch.id, flush=True)
time.sleep(3)  # the viewer connects
step, started = {batch}, time.monotonic()
for offset in range(0, {count}, step):
    now = timezone.now()
    Sandbox.objects.filter(launch=launch, launch_index__gte=offset, launch_index__lt=offset + step).update(
        state="running", ready_at=now, updated_at=now)
    time.sleep(max(0.0, started + (offset + step) / {rate} - time.monotonic()))
"""


def simulate(stack: Stack, count: int, rate: int, cookie: str, timeout_s: float) -> dict[str, Any]:
    """Rows made and turned running in the database at ``rate`` a second; the board carries them."""
    import subprocess
    import threading

    key_id = (
        stack.shell(
            f"from console.models import ApiKey; print(ApiKey.objects.filter(team_id={stack.teams[0].team_id!r}).first().pk)"
        )
        .strip()
        .splitlines()[-1]
    )
    code = SIMULATE.format(key_id=key_id, count=count, rate=rate, batch=max(1, rate // 20))
    process = subprocess.Popen(
        [sys.executable, "manage.py", "shell", "-c", code], cwd=ROOT, env=stack.environment(), stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    launch_id = ""
    for line in process.stdout:
        if line.startswith("LAUNCH "):
            launch_id = line.split()[1]
            break
    drain = threading.Thread(target=process.communicate, daemon=True)
    drain.start()
    started = time.time()
    observed = asyncio.run(watch(stack, launch_id, count, cookie, timeout_s))
    process.wait(60)
    return {"launch_id": launch_id, "observed": observed, "started": started, "finished": time.time()}


RECORDED = """
import json
from sandboxes.models import Sandbox
rows = Sandbox.objects.filter(launch_id={launch_id!r}, state="running").values_list("launch_index", "updated_at")
print(json.dumps({{index: at.timestamp() for index, at in rows}}))
"""


def recorded_at(stack: Stack, launch_id: str) -> dict[int, float]:
    """When each running sandbox of the launch was written "running" (its row's
    last update: nothing else writes a running row before the teardown)."""
    output = stack.shell(RECORDED.format(launch_id=launch_id)).strip().splitlines()[-1]
    return {int(index): at for index, at in json.loads(output).items()}


def quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(max(0.0, value) for value in values)
    return {
        "p50": round(statistics.median(ordered) * 1000, 1),
        "p95": round(ordered[int(0.95 * (len(ordered) - 1))] * 1000, 1),
        "max": round(ordered[-1] * 1000, 1),
    }


def lag_report(observed: dict[str, Any], members: list[dict[str, Any]], written: dict[int, float]) -> dict[str, Any]:
    """Each pixel's lag from its sandbox's ``ready_at`` (``members``: the launch's sandboxes in pixel order,
    as the API lists them) to the frame that turned it running (``observed``: what ``watch`` saw), split at
    the moment its row was written running (``written``: ``recorded_at``)."""
    ready = {
        index: datetime.fromisoformat(member["ready_at"]).timestamp()
        for index, member in enumerate(members)
        if member["ready_at"]
    }
    lags = [seen - ready[index] for index, seen in observed["running"].items() if index in ready]
    report: dict[str, Any] = {"lag_ms": quantiles(lags) | {"n": len(lags)}} if lags else {}
    report["goal_lag_under_1s_met"] = bool(lags) and report["lag_ms"]["p95"] < 1000.0
    # Where the lag is: from ready in the engine to "running" in the database
    # (the worker's part), and from the database to the pixel (the board's).
    report["lag_split_ms"] = {
        "ready_to_recorded": quantiles([written[index] - ready[index] for index in ready if index in written]),
        "recorded_to_pixel": quantiles(
            [seen - written[index] for index, seen in observed["running"].items() if index in written]
        ),
    }
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=4096)
    parser.add_argument("--backend", choices=("embedded", "postgres"), default="embedded")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--simulate", type=int, metavar="RATE", help="no engine: rows turn running at RATE a second")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fy-boardbench-", dir="/tmp"))
    os.chmod(work, 0o755)
    os.environ["FORKYARD_TEST_BACKEND"] = args.backend
    stack = Stack(work / "stack", backend=args.backend, timing=PRODUCTION_TIMING)
    report: dict[str, Any] = conditions(backend=args.backend, count=args.count)
    try:
        stack.start()
        stack.set_limits(stack.teams[0], requests_per_second=100000, max_sandboxes=100000, max_launch_count=100000)
        cookie = session_cookie(stack)
        report["simulated_rate_per_s"] = args.simulate
        with stack.client() as api:
            if args.simulate:
                run = simulate(stack, args.count, args.simulate, cookie, args.timeout)
                launch, observed, started, finished = {"id": run["launch_id"]}, run["observed"], run["started"], run["finished"]
            else:
                body = {"template": "base", "size": "tiny", "count": args.count, "ttl_s": 1800, "labels": {"board": "bench"}}
                launch = api.post("/api/v1/launches", json=body).json()
                started = time.time()
                observed = asyncio.run(watch(stack, launch["id"], args.count, cookie, args.timeout))
                finished = time.time()
            members, cursor = [], None
            while True:
                params: dict[str, Any] = {"limit": 5000, **({"cursor": cursor} if cursor else {})}
                page = api.get(f"/api/v1/launches/{launch['id']}/sandboxes", params=params).json()
                members += page["sandboxes"]
                cursor = page["next_cursor"]
                if not cursor:
                    break
            written = recorded_at(stack, launch["id"])
            api.delete(f"/api/v1/launches/{launch['id']}")
        frames = observed["frames"]
        duration = max(0.001, finished - started)
        total_bytes = sum(size for _, size in frames)
        report.update(
            {
                "pixels_running_seen": len(observed["running"]),
                "launch_seconds": round(duration, 2),
                "messages": len(frames),
                "messages_per_second": round(len(frames) / duration, 1),
                "bytes": total_bytes,
                "bytes_per_second": round(total_bytes / duration, 1),
            }
        )
        report.update(lag_report(observed, members, written))
    finally:
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)
    conclude(report)
    print(json.dumps(report, indent=2, default=str))
    kind = f"simulated{args.simulate}-" if args.simulate else ""
    write_report(f"board-{args.backend}-{kind}{args.count}-latest.json", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
