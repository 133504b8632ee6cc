"""Inference and grading: the gateway's overhead over a direct call, grades per second, time to ready.

    .venv/bin/python bench/inference_bench.py [--quick] [--backend embedded|postgres]

Runs the whole product (``tests/support/stack.py``, the deployment's own
timings) and the tiny random model the tests write (``tests/support/tiny_model.py``)
on a dedicated endpoint, then measures, one thing at a time:

1. **Time to ready**: ``POST /api/v1/endpoints`` until the endpoint is
   ``ready`` (the command through Celery, the engine's start of the model
   server, llama.cpp loading the model, its first answered ``/health``, the
   host agent's pass that records it).
2. **Gateway overhead**: the same chat completion (one token out), sent
   alternately to the model server itself (its address and token, as the
   gateway has them) and through ``/api/v1/inference`` with the team's key,
   on kept-alive connections; the overhead is the difference of the two
   medians (and of each pair). The model's own time is in both. Goal: under
   2 ms at p50.
3. **Grades per second**: one ``POST /api/v1/grades`` of a batch (100 items;
   20 with ``--quick``) whose answers follow a strict JSON schema, divided
   by its wall time; the model server decodes one request at a time, so
   this is bounded by the model, and the gateway's share is shown beside it.

Results go to ``bench/results/inference-<backend>[-quick]-latest.json``; the
figures in docs/benchmarks.md come from there (``bench/report.py inference``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine_bench import conclude, conditions, summary, write_report  # noqa: E402
from tests.support.grading import deploy, judge_schema, offer_tiny_model, wait_endpoint  # noqa: E402
from tests.support.stack import PRODUCTION_TIMING, Stack  # noqa: E402

GOALS = {"gateway_overhead_p50_ms": 2.0}
BODY = {"messages": [{"role": "user", "content": "Grade: 1+1=2"}], "max_tokens": 1, "temperature": 0}


def time_to_ready(stack: Stack, samples: int) -> dict[str, Any]:
    times = []
    with stack.client() as api:
        for index in range(samples):
            started = time.perf_counter()
            created = api.post("/api/v1/endpoints", json={"model": "tiny-random", "name": f"ready-{index}"}).json()
            wait_endpoint(api, created["id"], timeout_s=300)
            times.append((time.perf_counter() - started) * 1000)
            api.delete(f"/api/v1/endpoints/{created['id']}")
            wait_endpoint(api, created["id"], ("deleted",), timeout_s=120)
    return {"samples": samples, "ms": summary(times)}


def server_of(stack: Stack, endpoint_id: str) -> tuple[str, str]:
    """The model server's address and token, as the gateway reads them (the operator's view)."""
    line = (
        stack.shell(
            f"from grading.models import Endpoint; e = Endpoint.objects.get(pk={endpoint_id!r}); print(e.address, e.token)"
        )
        .strip()
        .splitlines()[-1]
    )
    address, token = line.split()
    return address, token


def overhead(stack: Stack, endpoint: dict[str, Any], samples: int) -> dict[str, Any]:
    address, token = server_of(stack, endpoint["id"])
    body = {**BODY, "model": endpoint["name"]}
    direct = httpx.Client(base_url=f"{address}/v1", headers={"Authorization": f"Bearer {token}"}, timeout=60)
    gateway = httpx.Client(
        base_url=f"{stack.url}/api/v1/inference", headers={"Authorization": f"Bearer {stack.teams[0].key}"}, timeout=60
    )
    direct_ms: list[float] = []
    gateway_ms: list[float] = []
    try:
        for _ in range(20):  # warm both paths: connections, caches, the model's first evaluations
            direct.post("/chat/completions", json=body)
            gateway.post("/chat/completions", json=body)
        for index in range(samples):
            order = (("direct", direct), ("gateway", gateway)) if index % 2 == 0 else (("gateway", gateway), ("direct", direct))
            for name, client in order:
                started = time.perf_counter()
                answer = client.post("/chat/completions", json=body)
                elapsed = (time.perf_counter() - started) * 1000
                if answer.status_code != 200:
                    raise RuntimeError(f"{name}: {answer.status_code} {answer.text[:300]}")
                (direct_ms if name == "direct" else gateway_ms).append(elapsed)
    finally:
        direct.close()
        gateway.close()
    pairs = [through - straight for through, straight in zip(gateway_ms, direct_ms, strict=True)]
    return {
        "samples": samples,
        "direct_ms": summary(direct_ms),
        "gateway_ms": summary(gateway_ms),
        "overhead_p50_ms": round(statistics.median(gateway_ms) - statistics.median(direct_ms), 3),
        "overhead_of_pairs_ms": summary(pairs),
    }


def grades_per_second(stack: Stack, endpoint: dict[str, Any], count: int) -> dict[str, Any]:
    items = [{"values": {"answer": f"answer number {index}"}} for index in range(count)]
    body = {
        "model": endpoint["name"],
        "rubric": [{"role": "user", "content": "Score this answer: {answer}"}],
        "schema": judge_schema(),
        "items": items,
        "max_tokens": 64,
        "concurrency": 16,
    }
    with stack.client() as api:
        started = time.perf_counter()
        answer = api.post("/api/v1/grades", json=body, timeout=1800)
        elapsed = time.perf_counter() - started
    if answer.status_code != 200:
        raise RuntimeError(f"grades: {answer.status_code} {answer.text[:300]}")
    grade = answer.json()
    items_ms = [result["latency_ms"] for result in grade["results"]]
    return {
        "items": count,
        "succeeded": grade["succeeded"],
        "seconds": round(elapsed, 3),
        "grades_per_second": round(count / elapsed, 2),
        "output_tokens": grade["usage"]["output_tokens"],
        "tokens_per_second": round(grade["usage"]["output_tokens"] / elapsed, 1),
        "item_latency_ms": summary(items_ms),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--backend", choices=("embedded", "postgres"), default=os.environ.get("FORKYARD_TEST_BACKEND", "embedded")
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("run as root: the product runs a real engine", file=sys.stderr)
        return 2
    ready_samples, overhead_samples, batch = (1, 60, 20) if args.quick else (5, 400, 100)
    work = Path(tempfile.mkdtemp(prefix="fy-inferencebench-", dir="/tmp"))
    os.chmod(work, 0o755)
    os.environ["FORKYARD_TEST_BACKEND"] = args.backend
    stack = Stack(work / "stack", backend=args.backend, timing=PRODUCTION_TIMING)
    report: dict[str, Any] = conditions(backend=args.backend)
    try:
        stack.start()
        stack.set_limits(stack.teams[0], requests_per_second=100000)
        offer_tiny_model(stack, work / "models")
        print(f"{args.backend}: time to ready, {ready_samples} endpoint(s)...", flush=True)
        report["time_to_ready"] = time_to_ready(stack, ready_samples)
        with stack.client() as api:
            endpoint = deploy(api, "bench")
        print(f"gateway overhead, {overhead_samples} pairs...", flush=True)
        report["overhead"] = overhead(stack, endpoint, overhead_samples)
        print(f"grades, a batch of {batch}...", flush=True)
        report["grades"] = grades_per_second(stack, endpoint, batch)
    finally:
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)
    conclude(report)
    report["goals"] = GOALS
    report["goals_met"] = {
        "gateway_overhead_p50_under_2ms": report["overhead"]["overhead_p50_ms"] < GOALS["gateway_overhead_p50_ms"]
    }
    over, grades, ready = report["overhead"], report["grades"], report["time_to_ready"]
    print(f"time to ready: p50 {ready['ms']['p50']} ms over {ready['samples']}")
    print(
        f"one-token completion: direct p50 {over['direct_ms']['p50']} ms, through the gateway p50 {over['gateway_ms']['p50']} ms: "
        f"overhead {over['overhead_p50_ms']} ms (pairs p50 {over['overhead_of_pairs_ms']['p50']} ms)"
    )
    print(
        f"grades: {grades['items']} in {grades['seconds']} s = {grades['grades_per_second']}/s ({grades['tokens_per_second']} tokens/s)"
    )
    print("goals: " + ", ".join(f"{name} {'met' if met else 'NOT met'}" for name, met in report["goals_met"].items()))
    write_report(f"inference-{args.backend}{'-quick' if args.quick else ''}-latest.json", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
