"""Snapshot and fork benchmark: build an environment once, then fork it.

    sudo .venv/bin/python bench/snapshot_bench.py [--quick] [--no-peers]

The environment, as an RL task would have it: a source tree (1,500 files in
30 directories), a "dependency" blob (16 MiB), and a service the task talks
to (busybox httpd on port 8080, ready when it answers).  Measured in one run:

* fork 1,000 from its snapshot until every fork is exec-ready (its service
  answering, then an exec of ``true``): cold (every fork made on demand) and
  from a warm pool of the snapshot (forks made ahead, a fork is a claim);
* a single fork, create to first exec, p50 and p95 (cold, then pooled);
* building the same environment from scratch in each sandbox instead
  (create from the template, run the setup, start the service): per sandbox,
  and the time for 1,000 projected from the rate over a sample;
* snapshotting a sandbox with 1 GiB of changed files: total time and how long
  the sandbox was frozen, idle and while it keeps writing;
* the peer, measured the same way: the same environment committed with
  ``podman commit``, and as many "forks" as forkyard's single forks: a
  container of that image running the same service, ready once the service
  answers and a command ran in it (its removal after the timer, as
  forkyard's destroy); and ``podman commit`` of a container holding the same
  1 GiB of changes.

Prints a table and writes JSON to bench/results/snapshot-latest.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine_bench import (  # noqa: E402
    PODMAN,
    PODMAN_OPTIONS,
    conclude,
    conditions,
    ensure_peers,
    rootfs_tar,
    summary,
    timed,
    write_report,
)
from tests.support.engine import EngineProcess  # noqa: E402

GOAL_FORK_1000_S = 3.0
SETUP = (
    "mkdir -p /srv/app /opt/deps && cd /srv/app"
    ' && for d in $(seq 1 30); do mkdir m$d; for f in $(seq 1 50); do echo "module $d file $f" > m$d/f$f.py; done; done'
    " && head -c 16777216 /dev/zero | tr '\\0' 'x' > /opt/deps/blob && echo ready > /srv/index.html"
)
SERVICE = {"name": "web", "command": "httpd -f -p 8080 -h /srv", "ready": {"tcp": 8080}}
WAIT_FOR_SERVICE = "until wget -qO- http://127.0.0.1:8080/ >/dev/null 2>&1; do usleep 5000; done"
START_SERVICE = f"httpd -p 8080 -h /srv && {WAIT_FOR_SERVICE}"
CLIENTS = 8


def fork_and_exec(engine: EngineProcess, template: str, count: int) -> tuple[float, list[str]]:
    """``count`` forks from ``CLIENTS`` concurrent clients, each until its first exec; (seconds, ids)."""

    def one(_: int) -> str:
        with engine.client() as client:
            sandbox: str = client.create(template=template, size="tiny", ttl_s=3600)["id"]
            if client.exec(sandbox, "true").exit_code != 0:
                raise RuntimeError("a fork could not run true")
            return sandbox

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        ids = list(pool.map(one, range(count)))
    return time.perf_counter() - started, ids


def destroy_all(engine: EngineProcess, ids: list[str]) -> None:
    def one(sandbox: str) -> None:
        with engine.client() as client:
            client.destroy(sandbox)

    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(one, ids))


def single_forks(engine: EngineProcess, template: str, samples: int) -> list[float]:
    latencies = []
    with engine.client() as client:
        for _ in range(samples):
            started = time.perf_counter()
            sandbox = client.create(template=template, size="tiny", ttl_s=600)["id"]
            client.exec(sandbox, "true")
            latencies.append((time.perf_counter() - started) * 1000)
            client.destroy(sandbox)
    return latencies


def wait_for_pool(engine: EngineProcess, name: str, count: int, timeout_s: float) -> float:
    started = time.perf_counter()
    with engine.client() as client:
        while client.call("pools")["pools"].get(name, {}).get("ready", 0) < count:
            if time.perf_counter() - started > timeout_s:
                raise RuntimeError(f"the warm pool {name} did not reach {count}")
            time.sleep(0.1)
    return time.perf_counter() - started


def from_scratch(engine: EngineProcess, count: int) -> tuple[float, list[float]]:
    """The environment built in each of ``count`` fresh sandboxes; (seconds, per-sandbox ms)."""

    def one(_: int) -> float:
        with engine.client() as client:
            started = time.perf_counter()
            sandbox = client.create(template="base", size="tiny", ttl_s=600)["id"]
            result = client.exec(sandbox, f"{SETUP} && {START_SERVICE}", timeout_s=300)
            if result.exit_code != 0:
                raise RuntimeError(f"setup failed: {result.stderr[-300:]!r}")
            client.exec(sandbox, "true")
            elapsed = (time.perf_counter() - started) * 1000
            client.destroy(sandbox)
            return elapsed

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        each = list(pool.map(one, range(count)))
    return time.perf_counter() - started, each


def big_snapshot(engine: EngineProcess, busy: bool) -> dict[str, Any]:
    """Snapshot a sandbox holding 1 GiB of new files (256 x 4 MiB); busy: a writer keeps going."""
    with engine.client(timeout_s=600) as client:
        sandbox = client.create(template="base", cpu=1, memory_mib=2048, ttl_s=3600)["id"]
        fill = "mkdir /data && for i in $(seq 1 256); do head -c 4194304 /dev/urandom > /data/f$i; done"
        if client.exec(sandbox, fill, timeout_s=600).exit_code != 0:
            raise RuntimeError("could not write 1 GiB")
        if busy:
            client.exec(sandbox, "(while :; do date >> /data/log; usleep 2000; done) >/dev/null 2>&1 &")
        events: list[dict[str, Any]] = []
        started = time.perf_counter()
        snapshot, _ = client.stream(
            "snapshots.create", {"sandbox": sandbox, "name": f"big-{'busy' if busy else 'idle'}"}, on_event=events.append
        )
        seconds = time.perf_counter() - started
        paused = next(event for event in events if event.get("phase") == "paused")
        client.destroy(sandbox)
        client.call("templates.delete", name=snapshot["name"])
        return {
            "seconds": round(seconds, 3),
            "paused_ms": snapshot["paused_ms"],
            "size_bytes": snapshot["size_bytes"],
            "copied_bytes": paused["copied_bytes"],
            "recopied_while_frozen_bytes": paused["recopied_bytes"],
        }


def podman_peer(work: Path, engine: EngineProcess, samples: int) -> dict[str, Any]:
    """podman's way, measured as forkyard is: the same environment committed to an image, and a "fork" is a
    container of that image with the same service, ready once the service answers and a command ran in it
    (the container's removal after the timer, as forkyard's destroy); and the commit of 1 GiB of changes."""
    _, tarball = rootfs_tar(engine, work)
    base, env, big = "localhost/fy-snap-base:latest", "localhost/fy-snap-env:latest", "localhost/fy-snap-big:latest"
    source, filled = "fy-snap-source", "fy-snap-filled"
    subprocess.run(["podman", "import", str(tarball), base], check=True, capture_output=True)
    start = PODMAN + ["run", "-d", *PODMAN_OPTIONS]
    try:
        subprocess.run(start + ["--name", source, base, "sleep", "3600"], check=True, capture_output=True)
        subprocess.run(PODMAN + ["exec", source, "sh", "-c", SETUP], check=True, capture_output=True)
        subprocess.run(PODMAN + ["commit", "-q", source, env], check=True, capture_output=True)
        serial = iter(range(10**6))

        def fork() -> str:
            name = f"fy-snap-fork-{next(serial)}"
            subprocess.run(start + ["--name", name, env, *SERVICE["command"].split()], check=True, capture_output=True)
            subprocess.run(PODMAN + ["exec", name, "sh", "-c", WAIT_FOR_SERVICE], check=True, capture_output=True)
            return name

        def remove(name: str) -> None:
            subprocess.run(PODMAN + ["rm", "-f", "-t", "0", name], check=True, capture_output=True)

        remove(fork())  # warm
        forks = []
        for _ in range(samples):
            started = time.perf_counter()
            name = fork()
            forks.append((time.perf_counter() - started) * 1000)
            remove(name)

        subprocess.run(start + ["--name", filled, base, "sleep", "3600"], check=True, capture_output=True)
        fill = "mkdir /data && for i in $(seq 1 256); do head -c 4194304 /dev/urandom > /data/f$i; done"
        subprocess.run(PODMAN + ["exec", filled, "sh", "-c", fill], check=True, capture_output=True)
        commit_s = timed(lambda: subprocess.run(PODMAN + ["commit", "-q", filled, big], check=True, capture_output=True)) / 1000
        return {"commit_1gib_s": round(commit_s, 3), "fork_to_exec_ms": summary(forks), "pauses_container": True}
    finally:
        subprocess.run(PODMAN + ["rm", "-f", "-t", "0", source, filled], capture_output=True)
        subprocess.run(["podman", "rmi", "-f", big, env, base], capture_output=True)


def print_table(report: dict[str, Any]) -> None:
    ours = report["forkyard"]
    peer = report.get("podman") or {}
    projected = "" if ours["forks"] == 1000 else f", projected from {ours['forks']}"
    rows = [
        (f"fork 1,000 to exec-ready, cold (s{projected})", ours["fork_1000_cold_s"], None),
        (f"fork 1,000 to exec-ready, warm pool (s{projected})", ours["fork_1000_pool_s"], None),
        ("  (filling that pool beforehand, s)", ours["pool_fill_s"], None),
        (
            "single fork to first exec, p50, cold (ms)",
            ours["single_fork_ms"]["p50"],
            (peer.get("fork_to_exec_ms") or {}).get("p50"),
        ),
        (
            "single fork to first exec, p95, cold (ms)",
            ours["single_fork_ms"]["p95"],
            (peer.get("fork_to_exec_ms") or {}).get("p95"),
        ),
        ("single fork to first exec, p50, pooled (ms)", ours["single_pooled_fork_ms"]["p50"], None),
        ("build from scratch, per sandbox p50 (ms)", ours["scratch_ms"]["p50"], None),
        ("build from scratch, 1,000 sandboxes (s, projected)", ours["scratch_1000_projected_s"], None),
        ("snapshot 1 GiB, idle: total (s)", ours["snapshot_1gib_idle"]["seconds"], peer.get("commit_1gib_s")),
        ("snapshot 1 GiB, idle: frozen (ms)", ours["snapshot_1gib_idle"]["paused_ms"], None),
        ("snapshot 1 GiB, writing: total (s)", ours["snapshot_1gib_busy"]["seconds"], None),
        ("snapshot 1 GiB, writing: frozen (ms)", ours["snapshot_1gib_busy"]["paused_ms"], None),
    ]
    print(f"\n{'measure':<52} {'forkyard':>10} {'podman':>10} {'podman/forkyard':>16}")
    for label, value, other in rows:
        ratio = f"{other / value:.1f}x" if other and value else ""
        print(f"{label:<52} {value:>10} {other if other is not None else '':>10} {ratio:>16}")
    print(f"\nfrom scratch / cold fork, 1,000 sandboxes: {ours['scratch_1000_projected_s'] / ours['fork_1000_cold_s']:.1f}x")
    print(
        f"goal: 1,000 forks exec-ready within {GOAL_FORK_1000_S} s: cold {'met' if report['goals_met']['fork_1000_cold'] else 'NOT met'},"
        f" warm pool {'met' if report['goals_met']['fork_1000_pool'] else 'NOT met'}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100 forks instead of 1,000, fewer samples")
    parser.add_argument("--no-peers", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("the benchmark creates real sandboxes: run it as root", file=sys.stderr)
        return 2
    forks, samples, scratch = (100, 10, 8) if args.quick else (1000, 50, 48)
    work = Path(tempfile.mkdtemp(prefix="fy-snapbench-", dir="/tmp"))
    os.chmod(work, 0o755)
    engine = EngineProcess(work / "engine", tag="snapbench")
    report: dict[str, Any] = conditions(quick=args.quick)
    ours: dict[str, Any] = {"forks": forks}
    try:
        engine.start()
        with engine.client(timeout_s=600) as client:
            client.call("templates.build_base", name="base", replace=True)
            source = client.create(template="base", size="tiny", ttl_s=3600)["id"]
            started = time.perf_counter()
            client.exec(source, SETUP, timeout_s=300)
            ours["setup_once_s"] = round(time.perf_counter() - started, 3)
            started = time.perf_counter()
            snapshot = client.call("snapshots.create", sandbox=source, name="env", services=[SERVICE])
            ours["snapshot_env_s"] = round(time.perf_counter() - started, 3)
            ours["snapshot_env"] = {key: snapshot[key] for key in ("size_bytes", "files", "paused_ms")}
            client.destroy(source)

        print(f"single forks: {samples} cold...", flush=True)
        ours["single_fork_ms"] = summary(single_forks(engine, "env", samples))
        print(f"fork {forks}, cold...", flush=True)
        seconds, ids = fork_and_exec(engine, "env", forks)
        ours["fork_1000_cold_s"] = round(seconds * 1000 / forks, 3) if forks != 1000 else round(seconds, 3)
        ours["fork_cold_measured_s"] = round(seconds, 3)
        destroy_all(engine, ids)

        print(f"fork {forks} from a warm pool of {forks}...", flush=True)
        with engine.client() as client:
            client.call("pools.set", template="env", size="tiny", count=forks)
        ours["pool_fill_s"] = round(wait_for_pool(engine, "env/tiny", forks, timeout_s=600), 3)
        seconds, ids = fork_and_exec(engine, "env", forks)
        ours["fork_1000_pool_s"] = round(seconds * 1000 / forks, 3) if forks != 1000 else round(seconds, 3)
        ours["fork_pool_measured_s"] = round(seconds, 3)
        destroy_all(engine, ids)
        with engine.client() as client:
            client.call("pools.set", template="env", size="tiny", count=2)
        wait_for_pool(engine, "env/tiny", 2, timeout_s=60)
        pooled = []
        with engine.client() as client:
            for _ in range(samples):
                wait_for_pool(engine, "env/tiny", 1, timeout_s=60)
                started = time.perf_counter()
                sandbox = client.create(template="env", size="tiny", ttl_s=600)["id"]
                client.exec(sandbox, "true")
                pooled.append((time.perf_counter() - started) * 1000)
                client.destroy(sandbox)
            client.call("pools.set", template="env", size="tiny", count=0)
        ours["single_pooled_fork_ms"] = summary(pooled)

        print(f"from scratch: {scratch} sandboxes...", flush=True)
        seconds, each = from_scratch(engine, scratch)
        ours["scratch_ms"] = summary(each)
        ours["scratch_measured"] = {"sandboxes": scratch, "seconds": round(seconds, 3)}
        ours["scratch_1000_projected_s"] = round(seconds / scratch * 1000, 1)

        print("snapshot of 1 GiB, idle, then while writing...", flush=True)
        ours["snapshot_1gib_idle"] = big_snapshot(engine, busy=False)
        ours["snapshot_1gib_busy"] = big_snapshot(engine, busy=True)
        report["forkyard"] = ours
        if not args.no_peers:
            ensure_peers()
            print("podman: commit 1 GiB, run the committed image...", flush=True)
            report["podman"] = podman_peer(work, engine, samples)  # as many forks as forkyard's single forks
    finally:
        engine.reclaim()
        shutil.rmtree(work, ignore_errors=True)
    report["goals_met"] = {
        "fork_1000_cold": ours["fork_1000_cold_s"] <= GOAL_FORK_1000_S,
        "fork_1000_pool": ours["fork_1000_pool_s"] <= GOAL_FORK_1000_S,
    }
    conclude(report)
    print_table(report)
    write_report("snapshot-quick-latest.json" if args.quick else "snapshot-latest.json", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
