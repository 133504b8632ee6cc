"""The public API's speed: the engine benchmark's measures, through HTTP and the SDK.

    sudo .venv/bin/python bench/api_bench.py [--backend embedded|postgres] [--quick]

Starts the whole product the way the tests do (engine, a Celery worker,
uvicorn for HTTP, Daphne for the board's websockets, the database; the
control plane with its production clocks), sets a warm pool of 32 tiny
sandboxes, then measures:

* create to first exec, p50/p95: POST /sandboxes (answered once it runs) then
  POST .../exec of `true`, one at a time, through raw HTTP (httpx) and the
  SDK; the destroy after each is not timed;
* exec round trip of `true`, p50/p95, in one sandbox, through HTTP and the SDK,
  and the web server's CPU per exec;
* throughput, as a trainer loads it: 32 keep-alive connections (wrk, so that
  the load generator costs little of the machine) on exec of `true`, on a
  small file read and on a small file write, across 64 sandboxes, two ways:
  straight to the host (its gateway, with each sandbox's data token from
  its ``data_path``: what the SDK does) and through the web server (the API's
  hot path: what curl does); requests per second, p50/p99, the web server's,
  worker's and engine's CPU per request; and the engine's own exec rate in
  the same run over the same sandboxes, 32 clients on its socket;
* a launch of 1,000 from the template and a launch of 1,000 forks of a
  snapshot: the time until every member has answered an exec of `true`
  (8 clients exec each member, straight to its host as the SDK does, as soon
  as the launch's arrivals stream pushes it, as the SDK's launch.wait() reads it;
  a member that fails fails the benchmark), and until the stream has brought
  them all running; the worker's, web server's and engine's CPU per
  sandbox meanwhile; then one exec of `true` in each member again, 8 clients at
  once (execs per second across sandboxes, and their p50); then the launch's
  DELETE until it is stopped (destroys per second); behind the forks'
  teardown, a snapshot of another sandbox is asked for (the interactive lane:
  how long it waits behind the bulk work), so the template launch's teardown,
  which has nothing beside it as the engine's own has not, is the one compared;
* the engine alone in the same run (the same count made ready by 8 clients,
  then destroyed), and the API's rates as a share of its own: creates,
  destroys, execs.

Goals (PRODUCT.md and the throughput issue): create to first exec p50 under
15 ms, exec p50 under 5 ms, 1,000 execs per second across sandboxes with p50
under 30 ms, 1,000 execs, file reads and file writes a second through the API
with 32 connections (exec p99 under 100 ms), 1,000 forks of a snapshot all
exec-ready within 3 s, the API at 80 % or more of the engine's rate for
creates, destroys and execs.  Prints a table; writes
bench/results/api-<backend>-latest.json (``--quick``: api-<backend>-quick-latest.json).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine_bench import (  # noqa: E402
    CreateCpu,
    Forkyard,
    conclude,
    conditions,
    cpu_seconds,
    fleet,
    settle,
    summary,
    timed,
    write_report,
)
from tests.support.stack import PRODUCTION_TIMING, Stack  # noqa: E402

GOALS = {
    "create_to_exec_p50_ms": 15.0,
    "exec_p50_ms": 5.0,
    "execs_per_second": 1000.0,
    "execs_p50_at_load_ms": 30.0,
    "fork_1000_exec_ready_s": 3.0,
    "share_of_engine_rate": 0.8,
    "exec_p99_at_load_ms": 100.0,
}
CLIENTS = 8
POOL = 32
THROUGHPUT_SANDBOXES = 64
THROUGHPUT_CONNECTIONS = 32


class Processes:
    """CPU used between two moments (schedstat: all threads), by process: the product's (web server,
    board, workers, engine, spawner, zygote), the sandboxes' own inits made meanwhile, this benchmark's
    client (it stands in for the trainer on the same machine), and the machine's total: what the
    launch costs two cores, and whose it is."""

    def __init__(self, stack: Stack) -> None:
        assert stack.engine is not None and stack.web_pid and stack.worker_pid
        self.pids = {
            "web": stack.web_pid,
            "board": stack.board_pid or 0,
            "worker": stack.worker_pid,
            "interactive": stack.interactive_worker_pid or 0,
            "engine": stack.engine.pid,
        }
        self.create = CreateCpu(stack.engine)
        self.before = {name: cpu_seconds(pid) if pid else 0.0 for name, pid in self.pids.items()}
        self.client = time.process_time()

    def per(self, count: int) -> dict[str, float]:
        """Milliseconds of CPU per unit of work, by process; ``other`` is the machine's rest (the
        database and broker, the kernel's own threads, whatever else runs)."""
        result = {
            name: (cpu_seconds(pid) - self.before[name]) * 1000 / count if pid else 0.0
            for name, pid in self.pids.items()
        }
        result["client"] = (time.process_time() - self.client) * 1000 / count
        created = self.create.per_create_ms(count)
        result.update(spawner=created["spawner"], zygote=created["zygote"], sandbox=created["sandbox"])
        result["machine"] = created["machine"]
        result["other"] = result["machine"] - sum(value for name, value in result.items() if name != "machine")
        return {name: round(value, 2) for name, value in result.items()}


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
        cpu = Processes(stack)
        results["exec_ms"] = summary([timed(lambda: api.post(url, json={"cmd": ["true"]})) for _ in range(samples * 3)])
        results["cpu_ms_per_exec"] = cpu.per(samples * 3)
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


class Execs:
    """Exec of `true` from CLIENTS threads, each with its own connections: straight to the sandbox's host with
    its data token when its row gave one (``data_path``: what the SDK does), else through the API."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.local = threading.local()
        self.clients: list[httpx.Client] = []

    def _client(self, name: str, url: str, headers: dict[str, str] | None = None) -> httpx.Client:
        clients = getattr(self.local, "clients", None)
        if clients is None:
            clients = self.local.clients = {}
        client = clients.get(name)
        if client is None:
            client = clients[name] = httpx.Client(base_url=url, headers=headers or {}, timeout=120)
            self.clients.append(client)
        return client

    def run(self, sandbox_id: str, route: dict[str, Any] | None = None) -> float:
        if route is None:
            client = self._client("api", self.stack.url, {"Authorization": f"Bearer {self.stack.teams[0].key}"})
            headers = {}
        else:
            client = self._client(route["url"], route["url"])
            headers = {"Authorization": f"Bearer {route['token']}"}
        started = time.perf_counter()
        answer = client.post(f"/api/v1/sandboxes/{sandbox_id}/exec", json={"cmd": ["true"]}, headers=headers)
        took = (time.perf_counter() - started) * 1000
        if answer.status_code != 200 or answer.json()["exit_code"] != 0:
            raise RuntimeError(f"exec in {sandbox_id}: {answer.status_code} {answer.text[:300]}")
        return took

    def close(self) -> None:
        for client in self.clients:
            client.close()


WRK_SCRIPT = """
mode, targets = "%s", {%s}
counter = 0
request = function()
  counter = counter + 1
  local pair = targets[(counter %% #targets) + 1]
  local path = "/api/v1/sandboxes/" .. pair[1]
  local auth = {["Authorization"] = "Bearer " .. pair[2], ["Content-Type"] = "application/json"}
  if mode == "exec" then
    return wrk.format("POST", path .. "/exec", auth, '{"cmd": ["true"]}')
  elseif mode == "read" then
    return wrk.format("GET", path .. "/files?path=/tmp/bench.txt", auth)
  end
  return wrk.format("PUT", path .. "/files?path=/tmp/bench.txt", auth, "a line of a rollout's output\\n")
end
"""


def wrk_script(work: Path, name: str, mode: str, pairs: list[tuple[str, str]]) -> Path:
    """A wrk script sending ``mode`` requests round the (sandbox id, bearer) pairs."""
    script = work / f"{name}-{mode}.lua"
    script.write_text(WRK_SCRIPT % (mode, ", ".join(f'{{"{sandbox}", "{bearer}"}}' for sandbox, bearer in pairs)))
    return script


def wrk(url: str, script: Path, connections: int, seconds: int) -> dict[str, Any]:
    """wrk (C, keep-alive connections): requests per second and latency quantiles; any non-2xx fails the run."""
    command = ["wrk", "-t2", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", str(script), url]
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    if "Non-2xx" in output or "Socket errors" in output:
        raise RuntimeError(f"wrk saw failures:\n{output}")
    quantiles = dict(re.findall(r"^\s+(50|75|90|99)%\s+([\d.]+\w+)$", output, re.MULTILINE))

    def milliseconds(text: str) -> float:
        number, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
        return round(float(number) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit], 2)

    return {
        "requests": int(re.search(r"(\d+) requests in", output).group(1)),  # type: ignore[union-attr]
        "per_second": round(float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1)), 1),  # type: ignore[union-attr]
        "latency_ms": {f"p{quantile}": milliseconds(value) for quantile, value in quantiles.items()},
    }


def engine_exec_rate(stack: Stack, engine_ids: list[str], clients: int, seconds: float) -> dict[str, Any]:
    """The engine's own rate for the same work in the same run: exec of `true` across the same sandboxes,
    ``clients`` at once, each on its own connection, straight to the engine's socket."""
    assert stack.engine is not None
    stop = time.monotonic() + seconds
    counts: list[int] = []
    latencies: list[float] = []
    lock = threading.Lock()

    def client_loop(offset: int) -> None:
        done, mine = 0, []
        with stack.engine.client() as engine:  # type: ignore[union-attr]
            while time.monotonic() < stop:
                started = time.perf_counter()
                if engine.exec(engine_ids[(offset + done) % len(engine_ids)], ["true"]).exit_code != 0:
                    raise RuntimeError("true failed")
                mine.append((time.perf_counter() - started) * 1000)
                done += 1
        with lock:
            counts.append(done)
            latencies.extend(mine)

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(client_loop, range(clients)))
    return {"per_second": round(sum(counts) / (time.monotonic() - started), 1), "latency_ms": summary(latencies)}


def bench_throughput(stack: Stack, work: Path, sandboxes: int, connections: int, seconds: int) -> dict[str, Any]:
    """The issue's load: ``connections`` keep-alive clients (wrk) on exec of `true`, a small file read and a
    small file write across ``sandboxes`` sandboxes, two ways: through the API (the web server's hot path)
    and straight to the sandboxes' host (its gateway, with each sandbox's data token: what the SDK does);
    the processes' CPU per request; and the engine's own exec rate over the same sandboxes, the same number
    of clients at once, on its socket."""
    results: dict[str, Any] = {"sandboxes": sandboxes, "connections": connections, "seconds": seconds}
    with stack.client() as api:
        rows = [
            api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 3600}).json()
            for _ in range(sandboxes)
        ]
        ids = [row["id"] for row in rows]
        for sandbox in ids:
            assert (
                api.put(f"/api/v1/sandboxes/{sandbox}/files", params={"path": "/tmp/bench.txt"}, content=b"x\n").status_code
                == 200
            )
        with stack.engine.client() as engine:  # type: ignore[union-attr]
            engine_ids = [entry["id"] for entry in engine.list() if entry.get("key") in set(ids)]
        assert len(engine_ids) == sandboxes, "the engine does not list every sandbox by its key"
        gateway = rows[0]["data_path"]["url"]
        ways = {
            "api": (stack.url, [(sandbox, stack.teams[0].key) for sandbox in ids]),
            "direct": (gateway, [(row["id"], row["data_path"]["token"]) for row in rows]),
        }
        for way, (url, pairs) in ways.items():
            for mode in ("exec", "read", "write"):
                script = wrk_script(work, way, mode, pairs)
                wrk(url, script, connections, 2)  # warm: connections, caches, the engine's pools
                cpu = Processes(stack)
                run = wrk(url, script, connections, seconds)
                run["cpu_ms_per_request"] = cpu.per(run["requests"])
                results[mode if way == "api" else f"direct_{mode}"] = run
        results["engine_exec"] = engine_exec_rate(stack, engine_ids, connections, seconds)
        engine_rate = results["engine_exec"]["per_second"]
        results["api_share_of_engine_exec_rate"] = round(results["exec"]["per_second"] / engine_rate, 2)
        results["direct_share_of_engine_exec_rate"] = round(results["direct_exec"]["per_second"] / engine_rate, 2)
        for sandbox in ids:
            api.delete(f"/api/v1/sandboxes/{sandbox}", params={"wait": False})
    return results


def bench_launch(
    stack: Stack, count: int, source: dict[str, str], *, snapshot_behind: bool = False, timeout_s: float = 600
) -> dict[str, Any]:
    """A launch of ``count`` until every member has answered an exec; then execs across them; then its teardown.

    It starts on a settled machine, as the engine's own fleet does (``fleet``): the kernel still frees the
    previous teardown's cgroups, namespaces and subvolumes for seconds after the API called it stopped,
    on the same two cores, and the rates compared must be measured alike."""
    settle()
    execs = Execs(stack)
    with stack.client() as api, concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        cpu = Processes(stack)
        started = time.perf_counter()
        launch = api.post("/api/v1/launches", json={**source, "size": "tiny", "count": count, "ttl_s": 1800})
        if launch.status_code != 201:
            raise RuntimeError(f"launch refused: {launch.text[:300]}")
        launch_id = launch.json()["id"]
        sent: dict[str, concurrent.futures.Future[float]] = {}
        routes: dict[str, dict[str, Any] | None] = {}
        all_running_s = first_running_s = None
        # As the SDK's launch.wait() follows a launch: its arrivals stream, each member pushed once as it is ready.
        with api.stream("GET", f"/api/v1/launches/{launch_id}/arrivals", timeout=timeout_s) as arriving:
            for line in arriving.iter_lines():
                if not line:
                    continue
                message = json.loads(line)
                if message["type"] == "sandbox":
                    member = message["sandbox"]
                    if member["state"] != "running":
                        raise RuntimeError(f"launch {launch_id}: a member {member['state']}: {member.get('error')}")
                    routes[member["id"]] = member.get("data_path")
                    sent[member["id"]] = pool.submit(execs.run, member["id"], routes[member["id"]])
                    first_running_s = first_running_s or time.perf_counter() - started
                    if len(sent) == count:
                        all_running_s = time.perf_counter() - started
                if time.perf_counter() - started > timeout_s:
                    raise RuntimeError(f"launch {launch_id} not exec-ready after {timeout_s} s: {len(sent)} running")
        if len(sent) != count:
            raise RuntimeError(f"launch {launch_id}: {len(sent)} of {count} members came")
        for future in sent.values():
            future.result()  # raises a failed exec
        exec_ready_s = time.perf_counter() - started
        per_sandbox = cpu.per(count)
        state = api.get(f"/api/v1/launches/{launch_id}").json()

        # Load: one exec in each member again, CLIENTS at once.
        cpu = Processes(stack)
        started = time.perf_counter()
        latencies = list(pool.map(execs.run, list(sent), [routes[sandbox] for sandbox in sent]))
        across_s = time.perf_counter() - started
        per_exec = cpu.per(count)

        bystander = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600}).json()["id"]
        time.sleep(1)
        started = time.perf_counter()
        api.delete(f"/api/v1/launches/{launch_id}")
        snapshot_behind_teardown_s, taken = None, None
        if snapshot_behind:
            # What a person waits on, asked for right behind the teardown's bulk work: a snapshot (the host's
            # interactive lane), until it is ready.
            asked = time.perf_counter()
            taken = api.post(f"/api/v1/sandboxes/{bystander}/snapshot", json={"name": "behind-a-teardown"}).json()
            while api.get(f"/api/v1/snapshots/{taken['id']}").json()["state"] == "creating":
                time.sleep(0.02)
            snapshot_behind_teardown_s = round(time.perf_counter() - asked, 2)
        while api.get(f"/api/v1/launches/{launch_id}").json()["state"] != "stopped":
            if time.perf_counter() - started > timeout_s:
                raise RuntimeError(f"launch {launch_id} did not stop")
            time.sleep(0.05)
        teardown_s = time.perf_counter() - started
        api.delete(f"/api/v1/sandboxes/{bystander}", params={"wait": False})
        if taken is not None:
            api.delete(f"/api/v1/snapshots/{taken['id']}")
    execs.close()
    return {
        "count": count,
        "first_running_s": round(first_running_s or exec_ready_s, 2),
        "all_running_s": round(all_running_s or exec_ready_s, 2),
        "exec_ready_s": round(exec_ready_s, 2),
        "ready_per_second": round(count / exec_ready_s, 1),
        "progress": state["progress"],
        "cpu_ms_per_sandbox": per_sandbox,
        "execs_across": {
            "execs_per_second": round(count / across_s, 1),
            "exec_ms": summary(latencies),
            "cpu_ms_per_exec": per_exec,
        },
        "teardown_s": round(teardown_s, 2),
        "destroys_per_second": round(count / teardown_s, 1),
        "snapshot_behind_the_teardown_s": snapshot_behind_teardown_s,
    }


def make_snapshot(stack: Stack) -> str:
    """A ready snapshot of a sandbox with a file written in it (no services)."""
    with stack.client() as api:
        sandbox = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600}).json()
        api.put(f"/api/v1/sandboxes/{sandbox['id']}/files", params={"path": "/srv/task.txt"}, content=b"the task\n")
        snapshot = api.post(f"/api/v1/sandboxes/{sandbox['id']}/snapshot", json={"name": "bench"}).json()
        deadline = time.monotonic() + 120
        while (state := api.get(f"/api/v1/snapshots/{snapshot['id']}").json()["state"]) == "creating":
            if time.monotonic() > deadline:
                raise RuntimeError("the snapshot did not become ready")
            time.sleep(0.1)
        if state != "ready":
            raise RuntimeError(f"the snapshot is {state}")
        api.delete(f"/api/v1/sandboxes/{sandbox['id']}")
        return str(snapshot["id"])


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
    report: dict[str, Any] = conditions(backend=args.backend, warm_pool=POOL, clients=CLIENTS)
    try:
        stack.start()
        stack.set_limits(stack.teams[0], requests_per_second=100000, max_sandboxes=40000)
        with stack.engine.client() as engine:  # type: ignore[union-attr]
            engine.call("pools.set", template="base", size="tiny", count=POOL)
        time.sleep(2)
        print(f"{args.backend}: HTTP, {samples} creates...", flush=True)
        report["http"] = bench_http(stack, samples)
        print("SDK...", flush=True)
        report["sdk"] = bench_sdk(stack, samples)
        print(f"throughput: {THROUGHPUT_CONNECTIONS} connections (wrk) over {THROUGHPUT_SANDBOXES} sandboxes...", flush=True)
        report["throughput"] = bench_throughput(
            stack, work, THROUGHPUT_SANDBOXES, THROUGHPUT_CONNECTIONS, 5 if args.quick else 15
        )
        print(f"launch of {launch_count} from the template...", flush=True)
        report["launch"] = bench_launch(stack, launch_count, {"template": "base"})
        print(f"launch of {launch_count} forks of a snapshot...", flush=True)
        report["fork_launch"] = bench_launch(stack, launch_count, {"snapshot": make_snapshot(stack)}, snapshot_behind=True)
        print(f"the engine alone, same run: {launch_count} made ready, {CLIENTS} clients...", flush=True)
        with stack.engine.client() as engine:  # type: ignore[union-attr]
            engine.call("pools.set", template="base", size="tiny", count=0)
        # The control plane's reconciliation (every 5 s) destroys engine sandboxes no row claims, which these
        # are: its workers stop first, or a pass in the middle of the fleet takes it down.
        for pid in (stack.worker_pid, stack.interactive_worker_pid):
            stack.kill(pid)
        stack.worker_pid = stack.interactive_worker_pid = 0
        report["engine_same_run"] = fleet(Forkyard(stack.engine), launch_count, CLIENTS, stack.engine)  # type: ignore[arg-type]
    finally:
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)
    conclude(report)
    http, sdk, launch, forks = report["http"], report["sdk"], report["launch"], report["fork_launch"]
    engine = report["engine_same_run"]
    throughput = report["throughput"]
    report["share_of_engine_rate"] = {
        "creates": round(launch["ready_per_second"] / engine["ready_per_second"], 2),
        "destroys": round(launch["destroys_per_second"] / engine["destroys_per_second"], 2),
        "execs": throughput["direct_share_of_engine_exec_rate"],  # the SDK's way: straight to the host
        "execs_through_the_web_server": throughput["api_share_of_engine_exec_rate"],
    }
    report["goals"] = GOALS
    across = launch["execs_across"]
    report["goals_met"] = {
        "create_to_exec_p50_under_15ms": http["create_to_exec_ms"]["p50"] < GOALS["create_to_exec_p50_ms"],
        "exec_p50_under_5ms": http["exec_ms"]["p50"] < GOALS["exec_p50_ms"],
        "1000_execs_per_second_across_sandboxes": across["execs_per_second"] >= GOALS["execs_per_second"],
        "exec_p50_at_that_load_under_30ms": across["exec_ms"]["p50"] < GOALS["execs_p50_at_load_ms"],
        f"{forks['count']}_forks_exec_ready_under_3s": forks["exec_ready_s"] < GOALS["fork_1000_exec_ready_s"],
    }
    for kind, share in report["share_of_engine_rate"].items():
        report["goals_met"][f"{kind}_at_80pct_of_the_engine"] = share >= GOALS["share_of_engine_rate"]
    for mode in ("exec", "read", "write"):
        # Straight to the host is the public API as the SDK uses it; through the web server, as curl does.
        report["goals_met"][f"1000_{mode}s_per_second_through_the_api"] = (
            throughput[f"direct_{mode}"]["per_second"] >= GOALS["execs_per_second"]
        )
        report["goals_met"][f"1000_{mode}s_per_second_through_the_web_server"] = (
            throughput[mode]["per_second"] >= GOALS["execs_per_second"]
        )
    report["goals_met"]["exec_p99_under_100ms_at_that_load"] = (
        throughput["direct_exec"]["latency_ms"]["p99"] < GOALS["exec_p99_at_load_ms"]
    )
    report["goals_met"]["exec_p99_under_100ms_at_that_load_through_the_web_server"] = (
        throughput["exec"]["latency_ms"]["p99"] < GOALS["exec_p99_at_load_ms"]
    )
    print(f"\n{'':34} {'HTTP':>10} {'SDK':>10}")
    for label, key in (("create to first exec", "create_to_exec_ms"), ("exec `true`", "exec_ms")):
        for quantile in ("p50", "p95"):
            print(f"{label + ' ' + quantile + ' (ms)':34} {http[key][quantile]:>10} {sdk[key][quantile]:>10}")
    print(f"CPU per exec (ms): {http['cpu_ms_per_exec']}")
    for name, run in (("template", launch), ("snapshot forks", forks)):
        print(
            f"launch of {run['count']} ({name}): all running {run['all_running_s']} s, all exec-confirmed {run['exec_ready_s']} s "
            f"({run['ready_per_second']}/s); CPU per sandbox {run['cpu_ms_per_sandbox']}; "
            f"then {run['execs_across']['execs_per_second']} execs/s across them (p50 {run['execs_across']['exec_ms']['p50']} ms); "
            f"torn down in {run['teardown_s']} s ({run['destroys_per_second']}/s)"
        )
    for mode in ("exec", "read", "write"):
        for way, key in (("through the web server", mode), ("straight to the host", f"direct_{mode}")):
            run = throughput[key]
            print(
                f"{mode} {way}, {throughput['connections']} connections: {run['per_second']}/s, "
                f"p50 {run['latency_ms']['p50']} ms, p99 {run['latency_ms']['p99']} ms; CPU per request {run['cpu_ms_per_request']}"
            )
    print(f"exec, the engine alone, same run: {throughput['engine_exec']['per_second']}/s")
    print(f"share of the engine's rate (same run): {report['share_of_engine_rate']}")
    print("goals: " + ", ".join(f"{name} {'met' if met else 'NOT met'}" for name, met in report["goals_met"].items()))
    write_report(f"api-{args.backend}{'-quick' if args.quick else ''}-latest.json", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
