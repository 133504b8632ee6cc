"""What the machine's own PID 1 costs as the sandboxes grow in number: a fact of the host, not of forkyard.

    sudo .venv/bin/python bench/pid1_bench.py [--counts 1000,2000,4000,8000,16000] [--window 10]

One engine of its own (tests/engine/engines.py), tiny sandboxes in memory
groups of 64 (so that tens of thousands fit), made up to each count in turn;
at each, once the machine has settled for 5 s, the CPU that PID 1 uses over
``--window`` seconds (``/proc/1/stat``), as a share of one core, with the
number of processes on the machine. Nothing runs in the sandboxes: each is
one idle process, its init. Then the sandboxes are destroyed.

Where PID 1 is systemd or tini, it does nothing while processes merely exist.
Where it is not (this development machine's is a VM agent, ``process_api``,
at niceness -10), its cost comes out of every run here, and the benchmarks
of tens of thousands of sandboxes must be read with it
(docs/benchmarks.md). Writes bench/results/pid1-latest.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpu_census import process_stat  # noqa: E402
from bench.engine_bench import conclude, conditions, write_report  # noqa: E402
from tests.engine.engines import separate_engine  # noqa: E402

GROUP = 64


def pid1_ticks() -> int:
    stat = process_stat(1)
    assert stat is not None  # PID 1 is always there
    return stat[2]  # its own time, not its reaped children's


def pid1_share(window_s: float) -> float:
    """PID 1's CPU over the window, as a share of one core (1.0: a whole core)."""
    before, started = pid1_ticks(), time.monotonic()
    time.sleep(window_s)
    return (pid1_ticks() - before) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - started)


def processes() -> int:
    return sum(1 for entry in os.listdir("/proc") if entry.isdigit())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="1000,2000,4000,8000,16000", help="sandbox counts, rising (default %(default)s)")
    parser.add_argument("--window", type=float, default=10.0, help="seconds PID 1 is watched at each count")
    args = parser.parse_args()
    counts = sorted(int(count) for count in args.counts.split(","))
    name = Path("/proc/1/comm").read_text().strip()
    report: dict[str, Any] = conditions(counts=counts, window_s=args.window, pid1=name)
    work = Path(tempfile.mkdtemp(prefix="fy-pid1bench-", dir="/tmp"))
    os.chmod(work, 0o755)  # sandboxes pass through it to their state directory
    rows: list[dict[str, Any]] = []
    with separate_engine(work / "engine", env={"FORKYARD_ENGINE_MAX_SANDBOXES": str(max(counts) + 100)}) as engine:

        def one(index: int) -> str:
            with engine.client() as client:
                group = {"id": f"pid1-{index // GROUP}", "memory_mib": 8192}
                return str(client.create(template="base", size="tiny", memory_group=group)["id"])

        made: list[str] = []
        rows.append({"sandboxes": 0, "processes": processes(), "pid1_core_share": round(pid1_share(args.window), 3)})
        print(rows[-1], flush=True)
        try:
            for count in counts:
                with ThreadPoolExecutor(16) as pool:
                    made += pool.map(one, range(len(made), count))
                time.sleep(5)
                rows.append({"sandboxes": count, "processes": processes(), "pid1_core_share": round(pid1_share(args.window), 3)})
                print(rows[-1], flush=True)
        finally:
            with engine.client() as client:
                for start in range(0, len(made), 500):
                    client.destroy_many(made[start : start + 500])
    report["rows"] = rows
    conclude(report)
    write_report("pid1-latest.json", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
