"""Engine benchmark, side by side with the peers a user would otherwise pick.

    sudo .venv/bin/python bench/engine_bench.py [--quick] [--fleet N] [--clients C]

Every runtime (forkyard's engine, podman with runc, bubblewrap) is measured the
same way in one run, with the same counts and the same concurrency (see
"one way of measuring" below): a sandbox is ready once a command has run in it,
and no readiness timer includes a teardown.

* create to first command, p50/p95, ``samples`` sandboxes one at a time;
* exec round trip of ``true``, p50/p95, ``samples`` in one running sandbox
  (forkyard exec, podman exec; bwrap cannot run a command in a running sandbox);
* a fleet of ``--fleet`` sandboxes made ready by ``--clients`` clients at once:
  per second, and the whole machine's CPU per sandbox (forkyard's CPU per
  create by process too: engine, spawner, zygote, the sandboxes' own setup);
  one exec of ``true`` in each, the same clients; memory per idle sandbox
  with the fleet alive (the kernel's own memory it grew by plus the processes'
  proportional set, and MemTotal minus what the kernel can drop); then the
  fleet torn down by the same clients, per second;
* forkyard only: create to first command through a warm pool (a claim).

Part of a sandbox's kernel memory grows with the most superblocks the host has
had at once (see docs/benchmarks.md): compare runs on one boot.

Prints a table and writes JSON to bench/results/engine-latest.json (and a dated
copy, not committed); ``--quick`` writes engine-quick-latest.json.
Installs podman and bubblewrap from Debian if they are missing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.engine.engines import processes  # noqa: E402
from tests.support.engine import EngineProcess  # noqa: E402

RESULTS = ROOT / "bench" / "results"
# PRODUCT.md, "Goals": inside the engine.
GOALS = {"create_to_exec_p50_ms": 10.0, "exec_p50_ms": 2.0, "idle_memory_kib": 512.0}


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


def other_activity() -> list[str]:
    """What else runs on the machine that could take its cores: other test sessions, engines, web
    servers, workers, benchmarks (this run's own processes left out).  Kept in every report."""
    ours = descendants([os.getpid()])
    seen = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in ours:
            continue
        try:
            argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        line = " ".join(part.decode(errors="replace") for part in argv if part)
        if any(mark in line for mark in ("pytest", "sandboxes.engine", "celery", "uvicorn", "daphne", "bench/", "podman")):
            seen.append(line[:160])
    return sorted(seen)


def conditions(**settings: Any) -> dict[str, Any]:
    """The head of every report: the machine, the run's settings, and how busy the machine was at its start."""
    return {
        "machine": machine(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **settings,
        "load_average_at_start": os.getloadavg(),
        "others_at_start": other_activity(),
    }


def conclude(report: dict[str, Any]) -> None:
    """How busy the machine was at the run's end, beside its start (``conditions``)."""
    report["load_average_at_end"] = os.getloadavg()
    report["others_at_end"] = other_activity()


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


# --- one way of measuring, for every runtime ------------------------------------------------
#
# Each runtime is measured the same way, with the same counts and the same concurrency:
#
# * ready means a command ran in the sandbox: forkyard creates, then execs `true`; podman runs a
#   container detached, then `podman exec`s `true` in it; bwrap (which cannot run a command in a
#   sandbox that already runs) starts its sandbox with a shell that prints "ready", read by us;
# * teardown is never inside a timer that measures readiness: each sandbox is torn down after its
#   timer stopped, and the fleet's teardown is timed on its own (destroys per second);
# * a fleet is made by CLIENTS clients at once, each making its share one after another.


class Runtime:
    """A sandbox runtime as the benchmark drives it: make one ready, run a command in one, tear one down."""

    name = ""
    can_exec = True

    def make(self, index: int) -> Any:
        """A new sandbox, returned once a command has run in it."""
        raise NotImplementedError

    def run(self, sandbox: Any) -> None:
        """Run `true` in a sandbox that already runs."""
        raise NotImplementedError

    def destroy(self, sandbox: Any) -> None:
        raise NotImplementedError

    def processes(self, sandboxes: list[Any]) -> set[int]:
        """The host processes that keep these sandboxes alive (for their memory)."""
        raise NotImplementedError


def first_command_ms(runtime: Runtime, samples: int) -> dict[str, float]:
    """Sequential: from asking for a sandbox to a command having run in it; teardown after the timer."""
    runtime.destroy(runtime.make(-1))  # warm caches
    latencies = []
    for index in range(samples):
        started = time.perf_counter()
        sandbox = runtime.make(index)
        latencies.append((time.perf_counter() - started) * 1000)
        runtime.destroy(sandbox)
    return summary(latencies)


def exec_ms(runtime: Runtime, samples: int) -> dict[str, float] | None:
    if not runtime.can_exec:
        return None
    sandbox = runtime.make(-2)
    try:
        for _ in range(5):
            runtime.run(sandbox)
        return summary([timed(lambda: runtime.run(sandbox)) for _ in range(samples)])
    finally:
        runtime.destroy(sandbox)


def fleet(runtime: Runtime, count: int, clients: int, engine: EngineProcess | None = None) -> dict[str, Any]:
    """``count`` sandboxes made ready by ``clients`` at once and kept; execs across them; idle memory;
    then all torn down, ``clients`` at once.  The same steps and counts for every runtime."""
    results: dict[str, Any] = {"count": count, "clients": clients}
    settle()
    before, kernel_before = used_memory_kib(), kernel_memory_kib()
    shares = [list(range(client, count, clients)) for client in range(clients)]
    cpu = CreateCpu(engine) if engine is not None else None
    machine_before = machine_busy_seconds()

    def make_many(indexes: list[int]) -> list[Any]:
        return [runtime.make(index) for index in indexes]

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        sandboxes = [sandbox for chunk in pool.map(make_many, shares) for sandbox in chunk]
    elapsed = time.perf_counter() - started
    results["ready_s"] = round(elapsed, 2)
    results["ready_per_second"] = round(count / elapsed, 1)
    results["machine_cpu_ms_per_ready"] = round((machine_busy_seconds() - machine_before) * 1000 / count, 2)
    if cpu is not None:
        results["cpu_ms_per_create"] = cpu.per_create_ms(count)
    if runtime.can_exec:

        def run_many(chunk: list[Any]) -> int:
            for sandbox in chunk:
                runtime.run(sandbox)
            return len(chunk)

        chunks = [sandboxes[index::clients] for index in range(clients)]
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            executed = sum(pool.map(run_many, chunks))
        results["execs_per_second"] = round(executed / (time.perf_counter() - started), 1)
    time.sleep(2.0)
    settle()
    results["idle_memory_kib"] = round((used_memory_kib() - before) / count, 1)
    results["idle_memory_breakdown_kib"] = fleet_memory_kib(kernel_before, runtime.processes(sandboxes), count)

    def destroy_many(chunk: list[Any]) -> None:
        for sandbox in chunk:
            runtime.destroy(sandbox)

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(destroy_many, [sandboxes[index::clients] for index in range(clients)]))
    results["destroys_per_second"] = round(count / (time.perf_counter() - started), 1)
    return results


# --- forkyard ------------------------------------------------------------------------------------


class Forkyard(Runtime):
    name = "forkyard"

    def __init__(self, engine: EngineProcess) -> None:
        self.engine = engine
        self.clients = threading.local()

    def client(self) -> Any:
        """One engine connection per thread, as a rollout worker holds one."""
        client = getattr(self.clients, "client", None)
        if client is None:
            client = self.clients.client = self.engine.client()
        return client

    def make(self, index: int) -> str:
        sandbox: str = self.client().create(template="base", size="tiny", ttl_s=3600)["id"]
        if self.client().exec(sandbox, ["true"]).exit_code != 0:
            raise RuntimeError("true failed in a new sandbox")
        return sandbox

    def run(self, sandbox: str) -> None:
        if self.client().exec(sandbox, ["true"]).exit_code != 0:
            raise RuntimeError("true failed")

    def destroy(self, sandbox: str) -> None:
        self.client().destroy(sandbox)

    def processes(self, sandboxes: list[str]) -> set[int]:
        # The sandboxes' inits: the engine, spawner and zygote are one per host, not per sandbox.
        spawner = self.engine.spawner_pid() or 0
        return {pid for pid, comm in children_of(spawner).items() if comm != "forkyard-zygote"}


def bench_forkyard(engine: EngineProcess, samples: int, count: int, clients: int) -> dict[str, Any]:
    runtime = Forkyard(engine)
    results: dict[str, Any] = {"first_command_ms": first_command_ms(runtime, samples)}
    # forkyard only (the peers have no equivalent): the same through a warm pool, where a create is a claim.
    with engine.client() as client:
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
        results["warm_pool_first_command_ms"] = summary(warm) | {
            "claims": after["pool_claims"] - pool_before["pool_claims"],
            "misses": after["pool_misses"] - pool_before["pool_misses"],
        }
        client.call("pools.set", template="base", size="tiny", count=0)
        _wait_for_pool_empty(client)
    results["exec_ms"] = exec_ms(runtime, samples)
    results["small_write_ms"] = small_write_ms(engine, samples)
    results["fleet"] = fleet(runtime, count, clients, engine)
    return results


def small_write_ms(engine: EngineProcess, samples: int) -> dict[str, float]:
    """forkyard only: a 100-byte file written through the file API into a running
    sandbox, one after another (the sandbox's own file writer makes it, so that
    it is charged to the sandbox: ARCHITECTURE.md, "Files")."""
    with engine.client() as client:
        sandbox = client.create(template="base", size="tiny", ttl_s=600)["id"]
        try:
            client.write_file(sandbox, "/tmp/warm", b"x")
            latencies = []
            for index in range(samples):
                started = time.perf_counter()
                client.write_file(sandbox, f"/tmp/small-{index % 10}", b"x" * 100)
                latencies.append((time.perf_counter() - started) * 1000)
        finally:
            client.destroy(sandbox)
    return summary(latencies)


def _wait_for_pool(client: Any, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.call("pools")["pools"].get("base/tiny", {}).get("ready", 0) < count:
        if time.monotonic() > deadline:
            raise RuntimeError("the warm pool did not fill")
        time.sleep(0.05)


def _wait_for_pool_empty(client: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.info()["sandboxes"] > 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the warm pool did not drain")
        time.sleep(0.05)


# --- peers ------------------------------------------------------------------------------


def rootfs_tar(engine: EngineProcess, directory: Path) -> tuple[Path, Path]:
    """The same busybox root filesystem for every runtime: a directory and a tarball."""
    from sandboxes.engine.template_store import build_base_rootfs

    rootfs = build_base_rootfs(directory / "rootfs")
    tarball = directory / "rootfs.tar"
    subprocess.run(["tar", "-C", str(rootfs), "-cf", str(tarball), "."], check=True)
    return rootfs, tarball


PODMAN = ["podman", "--runtime", "runc"]
# The default rlimits are above this machine's hard limits (MEASURED.md).
PODMAN_OPTIONS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024", "--network", "none"]
PODMAN_START = PODMAN + ["run", "-d", *PODMAN_OPTIONS]
PODMAN_IMAGE = "localhost/forkyard-bench-base:latest"
PODMAN_PREFIX = "forkyard-bench-"


class Podman(Runtime):
    """`podman run -d` of a container that sleeps, then `podman exec ... true` in it (runc)."""

    name = "podman"

    def __init__(self) -> None:
        self.serial = itertools.count()

    def make(self, index: int) -> str:
        name = f"{PODMAN_PREFIX}{os.getpid()}-{next(self.serial)}"
        subprocess.run(PODMAN_START + ["--name", name, PODMAN_IMAGE, "sleep", "3600"], check=True, capture_output=True)
        self.run(name)
        return name

    def run(self, sandbox: str) -> None:
        subprocess.run(PODMAN + ["exec", sandbox, "/bin/true"], check=True, capture_output=True)

    def destroy(self, sandbox: str) -> None:
        subprocess.run(PODMAN + ["rm", "-f", "-t", "0", sandbox], check=True, capture_output=True)

    def processes(self, sandboxes: list[str]) -> set[int]:
        inspected = subprocess.run(
            PODMAN + ["inspect", "--format", "{{.State.ConmonPid}}", *sandboxes], check=True, capture_output=True, text=True
        ).stdout.split()
        # conmon and what it keeps running (the container's process).
        return descendants([int(pid) for pid in inspected if pid.isdigit()])

    @staticmethod
    def remove_leftovers() -> None:
        names = subprocess.run(
            PODMAN + ["ps", "-a", "--format", "{{.Names}}", "--filter", f"name={PODMAN_PREFIX}"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split()
        if names:
            subprocess.run(PODMAN + ["rm", "-f", "-t", "0", *names], capture_output=True, check=False)


def bench_podman(tarball: Path, samples: int, count: int, clients: int) -> dict[str, Any]:
    subprocess.run(["podman", "import", str(tarball), PODMAN_IMAGE], check=True, capture_output=True)
    runtime = Podman()
    try:
        return {
            "first_command_ms": first_command_ms(runtime, samples),
            "exec_ms": exec_ms(runtime, samples),
            "fleet": fleet(runtime, count, clients),
        }
    finally:
        Podman.remove_leftovers()
        subprocess.run(["podman", "rmi", "-f", PODMAN_IMAGE], capture_output=True)


def _tree(pid: int) -> set[int]:
    """A process and its descendants, from the kernel's list of each one's children (no scan of /proc)."""
    found, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                children = Path(f"/proc/{parent}/task/{task}/children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    frontier.append(child)
    return found


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] != b"Z"


class Bwrap(Runtime):
    """`bwrap --unshare-all` running a shell that prints "ready" and then sleeps; ready once we read it.

    bwrap has no way to run a command in a sandbox that already runs: its first command is its only one.
    No ``--die-with-parent``: it ties the sandbox to the *thread* that started it (PR_SET_PDEATHSIG), and
    the fleet's client threads end before its memory is measured.  Each sandbox is its own process group
    instead (bwrap, the pid namespace's init and the command), and tearing one down is killing that group
    and waiting until none of it is left, as forkyard's destroy waits for its sandbox to be gone."""

    name = "bwrap"
    can_exec = False

    def __init__(self, rootfs: Path) -> None:
        self.command = [
            "bwrap", "--unshare-all", "--ro-bind", str(rootfs), "/", "--proc", "/proc", "--dev", "/dev",
            "/bin/sh", "-c", "echo ready; exec sleep 3600",
        ]  # fmt: skip
        self.alive: set[subprocess.Popen[bytes]] = set()
        self.inside: dict[int, set[int]] = {}  # bwrap's pid -> the sandbox's other processes

    def make(self, index: int) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(self.command, stdout=subprocess.PIPE, start_new_session=True)
        self.alive.add(process)
        assert process.stdout is not None
        line = process.stdout.readline()
        process.stdout.close()  # nothing else comes: the shell has become sleep
        self.inside[process.pid] = _tree(process.pid) - {process.pid}  # taken now, not inside the teardown's timer
        if line != b"ready\n":
            self.destroy(process)
            raise RuntimeError(f"bwrap did not start: {line!r}")
        return process

    def destroy(self, sandbox: subprocess.Popen[bytes]) -> None:
        inside = self.inside.pop(sandbox.pid, set())
        try:
            os.killpg(sandbox.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sandbox.wait()
        # Its other processes, reparented to the host's init, until each has ended (a zombie waiting
        # for that init to reap it has ended: the host's init reaps on its own schedule).
        while any(_running(pid) for pid in inside):
            time.sleep(0.001)
        self.alive.discard(sandbox)

    def processes(self, sandboxes: list[subprocess.Popen[bytes]]) -> set[int]:
        running = [process.pid for process in sandboxes if process.poll() is None]
        if len(running) != len(sandboxes):
            raise RuntimeError(f"{len(sandboxes) - len(running)} bwrap sandboxes died before their memory was measured")
        return descendants(running)


def bench_bwrap(rootfs: Path, samples: int, count: int, clients: int) -> dict[str, Any]:
    runtime = Bwrap(rootfs)
    try:
        return {"first_command_ms": first_command_ms(runtime, samples), "exec_ms": None, "fleet": fleet(runtime, count, clients)}
    finally:
        for process in list(runtime.alive):
            runtime.destroy(process)


# --- report -----------------------------------------------------------------------------


RUNTIMES = ("forkyard", "podman", "bwrap")


def rows(report: dict[str, Any]) -> list[tuple[str, dict[str, Any], bool]]:
    """(label, value per runtime, higher is better) for every measure every runtime took the same way."""

    def each(path: tuple[str, ...]) -> dict[str, Any]:
        values = {}
        for runtime in RUNTIMES:
            value: Any = report.get(runtime)
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            values[runtime] = value
        return values

    count = report["fleet"]
    return [
        ("create to first command, p50 (ms)", each(("first_command_ms", "p50")), False),
        ("create to first command, p95 (ms)", each(("first_command_ms", "p95")), False),
        ("exec of `true`, p50 (ms)", each(("exec_ms", "p50")), False),
        ("exec of `true`, p95 (ms)", each(("exec_ms", "p95")), False),
        (f"{count} made ready, {report['clients']} clients: per second", each(("fleet", "ready_per_second")), True),
        ("  whole machine's CPU per sandbox made ready (ms)", each(("fleet", "machine_cpu_ms_per_ready")), False),
        (f"execs of `true` across the {count}, per second", each(("fleet", "execs_per_second")), True),
        (
            f"kernel + processes per idle sandbox, {count} alive (KiB)",
            each(("fleet", "idle_memory_breakdown_kib", "total")),
            False,
        ),
        (f"host memory per idle sandbox, {count} alive (KiB)", each(("fleet", "idle_memory_kib")), False),
        (f"{count} torn down, {report['clients']} clients: per second", each(("fleet", "destroys_per_second")), True),
    ]


def ratio(peer: float | None, ours: float | None, higher_is_better: bool) -> str:
    if not peer or not ours or peer < 0 or ours < 0:
        return "-"  # a negative "cost" is other processes' memory moving, not a measure
    return f"{ours / peer:.1f}x" if higher_is_better else f"{peer / ours:.1f}x"


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{'':58} {'forkyard':>10} {'podman':>10} {'bwrap':>10}  podman/fy  bwrap/fy")
    for label, values, higher in rows(report):
        shown = ["-" if values[name] is None else f"{values[name]:>10}" for name in RUNTIMES]
        print(
            f"{label:58} {shown[0]:>10} {shown[1]:>10} {shown[2]:>10}"
            f"  {ratio(values['podman'], values['forkyard'], higher):>9} {ratio(values['bwrap'], values['forkyard'], higher):>9}"
        )
    ours = report["forkyard"]
    print(f"\nforkyard only: warm pool, create to first command p50/p95 {ours['warm_pool_first_command_ms']}")
    if "small_write_ms" in ours:
        print(f"forkyard only: a 100-byte file written through the file API, p50/p95 {ours['small_write_ms']}")
    print("CPU per create (ms): " + ", ".join(f"{name} {value}" for name, value in ours["fleet"]["cpu_ms_per_create"].items()))
    print(
        "kernel and init memory per idle sandbox (KiB): "
        + ", ".join(f"{name} {value}" for name, value in ours["fleet"]["idle_memory_breakdown_kib"].items())
    )
    print("goals: " + ", ".join(f"{name} {'met' if met else 'NOT met'}" for name, met in report["goals_met"].items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer samples and a smaller fleet (a smoke run)")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--fleet", type=int, help="sandboxes made and kept by every runtime (default 500; quick 50)")
    parser.add_argument("--clients", type=int, default=8, help="clients making the fleet at once, for every runtime")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("the benchmark creates real sandboxes: run it as root", file=sys.stderr)
        return 2
    samples, count = (20, 50) if args.quick else (100, 500)
    count = args.fleet or count
    work = Path(tempfile.mkdtemp(prefix="fy-bench-", dir="/tmp"))
    os.chmod(work, 0o755)
    engine = EngineProcess(work / "engine", tag="bench")
    report: dict[str, Any] = conditions(quick=args.quick, samples=samples, fleet=count, clients=args.clients)
    try:
        engine.start()
        with engine.client() as client:
            client.call("templates.build_base", name="base", replace=True)
        if not args.no_peers:
            # Peers first: memory the kernel frees late after our fleet would
            # otherwise show up as a negative cost for them.
            ensure_peers()
            rootfs, tarball = rootfs_tar(engine, work)
            print(f"bwrap: {samples} sandboxes one at a time, then {count} from {args.clients} clients...", flush=True)
            report["bwrap"] = bench_bwrap(rootfs, samples, count, args.clients)
            print(
                f"podman (runc): {samples} one at a time, {samples} execs, then {count} from {args.clients} clients...",
                flush=True,
            )
            report["podman"] = bench_podman(tarball, samples, count, args.clients)
        print(f"forkyard: {samples} one at a time, {samples} execs, then {count} from {args.clients} clients...", flush=True)
        report["forkyard"] = bench_forkyard(engine, samples, count, args.clients)
    finally:
        engine.reclaim()
        shutil.rmtree(work, ignore_errors=True)
    conclude(report)
    ours = report["forkyard"]
    report["goals"] = GOALS
    report["goals_met"] = {
        "create_to_exec_p50_under_10ms (cold)": ours["first_command_ms"]["p50"] < GOALS["create_to_exec_p50_ms"],
        "create_to_exec_p50_under_10ms (warm pool)": ours["warm_pool_first_command_ms"]["p50"] < GOALS["create_to_exec_p50_ms"],
        "exec_p50_under_2ms": ours["exec_ms"]["p50"] < GOALS["exec_p50_ms"],
        "idle_memory_under_512KiB (kernel + init)": ours["fleet"]["idle_memory_breakdown_kib"]["total"]
        < GOALS["idle_memory_kib"],
        "idle_memory_under_512KiB (host)": ours["fleet"]["idle_memory_kib"] < GOALS["idle_memory_kib"],
    }
    print_table(report)
    name = "engine-quick" if args.quick else "engine"
    write_report(f"{name}-latest.json", report)
    write_report(f"{name}-{report['started_at'].replace(':', '')}.json", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
