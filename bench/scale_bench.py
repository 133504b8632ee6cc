"""Scale: the kernel's memory per idle sandbox as their number grows, and how fast thousands come and go.

    sudo .venv/bin/python bench/scale_bench.py                       # 1,000 .. 32,752, both modes (long)
    sudo .venv/bin/python bench/scale_bench.py --counts 1000,4096     # some of the curve
    sudo .venv/bin/python bench/scale_bench.py --quick                # 500 and 1,000 (scale-quick-latest.json)

The engine alone (no control plane), tiny sandboxes from ``base``, made by
``--clients`` connections at once and kept idle, in two modes, one after the
other:

* ``own``: each sandbox its own memory cgroup (the default);
* ``grouped``: ``--group-size`` sandboxes share one memory cgroup (the
  engine's ``memory_group``, the API's launch ``memory_group_size``), each
  keeping its own CPU, pids and freezer cgroups;
* ``grouped-cpu``: the same groups also carrying the CPU quota (the
  engine's ``memory_group.cpu``, the API's ``memory_group_cpu: "group"``),
  their members none of their own: no quota write, and so no kernel walk of
  every CPU cgroup, per create.

For each mode the fleet grows through ``--counts``; at each count, once the
host is still: the kernel's memory per sandbox (unreclaimable slab, page
tables, kernel stacks, per-CPU: /proc/meminfo), the inits' proportional set,
the host's memory cgroups (/proc/cgroups), and an exec in a sample of them;
the creates' rate on the way there. Then the whole fleet is torn down (its
rate, and when the kernel's memory is back). The square term is what the
memory cgroup's per-superblock bookkeeping adds: every memory cgroup holds a
slot for every superblock the host has had at once, so a cgroup per sandbox
makes it grow with the number of sandboxes, per sandbox. ``grouped`` at the
same count has about ``1 / group-size`` of those cgroups: the difference per
sandbox between the modes is the term's share.

A count the host cannot hold stops that mode's curve: the step that failed
(a create refused, the kernel's memory near the host's) is reported, with
the counts before it. Needs ``kernel.pid_max`` above the largest count.
Writes bench/results/scale-latest.json (``--modes grouped``: scale-grouped-latest.json; ``--name N``:
scale-N-latest.json).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine_bench import (  # noqa: E402
    children_of,
    conclude,
    conditions,
    kernel_memory_kib,
    proportional_set_kib,
    settle,
    write_report,
)
from bench.leak_bench import memory_cgroups  # noqa: E402
from tests.support.engine import EngineProcess  # noqa: E402

COUNTS = (1000, 4096, 8192, 16384, 32752)
# Stop growing before the kernel's memory leaves the host too little: what is left, at least.
HEADROOM_KIB = 2 * 1024 * 1024


def available_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    return 0


def make(
    engine: EngineProcess, count: int, clients: int, group_size: int, offset: int, group_cpu: bool = False
) -> tuple[list[str], float, str]:
    """``count`` more sandboxes, by ``clients`` at once; (ids, seconds, the error that stopped it or "")."""
    failure: list[str] = []

    def loop(indexes: list[int]) -> list[str]:
        made = []
        with engine.client(timeout_s=600) as client:
            for index in indexes:
                if failure:
                    break
                if available_kib() < HEADROOM_KIB:
                    failure.append(f"the host's available memory fell under {HEADROOM_KIB // 1024} MiB")
                    break
                extra = {}
                if group_size > 1:
                    group = (offset + index) // group_size
                    extra["memory_group"] = {"id": f"scale-{group}", "memory_mib": 128 * group_size}
                    if group_cpu:  # a tiny sandbox's one core, times the group's members
                        extra["memory_group"]["cpu"] = group_size
                try:
                    made.append(client.create(template="base", size="tiny", ttl_s=7 * 24 * 3600, **extra)["id"])
                except Exception as error:  # noqa: BLE001 - what stopped the curve is reported, not raised
                    failure.append(f"{type(error).__name__}: {error}"[:300])
                    break
        return made

    shares = [list(range(client, count, clients)) for client in range(clients)]
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        ids = [sandbox for chunk in pool.map(loop, shares) for sandbox in chunk]
    return ids, time.perf_counter() - started, failure[0] if failure else ""


def census(engine: EngineProcess, fleet: list[str], kernel_before: dict[str, int]) -> dict[str, Any]:
    settle(120)
    kernel = kernel_memory_kib()
    spawner = engine.spawner_pid() or 0
    inits = [pid for pid, comm in children_of(spawner).items() if comm != "forkyard-zygote"]
    sample = random.sample(fleet, min(50, len(fleet)))
    failed = 0
    with engine.client() as client:
        for sandbox in sample:
            if client.exec(sandbox, ["true"]).exit_code != 0:
                failed += 1
    per = {key: round((kernel[key] - kernel_before[key]) / len(fleet), 1) for key in kernel}
    per["inits_pss"] = round(sum(proportional_set_kib(pid) for pid in inits) / len(fleet), 1)
    return {
        "alive": len(fleet),
        "kernel_and_inits_per_sandbox_kib": {**per, "total": round(sum(per.values()), 1)},
        "memory_cgroups": memory_cgroups(),
        "available_kib": available_kib(),
        "sample_execs": len(sample),
        "sample_exec_failures": failed,
    }


def teardown(engine: EngineProcess, fleet: list[str], clients: int) -> float:
    def loop(chunk: list[str]) -> None:
        with engine.client(timeout_s=600) as client:
            for start in range(0, len(chunk), 250):
                client.destroy_many(chunk[start : start + 250])

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(loop, [fleet[index::clients] for index in range(clients)]))
    return time.perf_counter() - started


def curve(engine: EngineProcess, counts: list[int], clients: int, group_size: int, group_cpu: bool = False) -> dict[str, Any]:
    settle(120)
    kernel_before = kernel_memory_kib()
    fleet: list[str] = []
    points = []
    stopped = ""
    for target in counts:
        ids, seconds, stopped = make(engine, target - len(fleet), clients, group_size, len(fleet), group_cpu)
        fleet += ids
        point = {"target": target, "made": len(ids), "creates_per_second": round(len(ids) / max(seconds, 0.001), 1)}
        point.update(census(engine, fleet, kernel_before))
        points.append(point)
        print(
            f"  {len(fleet)} alive: {point['kernel_and_inits_per_sandbox_kib']['total']} KiB each, "
            f"{point['creates_per_second']}/s{'; stopped: ' + stopped if stopped else ''}",
            flush=True,
        )
        if stopped:
            break
    seconds = teardown(engine, fleet, clients)
    settle(120)
    after = kernel_memory_kib()
    return {
        "group_size": group_size,
        "group_cpu": group_cpu,
        "points": points,
        "stopped": stopped,
        "teardown": {"count": len(fleet), "seconds": round(seconds, 1), "per_second": round(len(fleet) / max(seconds, 0.001), 1)},
        "kernel_back_kib": {key: after[key] - kernel_before[key] for key in after},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default=",".join(str(count) for count in COUNTS))
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--modes", default="own,grouped")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--name", default="", help="the results file's name: scale-<name>-latest.json")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("run as root: the benchmark makes real sandboxes", file=sys.stderr)
        return 2
    counts = [500, 1000] if args.quick else [int(count) for count in args.counts.split(",")]
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    if pid_max < max(counts) * 2 + 1000:
        print(
            f"kernel.pid_max is {pid_max}: raise it (sysctl kernel.pid_max=4194304) for {max(counts)} sandboxes", file=sys.stderr
        )
        return 2
    work = Path(tempfile.mkdtemp(prefix="fy-scalebench-", dir="/tmp"))
    os.chmod(work, 0o711)
    report: dict[str, Any] = conditions(counts=counts, clients=args.clients, group_size=args.group_size)
    engine = EngineProcess(work / "engine", env={"FORKYARD_ENGINE_MAX_SANDBOXES": str(max(counts) + 100)})
    try:
        engine.start(timeout_s=120)
        with engine.client() as client:
            client.call("templates.build_base", name="base")
        for mode in args.modes.split(","):
            print(f"{mode}: growing to {counts[-1]}...", flush=True)
            grouped = mode in ("grouped", "grouped-cpu")
            report[mode] = curve(engine, counts, args.clients, args.group_size if grouped else 1, mode == "grouped-cpu")
    finally:
        engine.reclaim()
        shutil.rmtree(work, ignore_errors=True)
    conclude(report)
    if "own" in report and "grouped" in report:
        shares = []
        for own, grouped in zip(report["own"]["points"], report["grouped"]["points"], strict=False):
            if own["alive"] == grouped["alive"]:
                mine = own["kernel_and_inits_per_sandbox_kib"]["total"]
                theirs = grouped["kernel_and_inits_per_sandbox_kib"]["total"]
                shares.append(
                    {"alive": own["alive"], "own_kib": mine, "grouped_kib": theirs, "square_term_kib": round(mine - theirs, 1)}
                )
        report["square_term"] = shares
    # A run of some modes only is kept beside the full one (scale-grouped-latest.json, say), not over it.
    modes = "" if args.modes == "own,grouped" else "-" + args.modes.replace(",", "-")
    name = f"-{args.name}" if args.name else modes
    write_report(f"scale{name}{'-quick' if args.quick else ''}-latest.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
