"""Networks: what a policy costs a sandbox, and what its traffic gets through the host.

    sudo .venv/bin/python bench/network_bench.py           # full run (about 10 minutes)
    sudo .venv/bin/python bench/network_bench.py --quick   # smoke run (network-quick-latest.json)

One engine with a pool, an nftables table and a hosts file of its own, and a
server in a network namespace the benchmark makes (198.18.x.2, MEASURED.md's
network rule: nothing here leaves the machine). In the same run:

* create to first command, p50/p95, one at a time, for a sandbox without a
  policy, with an address policy, and with a name policy (a ``host`` rule on
  443: a resolver and a name proxy as well), interleaved so that they share
  the machine's noise, each policed kind measured right after an unpoliced
  sandbox and again right after a policed one was destroyed (``SEQUENCE``); and the exec round trip of `true` without a
  policy and with one;
* connections: the probe (tests/probe/probe.c) opens ``--connections`` TCP
  connections one after the other, each sending a line and reading the
  answer: from the host straight to the server (the floor), from a sandbox
  under an address rule (its veth, its chains, the host's forwarding), and
  from a sandbox under a name rule on 443 (each connection sends a TLS
  ClientHello naming the server and goes through the name proxy);
* throughput: ``--mib`` MiB sent on one connection to the server's sink, from
  the host, from a sandbox under an address rule, and from one under a name
  rule on port 80 (an HTTP head naming the server, then the bytes, through
  the name proxy);
* a policy changed under ``--alive`` running sandboxes at once: each made
  ready under a policy by 8 clients, their host memory per sandbox, then
  ``network.set_many`` for all of them (what a policy's PUT sends a host)
  and how long until it answered, then all torn down, and what is left of
  their devices and rules;
* the leak loop with a policy: ``--cycles`` create/exec/destroy cycles, each
  sandbox under an address policy, and the census of bench/leak_bench.py
  before and after (processes, mounts, cgroups, namespaces, the firewall's
  rules, file descriptors...).

Goals (the networks issue): a policy adds under 5 ms to create p50;
sandboxes without one pay nothing (no device, no rule); 1,000 sandboxes with
policies alive at once; nothing left after 1,000 cycles with a policy.
Writes bench/results/network-latest.json.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine_bench import Forkyard, conclude, conditions, exec_ms, fleet, summary, write_report  # noqa: E402
from bench.leak_bench import measure  # noqa: E402
from tests.engine.networks import host_devices, table_objects  # noqa: E402
from tests.engine.test_name_proxy import client_hello  # noqa: E402
from tests.support.engine import EngineProcess  # noqa: E402
from tests.support.netns import Server, serving  # noqa: E402

NAME = "svc.fytest.example"
GOALS = {"policy_adds_to_create_p50_ms": 5.0, "alive_with_policies": 1000, "cycles_with_a_policy": 1000, "policy_change_s": 1.0}


class Policed(Forkyard):
    """forkyard's sandboxes, each under ``network`` (the engine's create argument)."""

    def __init__(self, engine: EngineProcess, network: dict[str, Any] | None) -> None:
        super().__init__(engine)
        self.network = network

    def make(self, index: int) -> str:
        options = {"network": self.network} if self.network is not None else {}
        sandbox: str = self.client().create(template="base", size="tiny", ttl_s=3600, **options)["id"]
        if self.client().exec(sandbox, ["true"]).exit_code != 0:
            raise RuntimeError("true failed in a new sandbox")
        return sandbox


def policies(server: Server) -> dict[str, dict[str, Any] | None]:
    network = f"{server.address.rsplit('.', 1)[0]}.0/24"
    return {
        "none": None,
        "address": {"egress": [{"cidr": network, "ports": [8080, 8082], "protocol": "tcp"}]},
        "name": {"egress": [{"host": NAME, "ports": [443, 80]}, {"cidr": network, "ports": [8080, 8082], "protocol": "tcp"}]},
    }


# Each policed create measured right after an unpoliced sandbox, and again right after a policed one was
# destroyed (a launch under a policy churning): the second costs ~10 ms more, whatever the kind, so an
# interleaving that always puts one kind second would charge that kind for it.
SEQUENCE = ("none", "address", "none", "name", "address", "address", "name", "name")


def create_to_first_command(engine: EngineProcess, server: Server, samples: int) -> dict[str, Any]:
    runtimes = {kind: Policed(engine, network) for kind, network in policies(server).items()}
    latencies: dict[str, list[float]] = {}
    for runtime in runtimes.values():
        runtime.destroy(runtime.make(-1))  # warm
    for _ in range(samples):
        previous = "none"
        for kind in SEQUENCE:
            label = kind if kind == "none" or previous == "none" else f"{kind}_after_policed"
            started = time.perf_counter()
            sandbox = runtimes[kind].make(0)
            latencies.setdefault(label, []).append((time.perf_counter() - started) * 1000)
            runtimes[kind].destroy(sandbox)
            previous = kind
    results: dict[str, Any] = {label: summary(values) for label, values in latencies.items()}
    for label in ("address", "name", "address_after_policed", "name_after_policed"):
        results[f"{label}_adds_p50_ms"] = round(results[label]["p50"] - results["none"]["p50"], 2)
    results["exec_ms"] = {kind: exec_ms(runtimes[kind], samples * 2) for kind in ("none", "address")}
    return results


def probe_numbers(output: str, *names: str) -> list[float]:
    return [float(re.search(rf"{name} ([\d.]+)", output).group(1)) for name in names]  # type: ignore[union-attr]


def on_host(probe: Path, *arguments: str) -> str:
    return subprocess.run([str(probe), *arguments], capture_output=True, text=True, check=True, timeout=600).stdout


def in_sandbox(engine: EngineProcess, sandbox: str, *arguments: str) -> str:
    with engine.client() as client:
        result = client.exec(sandbox, ["/probe", *arguments], timeout_s=600)
    if result.exit_code != 0:
        raise RuntimeError(f"probe {arguments} in {sandbox}: {result}")
    return result.stdout.decode()


def traffic(engine: EngineProcess, server: Server, probe: Path, connections: int, mib: int) -> dict[str, Any]:
    kinds = policies(server)
    results: dict[str, Any] = {"connections": connections, "mib": mib}
    with engine.client() as client:
        sandboxes = {
            kind: client.create(template="base", size="tiny", ttl_s=3600, network=kinds[kind])["id"]
            for kind in ("address", "name")
        }
        for sandbox in sandboxes.values():
            client.write_file(sandbox, "/probe", probe.read_bytes(), mode=0o755)
        client.write_file(sandboxes["name"], "/tmp/hello", client_hello(NAME))
        # Through the name proxy on port 80: an HTTP head naming the server, then the bytes (the server's sink).
        client.write_file(sandboxes["name"], "/tmp/head", f"POST /sink HTTP/1.1\r\nHost: {NAME}\r\n\r\n".encode())
    hello = Path(tempfile.mkdtemp(prefix="fy-netbench-")) / "hello"
    hello.write_bytes(client_hello(NAME))
    target, sink = f"{server.address}:8080", f"{server.address}:8082"
    try:
        runs = {
            "host": on_host(probe, "connect_many", target, str(connections)),
            "address_rule": in_sandbox(engine, sandboxes["address"], "connect_many", target, str(connections)),
            "name_rule_via_proxy": in_sandbox(
                engine, sandboxes["name"], "connect_many", f"{server.other}:443", str(connections), "/tmp/hello"
            ),
        }
        for kind, output in runs.items():
            done, failed, seconds = probe_numbers(output, "CONNECTED", "FAILED", "SECONDS")
            results[f"connect_{kind}"] = {"per_second": round(done / seconds, 1), "failed": int(failed)}
        for kind, output in (
            ("host", on_host(probe, "send_mib", sink, str(mib))),
            ("address_rule", in_sandbox(engine, sandboxes["address"], "send_mib", sink, str(mib))),
            (
                "name_rule_via_proxy",
                in_sandbox(engine, sandboxes["name"], "send_mib", f"{server.other}:80", str(mib), "/tmp/head"),
            ),
        ):
            sent, seconds = probe_numbers(output, "SENT", "SECONDS")
            results[f"throughput_{kind}"] = {"mib_per_second": round(sent / (1 << 20) / seconds, 1)}
    finally:
        shutil.rmtree(hello.parent, ignore_errors=True)
        with engine.client() as client:
            for sandbox in sandboxes.values():
                client.destroy(sandbox)
    return results


def alive_with_policies(engine: EngineProcess, server: Server, count: int) -> dict[str, Any]:
    """``count`` sandboxes under a policy at once, then a policy change for all of them, then teardown."""
    runtime = Policed(engine, policies(server)["address"])
    made: list[str] = []

    class Keep(Policed):
        def destroy(self, sandbox: str) -> None:
            made.append(sandbox)  # kept for the policy change; torn down below

    keeper = Keep(engine, runtime.network)
    results = fleet(keeper, count, 8, engine)
    results.pop("destroys_per_second")  # Keep only collected them: the teardown is timed below
    changed = {"egress": [{"cidr": f"{server.address}/32", "ports": [8081], "protocol": "tcp"}]}
    with engine.client() as client:
        started = time.perf_counter()
        for start in range(0, len(made), 1000):
            answers = client.call(
                "network.set_many", items=[{"id": sandbox, "network": changed} for sandbox in made[start : start + 1000]]
            )
            failed = [answer for answer in answers["sandboxes"] if "error" in answer]
            if failed:
                raise RuntimeError(f"the policy change failed for {len(failed)}: {failed[:3]}")
        results["policy_change_s"] = round(time.perf_counter() - started, 3)
        started = time.perf_counter()
        for start in range(0, len(made), 250):
            client.destroy_many(made[start : start + 250])
        results["teardown_s"] = round(time.perf_counter() - started, 2)
    results["left_after_teardown"] = {"devices": len(host_devices(engine)), "rules": len(table_objects(engine))}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--alive", type=int, default=1000)
    parser.add_argument("--cycles", type=int, default=1000)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("run as root: the benchmark makes real sandboxes, namespaces and rules", file=sys.stderr)
        return 2
    if args.quick:
        args.samples, args.connections, args.mib, args.alive, args.cycles = 20, 200, 64, 100, 100
    work = Path(tempfile.mkdtemp(prefix="fy-netbench-", dir="/tmp"))
    os.chmod(work, 0o711)
    tag = os.urandom(3).hex()
    hosts = work / "hosts"
    env = {
        "FORKYARD_ENGINE_NETWORK_POOL": f"198.19.{16 * (int(tag[:2], 16) % 16)}.0/20",  # 2,048 sandboxes
        "FORKYARD_ENGINE_NETWORK_TABLE": f"fybench_{tag}",
        "FORKYARD_ENGINE_NETWORK_HOSTS": str(hosts),
    }
    engine = EngineProcess(work / "engine", env=env)
    probe = work / "probe"
    compiler = "musl-gcc" if shutil.which("musl-gcc") else "gcc"
    subprocess.run([compiler, "-static", "-O2", "-o", str(probe), str(ROOT / "tests" / "probe" / "probe.c")], check=True)
    report: dict[str, Any] = conditions(samples=args.samples, connections=args.connections, mib=args.mib)
    try:
        with serving(work) as server:
            hosts.write_text(f"{server.address} {NAME}\n")
            engine.start()
            with engine.client() as client:
                client.call("templates.build_base", name="base")
            print(f"create to first command, {args.samples} of each...", flush=True)
            report["create"] = create_to_first_command(engine, server, args.samples)
            print(f"connections ({args.connections}) and throughput ({args.mib} MiB)...", flush=True)
            report["traffic"] = traffic(engine, server, probe, args.connections, args.mib)
            print(f"{args.alive} alive under a policy, then a policy change for all...", flush=True)
            report["alive"] = alive_with_policies(engine, server, args.alive)
            print(f"the leak loop, {args.cycles} cycles under a policy...", flush=True)
            report["cycles"] = measure(engine, args.cycles, clients=4, warmup=40, network=policies(server)["address"])
    finally:
        engine.reclaim()
        subprocess.run(["nft", "delete", "table", "inet", env["FORKYARD_ENGINE_NETWORK_TABLE"]], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    conclude(report)
    create, alive, cycles = report["create"], report["alive"], report["cycles"]
    report["goals"] = GOALS
    report["goals_met"] = {
        # Met only if met in both positions.
        "an_address_policy_adds_under_5ms_to_create_p50": max(
            create["address_adds_p50_ms"], create["address_after_policed_adds_p50_ms"]
        )
        < GOALS["policy_adds_to_create_p50_ms"],
        "a_name_policy_adds_under_5ms_to_create_p50": max(create["name_adds_p50_ms"], create["name_after_policed_adds_p50_ms"])
        < GOALS["policy_adds_to_create_p50_ms"],
        f"{args.alive}_alive_with_policies": alive["count"] >= GOALS["alive_with_policies"]
        and alive["left_after_teardown"] == {"devices": 0, "rules": 0},
        f"a_policy_change_under_{args.alive}_applies_within_1s": alive["policy_change_s"] < GOALS["policy_change_s"],
        f"nothing_left_after_{args.cycles}_cycles_with_a_policy": cycles["loop"]["cycles"] >= GOALS["cycles_with_a_policy"]
        and not cycles["grown"]
        and cycles["create_failed"] == 0,
    }
    p50s = ", ".join(f"{kind} {create[kind]['p50']}" for kind in ("none", "address", "name"))
    print(f"create to first command p50 (ms): {p50s}")
    print(f"traffic: {report['traffic']}")
    print(
        f"alive: {alive['count']} ready at {alive['ready_per_second']}/s, policy change for all in {alive['policy_change_s']} s"
    )
    print(f"cycles: {cycles['loop']}, grown: {cycles['grown']}")
    print("goals: " + ", ".join(f"{name} {'met' if met else 'NOT met'}" for name, met in report["goals_met"].items()))
    write_report(f"network{'-quick' if args.quick else ''}-latest.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
