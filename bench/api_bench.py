"""The public API's speed: the same latencies as the engine benchmark, through HTTP and the SDK.

    sudo .venv/bin/python bench/api_bench.py [--backend embedded|postgres] [--quick]

Starts the whole product (engine, Celery worker, Daphne, database) the way the
tests do, then measures:

* create to first exec, p50/p95: POST /sandboxes (answered once it runs) then
  POST .../exec of `true`, through raw HTTP (httpx) and through the SDK;
* exec round trip of `true`, p50/p95, through HTTP and the SDK, and execs per
  second from 8 concurrent clients;
* a launch of 1,000 sandboxes: seconds until every one is exec-ready.

Goals: create-to-first-exec p50 under 50 ms, exec p50 under 20 ms, a launch of
1,000 exec-ready within 5 s.  Prints a table; writes bench/results/api-<backend>-latest.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine_bench import machine, summary, timed, write_report  # noqa: E402
from tests.support.stack import PRODUCTION_TIMING, Stack  # noqa: E402

GOALS = {"create_to_exec_p50_ms": 50.0, "exec_p50_ms": 20.0, "launch_1000_s": 5.0}


def bench_http(stack: Stack, samples: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with stack.client() as api:
        ready = []
        for _ in range(samples):
            started = time.perf_counter()
            sandbox = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600}).json()
            assert api.post(f"/api/v1/sandboxes/{sandbox['id']}/exec", json={"cmd": ["true"]}).json()["exit_code"] == 0
            ready.append((time.perf_counter() - started) * 1000)
            api.delete(f"/api/v1/sandboxes/{sandbox['id']}", params={"wait": False})
            time.sleep(0.02)  # let the warm pool refill, as rollouts work between creates
        results["create_to_exec_ms"] = summary(ready)
        sandbox = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600}).json()
        url = f"/api/v1/sandboxes/{sandbox['id']}/exec"
        for _ in range(20):
            api.post(url, json={"cmd": ["true"]})
        results["exec_ms"] = summary([timed(lambda: api.post(url, json={"cmd": ["true"]})) for _ in range(samples * 3)])

        def burst(_: int) -> int:
            with stack.client() as client:
                for _ in range(50):
                    client.post(url, json={"cmd": ["true"]})
            return 50

        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            done = sum(pool.map(burst, range(8)))
        results["execs_per_second"] = round(done / (time.perf_counter() - started), 1)
        api.delete(f"/api/v1/sandboxes/{sandbox['id']}")
    return results


def bench_sdk(stack: Stack, samples: int) -> dict[str, Any]:
    from forkyard import Client

    results: dict[str, Any] = {}
    with Client(url=stack.url, api_key=stack.teams[0].key) as fy:
        ready = []
        for _ in range(samples):
            started = time.perf_counter()
            sandbox = fy.sandboxes.create(template="base", size="tiny", ttl_s=600)
            assert sandbox.exec(["true"]).exit_code == 0
            ready.append((time.perf_counter() - started) * 1000)
            sandbox.kill()
            time.sleep(0.02)
        results["create_to_exec_ms"] = summary(ready)
        sandbox = fy.sandboxes.create(template="base", size="tiny", ttl_s=600)
        results["exec_ms"] = summary([timed(lambda: sandbox.exec(["true"])) for _ in range(samples * 3)])
        sandbox.kill()
    return results


def bench_launch(stack: Stack, count: int) -> dict[str, Any]:
    with stack.client() as api:
        started = time.perf_counter()
        launch = api.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": count, "ttl_s": 900}).json()
        while True:
            state = api.get(f"/api/v1/launches/{launch['id']}").json()
            if state["state"] != "creating":
                break
            time.sleep(0.05)
        ready_s = time.perf_counter() - started
        api.delete(f"/api/v1/launches/{launch['id']}")
        deadline = time.monotonic() + 300
        while api.get(f"/api/v1/launches/{launch['id']}").json()["state"] != "stopped" and time.monotonic() < deadline:
            time.sleep(0.2)
    return {"count": count, "ready_s": round(ready_s, 2), "progress": state["progress"], "rate_per_s": round(count / ready_s, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--backend", choices=("embedded", "postgres"), default=os.environ.get("FORKYARD_TEST_BACKEND", "embedded")
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("run as root: the product creates real sandboxes", file=sys.stderr)
        return 2
    samples, launch_count = (30, 200) if args.quick else (100, 1000)
    work = Path(tempfile.mkdtemp(prefix="fy-apibench-", dir="/tmp"))
    os.chmod(work, 0o755)
    os.environ["FORKYARD_TEST_BACKEND"] = args.backend
    stack = Stack(work / "stack", backend=args.backend, timing=PRODUCTION_TIMING)
    report: dict[str, Any] = {
        "machine": machine(),
        "backend": args.backend,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        stack.start()
        stack.set_limits(stack.teams[0], requests_per_second=100000, max_sandboxes=40000)
        with stack.engine.client() as engine:  # type: ignore[union-attr]
            engine.call("pools.set", template="base", size="tiny", count=32)
        time.sleep(2)
        print(f"{args.backend}: HTTP, {samples} creates...", flush=True)
        report["http"] = bench_http(stack, samples)
        print("SDK...", flush=True)
        report["sdk"] = bench_sdk(stack, samples)
        print(f"launch of {launch_count}...", flush=True)
        report["launch"] = bench_launch(stack, launch_count)
    finally:
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)
    http, sdk, launch = report["http"], report["sdk"], report["launch"]
    report["goals_met"] = {
        "create_to_exec_p50_under_50ms": http["create_to_exec_ms"]["p50"] < GOALS["create_to_exec_p50_ms"],
        "exec_p50_under_20ms": http["exec_ms"]["p50"] < GOALS["exec_p50_ms"],
        f"launch_{launch['count']}_under_5s": launch["ready_s"] < GOALS["launch_1000_s"],
    }
    print(f"\n{'':34} {'HTTP':>10} {'SDK':>10}")
    for label, key in (("create to first exec", "create_to_exec_ms"), ("exec `true`", "exec_ms")):
        for quantile in ("p50", "p95"):
            print(f"{label + ' ' + quantile + ' (ms)':34} {http[key][quantile]:>10} {sdk[key][quantile]:>10}")
    print(f"execs per second (8 clients)       {http['execs_per_second']:>10}")
    print(f"launch of {launch['count']}: exec-ready in {launch['ready_s']} s ({launch['rate_per_s']}/s), {launch['progress']}")
    print("goals: " + ", ".join(f"{name} {'met' if met else 'NOT met'}" for name, met in report["goals_met"].items()))
    write_report(f"api-{args.backend}{'-quick' if args.quick else ''}-latest.json", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
