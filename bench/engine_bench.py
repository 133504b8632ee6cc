"""Engine benchmark, side by side with the peers a user would otherwise pick.

    sudo .venv/bin/python bench/engine_bench.py [--quick]

Measures, on this machine, in one run:

* create to first successful exec (p50, p95): forkyard's engine; podman run
  --rm (runc) and bwrap, where the one-shot run *is* create-to-first-exec;
* exec round trip of ``true`` (p50, p95): forkyard exec; podman exec into a
  running container; bwrap has no exec (a new bwrap per command is its only way);
* creates per second for 1,000 sandboxes (forkyard: concurrent clients), and
  forkyard's CPU per create while it makes them, by process (engine, spawner,
  zygote, the sandboxes' own setup) and for the whole machine;
* host memory per idle sandbox with 1,000 alive (MemTotal - MemAvailable,
  before and after; podman and bwrap measured with fewer, as they cost more).
  Part of a sandbox's kernel memory grows with the most superblocks the host
  has had at once (see docs/benchmarks.md): compare runs on one boot.

Prints a table and writes JSON to bench/results/ (latest.json and a dated copy).
Installs podman and bubblewrap from Debian if they are missing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.engine.engines import processes  # noqa: E402
from tests.support.engine import EngineProcess  # noqa: E402

RESULTS = ROOT / "bench" / "results"
GOALS = {"create_to_exec_p50_ms": 10.0, "exec_p50_ms": 5.0, "idle_memory_kib": 512.0}


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def summary(values: list[float]) -> dict[str, float]:
    return {"p50": round(percentile(values, 0.5), 3), "p95": round(percentile(values, 0.95), 3), "n": len(values)}


def timed(action: Callable[[], Any]) -> float:
    started = time.perf_counter()
    action()
    return (time.perf_counter() - started) * 1000


def write_report(name: str, report: dict[str, Any]) -> Path:
    """Save a benchmark's report as bench/results/<name> (JSON) and say where."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {path}")
    return path


def used_memory_kib() -> int:
    """Memory in use that the kernel cannot simply drop (call after settle())."""
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0])
    return (
        fields["MemTotal"] - fields["MemFree"] - fields["Buffers"] - fields["Cached"] + fields["Shmem"] - fields["SReclaimable"]
    )


KERNEL_MEMORY = ("SUnreclaim", "PageTables", "KernelStack", "Percpu")


def kernel_memory_kib() -> dict[str, int]:
    """The kernel's own memory that sandboxes hold (slab, page tables, stacks,
    per-CPU): unlike used_memory_kib, it barely moves with other processes'
    heaps, which makes it the steadier measure on a shared machine."""
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0])
    return {key: fields[key] for key in KERNEL_MEMORY}


def proportional_set_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def descendants(roots: list[int]) -> set[int]:
    """The processes under ``roots``, roots included."""
    table = processes()
    found, frontier = set(roots), list(roots)
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (_, ppid) in table.items() if ppid == parent and pid not in found]
        found.update(children)
        frontier.extend(children)
    return found


def fleet_memory_kib(kernel_before: dict[str, int], pids: set[int], fleet: int) -> dict[str, float]:
    """Per idle sandbox: what the kernel's own memory grew by, and the
    proportional set of the processes that keep the fleet alive. The same
    measure for every runtime, so the figures compare."""
    kernel_after = kernel_memory_kib()
    breakdown = {key: round((kernel_after[key] - kernel_before[key]) / fleet, 1) for key in KERNEL_MEMORY}
    breakdown["processes_pss"] = round(sum(proportional_set_kib(pid) for pid in pids) / fleet, 1)
    return breakdown | {"total": round(sum(breakdown.values()), 1)}


def settle(timeout_s: float = 30.0) -> None:
    """Drop caches and wait until memory use stops moving: destroyed network
    namespaces, for one, are freed by a kernel worker seconds later."""
    deadline = time.monotonic() + timeout_s
    previous = None
    while time.monotonic() < deadline:
        subprocess.run(["sync"], check=False)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        time.sleep(0.5)
        current = used_memory_kib()
        if previous is not None and abs(current - previous) < 2048:
            return
        previous = current


def machine() -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "?",
    )
    return {
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1),
        "python": platform.python_version(),
        "cgroups": "v2" if Path("/sys/fs/cgroup/cgroup.controllers").exists() else "v1/hybrid",
    }


def ensure_peers() -> None:
    missing = [
        package
        for package, binary in (("podman", "podman"), ("runc", "runc"), ("bubblewrap", "bwrap"))
        if not shutil.which(binary)
    ]
    if missing:
        subprocess.run(["apt-get", "install", "-y", "-q", *missing], check=True, capture_output=True)


# --- forkyard ---------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """CPU time a process has used, all its threads (schedstat: nanoseconds, not ticks)."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
    except OSError:
        pass
    return total / 1e9


def machine_busy_seconds() -> float:
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def children_of(parent: int) -> dict[int, str]:
    return {pid: name for pid, (name, ppid) in processes().items() if ppid == parent}


class CreateCpu:
    """CPU spent creating a fleet, by process: the engine, the spawner, the zygote
    (when there is one), and the sandboxes' own inits (their setup before they
    serve; idle after).  The machine's total counts whatever else runs too."""

    def __init__(self, engine: EngineProcess) -> None:
        self.engine_pid = engine.pid
        self.spawner_pid = engine.spawner_pid() or 0
        self.existing = set(children_of(self.spawner_pid))
        self.before = self._helpers()
        self.machine = machine_busy_seconds()

    @property
    def zygote_pid(self) -> int:
        zygotes = [pid for pid, comm in children_of(self.spawner_pid).items() if comm == "forkyard-zygote"]
        return zygotes[0] if zygotes else 0

    def _helpers(self) -> dict[str, float]:
        zygote = self.zygote_pid
        return {
            "engine": cpu_seconds(self.engine_pid),
            "spawner": cpu_seconds(self.spawner_pid),
            "zygote": cpu_seconds(zygote) if zygote else 0.0,
        }

    def per_create_ms(self, count: int) -> dict[str, float]:
        after = self._helpers()
        machine = machine_busy_seconds() - self.machine
        inits = [
            pid for pid, comm in children_of(self.spawner_pid).items() if comm != "forkyard-zygote" and pid not in self.existing
        ]
        result = {name: (after[name] - self.before[name]) * 1000 / count for name in after}
        result["sandbox"] = sum(cpu_seconds(pid) for pid in inits) * 1000 / max(1, len(inits))
        result["total"] = sum(result.values())
        result["machine"] = machine * 1000 / count
        return {name: round(value, 2) for name, value in result.items()}


def bench_forkyard(engine: EngineProcess, samples: int, fleet: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with engine.client() as client:
        for _ in range(10):  # warm the spawner and the page cache
            client.destroy(client.create(template="base", size="tiny")["id"])
        ready = []
        for _ in range(samples):
            started = time.perf_counter()
            sandbox = client.create(template="base", size="tiny", ttl_s=600)["id"]
            assert client.exec(sandbox, ["true"]).exit_code == 0
            ready.append((time.perf_counter() - started) * 1000)
            client.destroy(sandbox)
        results["create_to_exec_ms"] = summary(ready)
        # The same through a warm pool: a create is a claim (refilled behind it).
        client.call("pools.set", template="base", size="tiny", count=32)
        _wait_for_pool(client, 32)
        pool_before = client.info()
        warm = []
        for _ in range(samples):
            started = time.perf_counter()
            sandbox = client.create(template="base", size="tiny", ttl_s=600)["id"]
            assert client.exec(sandbox, ["true"]).exit_code == 0
            warm.append((time.perf_counter() - started) * 1000)
            client.destroy(sandbox)
            time.sleep(0.01)  # rollouts do work between creates; the pool refills meanwhile
        after = client.info()
        results["warm_create_to_exec_ms"] = summary(warm) | {
            "claims": after["pool_claims"] - pool_before["pool_claims"],
            "misses": after["pool_misses"] - pool_before["pool_misses"],
        }
        client.call("pools.set", template="base", size="tiny", count=0)
        sandbox = client.create(template="base", size="tiny", ttl_s=600)["id"]
        for _ in range(50):
            client.exec(sandbox, ["true"])
        results["exec_ms"] = summary([timed(lambda: client.exec(sandbox, ["true"])) for _ in range(samples * 5)])
        client.destroy(sandbox)

    settle()
    before = used_memory_kib()
    kernel_before = kernel_memory_kib()
    ids: list[str] = []
    workers = 8

    def create_many(count: int) -> list[str]:
        with engine.client() as client:
            return [client.create(template="base", size="tiny", ttl_s=3600)["id"] for _ in range(count)]

    cpu = CreateCpu(engine)
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for chunk in pool.map(create_many, [fleet // workers] * workers):
            ids.extend(chunk)
    elapsed = time.perf_counter() - started
    results["cpu_ms_per_create"] = cpu.per_create_ms(len(ids))
    results["creates_per_second"] = round(len(ids) / elapsed, 1)
    results["fleet"] = len(ids)
    results["fleet_create_s"] = round(elapsed, 2)

    # Throughput of exec across the fleet, many clients at once.
    def exec_many(chunk: list[str]) -> int:
        with engine.client() as client:
            for sandbox_id in chunk:
                client.exec(sandbox_id, ["true"])
        return len(chunk)

    chunks = [ids[index::workers] for index in range(workers)]
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        executed = sum(pool.map(exec_many, chunks))
    results["execs_per_second"] = round(executed / (time.perf_counter() - started), 1)

    time.sleep(2.0)
    settle()
    results["idle_memory_kib"] = round((used_memory_kib() - before) / len(ids), 1)
    zygote = cpu.zygote_pid
    # The sandboxes' inits; the engine, spawner and zygote are one per host, not per sandbox.
    inits = {pid for pid in children_of(cpu.spawner_pid) if pid not in cpu.existing and pid != zygote}
    results["idle_memory_breakdown_kib"] = fleet_memory_kib(kernel_before, inits, len(ids))

    def destroy_many(chunk: list[str]) -> None:
        with engine.client() as client:
            for sandbox_id in chunk:
                client.destroy(sandbox_id)

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(destroy_many, chunks))
    results["destroys_per_second"] = round(len(ids) / (time.perf_counter() - started), 1)
    return results


def _wait_for_pool(client: Any, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.call("pools")["pools"].get("base/tiny", {}).get("ready", 0) < count:
        if time.monotonic() > deadline:
            raise RuntimeError("the warm pool did not fill")
        time.sleep(0.05)


# --- peers ------------------------------------------------------------------------------


def rootfs_tar(engine: EngineProcess, directory: Path) -> tuple[Path, Path]:
    """The same busybox root filesystem for every runtime: a directory and a tarball."""
    from sandboxes.engine.templates import build_base_rootfs

    rootfs = build_base_rootfs(directory / "rootfs")
    tarball = directory / "rootfs.tar"
    subprocess.run(["tar", "-C", str(rootfs), "-cf", str(tarball), "."], check=True)
    return rootfs, tarball


PODMAN = ["podman", "--runtime", "runc"]
# The default rlimits are above this machine's hard limits (MEASURED.md).
PODMAN_OPTIONS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024", "--network", "none"]
PODMAN_RUN = PODMAN + ["run", "--rm", *PODMAN_OPTIONS]
PODMAN_START = PODMAN + ["run", "-d", *PODMAN_OPTIONS]


def bench_podman(tarball: Path, samples: int, fleet: int) -> dict[str, Any]:
    image = "localhost/forkyard-bench-base:latest"
    subprocess.run(["podman", "import", str(tarball), image], check=True, capture_output=True)
    results: dict[str, Any] = {}
    try:
        subprocess.run(PODMAN_RUN + [image, "/bin/true"], check=True, capture_output=True)
        results["create_to_exec_ms"] = summary(
            [
                timed(lambda: subprocess.run(PODMAN_RUN + [image, "/bin/true"], check=True, capture_output=True))
                for _ in range(samples)
            ]
        )
        name = "forkyard-bench-exec"
        subprocess.run(PODMAN_START + ["--name", name, image, "sleep", "600"], check=True, capture_output=True)
        try:
            results["exec_ms"] = summary(
                [
                    timed(lambda: subprocess.run(PODMAN + ["exec", name, "/bin/true"], check=True, capture_output=True))
                    for _ in range(samples)
                ]
            )
        finally:
            subprocess.run(PODMAN + ["rm", "-f", "-t", "0", name], capture_output=True)
        settle()
        before, kernel_before = used_memory_kib(), kernel_memory_kib()
        names = [f"forkyard-bench-idle-{index}" for index in range(fleet)]
        started = time.perf_counter()
        for name in names:
            subprocess.run(PODMAN_START + ["--name", name, image, "sleep", "3600"], check=True, capture_output=True)
        results["creates_per_second"] = round(fleet / (time.perf_counter() - started), 2)
        time.sleep(2.0)
        settle()
        results["idle_memory_kib"] = round((used_memory_kib() - before) / fleet, 1)
        inspected = subprocess.run(
            PODMAN + ["inspect", "--format", "{{.State.ConmonPid}}", *names], check=True, capture_output=True, text=True
        ).stdout.split()
        # conmon and what it keeps running (the container's process).
        results["idle_memory_breakdown_kib"] = fleet_memory_kib(
            kernel_before, descendants([int(pid) for pid in inspected if pid.isdigit()]), fleet
        )
        results["fleet"] = fleet
        subprocess.run(PODMAN + ["rm", "-f", "-t", "0", *names], capture_output=True)
    finally:
        subprocess.run(["podman", "rmi", "-f", image], capture_output=True)
    return results


def bench_bwrap(rootfs: Path, samples: int, fleet: int) -> dict[str, Any]:
    command = ["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", str(rootfs), "/", "--proc", "/proc", "--dev", "/dev"]
    results: dict[str, Any] = {}
    subprocess.run(command + ["/bin/true"], check=True)
    results["create_to_exec_ms"] = summary(
        [timed(lambda: subprocess.run(command + ["/bin/true"], check=True)) for _ in range(samples)]
    )
    results["exec_ms"] = results["create_to_exec_ms"] | {"note": "no exec into a running bwrap: each command is a new sandbox"}
    settle()
    before, kernel_before = used_memory_kib(), kernel_memory_kib()
    started = time.perf_counter()
    running = [subprocess.Popen(command + ["/bin/sleep", "3600"]) for _ in range(fleet)]
    results["creates_per_second"] = round(fleet / (time.perf_counter() - started), 1)
    time.sleep(2.0)
    settle()
    results["idle_memory_kib"] = round((used_memory_kib() - before) / fleet, 1)
    results["idle_memory_breakdown_kib"] = fleet_memory_kib(kernel_before, descendants([p.pid for p in running]), fleet)
    results["fleet"] = fleet
    for process in running:
        process.kill()
        process.wait()
    return results


# --- report -----------------------------------------------------------------------------


def ratio(peer: float | None, ours: float | None) -> str:
    if not peer or not ours:
        return "-"
    return f"{peer / ours:.1f}x"


def print_table(report: dict[str, Any]) -> None:
    ours, podman, bwrap = report["forkyard"], report.get("podman", {}), report.get("bwrap", {})
    rows = [
        (
            "warm pool: create to first exec p50 (ms)",
            ours["warm_create_to_exec_ms"]["p50"],
            podman.get("create_to_exec_ms", {}).get("p50"),
            bwrap.get("create_to_exec_ms", {}).get("p50"),
        ),
        (
            "warm pool: create to first exec p95 (ms)",
            ours["warm_create_to_exec_ms"]["p95"],
            podman.get("create_to_exec_ms", {}).get("p95"),
            bwrap.get("create_to_exec_ms", {}).get("p95"),
        ),
        (
            "create to first exec p50 (ms)",
            ours["create_to_exec_ms"]["p50"],
            podman.get("create_to_exec_ms", {}).get("p50"),
            bwrap.get("create_to_exec_ms", {}).get("p50"),
        ),
        (
            "create to first exec p95 (ms)",
            ours["create_to_exec_ms"]["p95"],
            podman.get("create_to_exec_ms", {}).get("p95"),
            bwrap.get("create_to_exec_ms", {}).get("p95"),
        ),
        (
            "exec `true` p50 (ms)",
            ours["exec_ms"]["p50"],
            podman.get("exec_ms", {}).get("p50"),
            bwrap.get("exec_ms", {}).get("p50"),
        ),
        (
            "exec `true` p95 (ms)",
            ours["exec_ms"]["p95"],
            podman.get("exec_ms", {}).get("p95"),
            bwrap.get("exec_ms", {}).get("p95"),
        ),
        ("creates per second", ours["creates_per_second"], podman.get("creates_per_second"), bwrap.get("creates_per_second")),
        (
            "host memory per idle sandbox (KiB)",
            ours["idle_memory_kib"],
            podman.get("idle_memory_kib"),
            bwrap.get("idle_memory_kib"),
        ),
        (
            "kernel + processes per idle sandbox (KiB)",
            ours["idle_memory_breakdown_kib"]["total"],
            podman.get("idle_memory_breakdown_kib", {}).get("total"),
            bwrap.get("idle_memory_breakdown_kib", {}).get("total"),
        ),
    ]
    print(f"\n{'':42} {'forkyard':>10} {'podman':>10} {'bwrap':>10}   podman/forkyard  bwrap/forkyard")
    for label, mine, theirs, bubble in rows:
        higher_is_better = label.startswith("creates")

        def show(value: Any) -> str:
            return "-" if value is None else f"{value:>10}"

        podman_ratio = ratio(mine, theirs) if higher_is_better else ratio(theirs, mine)
        bwrap_ratio = ratio(mine, bubble) if higher_is_better else ratio(bubble, mine)
        print(f"{label:42} {show(mine)} {show(theirs)} {show(bubble)}   {podman_ratio:>15} {bwrap_ratio:>15}")
    print(
        f"\nforkyard: {ours['execs_per_second']} execs/s across {ours['fleet']} sandboxes; "
        f"{ours['fleet']} created in {ours['fleet_create_s']} s; {ours['destroys_per_second']} destroys/s"
    )
    print("CPU per create (ms): " + ", ".join(f"{name} {value}" for name, value in ours["cpu_ms_per_create"].items()))
    print(
        "kernel and init memory per idle sandbox (KiB): "
        + ", ".join(f"{name} {value}" for name, value in ours["idle_memory_breakdown_kib"].items())
    )
    print("goals: " + ", ".join(f"{name} {'met' if met else 'NOT met'}" for name, met in report["goals_met"].items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    parser.add_argument("--no-peers", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("the benchmark creates real sandboxes: run it as root", file=sys.stderr)
        return 2
    samples, fleet, peer_samples, peer_fleet = (50, 200, 5, 10) if args.quick else (200, 1000, 20, 40)
    work = Path(tempfile.mkdtemp(prefix="fy-bench-", dir="/tmp"))
    os.chmod(work, 0o755)
    engine = EngineProcess(work / "engine", tag="bench")
    report: dict[str, Any] = {
        "machine": machine(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "quick": args.quick,
    }
    try:
        engine.start()
        with engine.client() as client:
            client.call("templates.build_base", name="base", replace=True)
        if not args.no_peers:
            # Peers first: memory the kernel frees late after our fleet would
            # otherwise show up as a negative cost for them.
            ensure_peers()
            rootfs, tarball = rootfs_tar(engine, work)
            print(f"bwrap: {samples} runs, {peer_fleet * 5} idle...", flush=True)
            report["bwrap"] = bench_bwrap(rootfs, samples, peer_fleet * 5)
            print(f"podman (runc): {peer_samples} runs, {peer_fleet} idle...", flush=True)
            report["podman"] = bench_podman(tarball, peer_samples, peer_fleet)
        print(f"forkyard: {samples} create-to-exec samples, {samples * 5} execs, a fleet of {fleet}...", flush=True)
        report["forkyard"] = bench_forkyard(engine, samples, fleet)
    finally:
        engine.reclaim()
        shutil.rmtree(work, ignore_errors=True)
    ours = report["forkyard"]
    report["goals"] = GOALS
    report["goals_met"] = {
        "create_to_exec_p50_under_10ms (cold)": ours["create_to_exec_ms"]["p50"] < GOALS["create_to_exec_p50_ms"],
        "create_to_exec_p50_under_10ms (warm pool)": ours["warm_create_to_exec_ms"]["p50"] < GOALS["create_to_exec_p50_ms"],
        "exec_p50_under_5ms": ours["exec_ms"]["p50"] < GOALS["exec_p50_ms"],
        "idle_memory_under_512KiB": ours["idle_memory_kib"] < GOALS["idle_memory_kib"],
    }
    print_table(report)
    write_report("engine-latest.json", report)
    write_report(f"engine-{report['started_at'].replace(':', '')}.json", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
