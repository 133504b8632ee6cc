"""docs/benchmarks.md's tables, written from the results the benchmarks keep in bench/results/.

    .venv/bin/python bench/report.py [engine|leak|api|snapshot|board|console|hosts|template|desktop ...]

Reads each script's latest full run (``<name>-latest.json``, committed) and
prints its tables as Markdown, with when it ran and what else ran on the
machine meanwhile.  The figures in the doc are pasted from here, never typed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine_bench import RESULTS, RUNTIMES, ratio, rows  # noqa: E402


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}-latest.json"
    return json.loads(path.read_text()) if path.exists() else None


def number(value: Any, places: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.{places}f}"
    if isinstance(value, list):
        return " / ".join(number(part, places) for part in value)
    return str(value)


def table(header: list[str], body: Iterable[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in body]
    return "\n".join(lines)


def others(report: dict[str, Any]) -> str:
    """What else ran, in a few words: the other test sessions and benchmarks at the start and the end."""
    seen = []
    for moment in ("others_at_start", "others_at_end"):
        for line in report.get(moment, []):
            if "pytest" in line and not line.startswith("timeout"):
                words = line.split("pytest", 1)[1].split()
                targets = " ".join(word for word in words if word.startswith("tests"))
                seen.append(f"pytest {targets}".strip())
            elif "bench/" in line:
                seen.append(line.split("bench/", 1)[1].split()[0])
    unique = list(dict.fromkeys(seen))
    return "; ".join(f"`{item}`" for item in unique) if unique else "no other test session or benchmark"


def provenance(report: dict[str, Any], name: str) -> str:
    load_start = report.get("load_average_at_start", [None])[0]
    load_end = report.get("load_average_at_end", [None])[0]
    machine = report.get("machine", {})
    return (
        f"`bench/results/{name}-latest.json`: {report.get('started_at', '?')}, {machine.get('cpus')} vCPU "
        f"{machine.get('cpu_model', '')}, {machine.get('memory_gib')} GiB, cgroup {machine.get('cgroups')}, "
        f"Linux {machine.get('kernel')}; load average {number(load_start, 2)} at the start, "
        f"{number(load_end, 2)} at the end; also running: {others(report)}."
    )


def goals(met: dict[str, bool]) -> str:
    return table(
        ["goal (PRODUCT.md)", "status"], [[name.replace("_", " "), "met" if ok else "**not met**"] for name, ok in met.items()]
    )


def engine() -> str:
    report = load("engine")
    if report is None:
        return "(no engine results)"
    body = []
    for label, values, higher in rows(report):
        places = 2 if "(ms)" in label else 1
        body.append(
            [label]
            + [number(values[name], places) for name in RUNTIMES]
            + [ratio(values["podman"], values["forkyard"], higher), ratio(values["bwrap"], values["forkyard"], higher)]
        )
    ours = report["forkyard"]
    warm = ours["warm_pool_first_command_ms"]
    cpu = ours["fleet"]["cpu_ms_per_create"]
    memory = ours["fleet"]["idle_memory_breakdown_kib"]
    return "\n\n".join(
        [
            provenance(report, "engine"),
            table(["measure", "forkyard", "podman (runc)", "bwrap", "forkyard vs podman", "forkyard vs bwrap"], body),
            f"forkyard only: create to first command through a warm pool, p50 {number(warm['p50'], 2)} ms, "
            f"p95 {number(warm['p95'], 2)} ms ({warm['claims']} claims, {warm['misses']} misses).",
            table(
                [
                    "CPU per create while the fleet was made (ms)",
                    "engine",
                    "spawner",
                    "zygote",
                    "sandbox's own setup",
                    "our total",
                    "whole machine",
                ],
                [["forkyard", *(number(cpu[key], 2) for key in ("engine", "spawner", "zygote", "sandbox", "total", "machine"))]],
            ),
            table(
                [
                    "kernel and init memory per idle sandbox (KiB)",
                    "SUnreclaim",
                    "PageTables",
                    "KernelStack",
                    "Percpu",
                    "inits' PSS",
                    "total",
                ],
                [
                    [
                        f"forkyard, {report['fleet']} alive",
                        *(
                            number(memory[key])
                            for key in ("SUnreclaim", "PageTables", "KernelStack", "Percpu", "processes_pss", "total")
                        ),
                    ]
                ],
            ),
            goals(report["goals_met"]),
        ]
    )


LEAK_ROWS = [
    ("live sandboxes (the engine's record)", "live_sandboxes"),
    ("processes in the engine's cgroups", "sandbox_processes"),
    ("namespaces those processes hold", "namespaces"),
    ("processes running as a sandbox uid, whole host", "sandbox_uid_processes"),
    ("user namespaces referred to on the host", "host_user_namespaces"),
    ("network namespaces referred to on the host", "host_net_namespaces"),
    ("zombies (engine, spawner, reaper, sandboxes)", "zombies"),
    ("mounts under the engine's state directory", "our_mounts"),
    ("the engine's cgroups", "cgroups"),
    ("sandbox control sockets", "sockets"),
    ("engine file descriptors / sockets", ("engine_fds", "engine_sockets")),
    ("spawner file descriptors / sockets", ("spawner_fds", "spawner_sockets")),
    ("engine threads", "engine_threads"),
    ("state directory: files / bytes (record and logs aside)", ("state_files", "state_bytes")),
    ("nftables ruleset lines", "firewall_rules"),
    ("disks (btrfs subvolumes) / the disk pool's quota groups", ("disks", "disk_quota_groups")),
    ("kernel unreclaimable slab (KiB)", "slab_unreclaimable_kib"),
    ("reported only: the engine's record (bytes) / tombstones", ("record_bytes", "tombstones")),
    ("reported only: engine / spawner resident memory (KiB)", ("engine_rss_kib", "spawner_rss_kib")),
    ("reported only: the host's memory cgroups (dying included)", "memory_cgroups"),
]


def leak() -> str:
    report = load("leak")
    if report is None:
        return "(no leak results)"
    before, after = report["before"], report["after"]

    def show(census: dict[str, Any], key: str | tuple[str, str]) -> str:
        return " / ".join(number(census.get(part)) for part in key) if isinstance(key, tuple) else number(census.get(key))

    loop = report["loop"]
    return "\n\n".join(
        [
            provenance(report, "leak"),
            f"{number(loop['cycles'])} cycles over {loop['clients']} clients in {number(loop['seconds'])} s "
            f"({number(loop['cycles_per_second'])} a second, a cycle's p50 {number(loop['cycle_ms']['p50'])} ms), "
            f"after a warm-up of {number(report['warmup']['cycles'])}; failed creates: {report['create_failed']}.",
            table(
                ["after the warm-up, settled", "before", "after"],
                [[label, show(before, key), show(after, key)] for label, key in LEAK_ROWS],
            ),
            f"Grown: {report['grown'] or 'nothing'}. Unreclaimable slab {report['slab_change_pct']:+.2f} % "
            f"(tolerance {report['slab_tolerance_pct']:g} %). The record grew {number(report['record_bytes_per_cycle'])} bytes a cycle "
            f"({number(report['tombstones_added'])} tombstones, kept for a day by design); logs {number(report['log_bytes_per_cycle'])} bytes a cycle.",
            goals(report["goals_met"]),
        ]
    )


def api() -> str:
    runs = {backend: load(f"api-{backend}") for backend in ("embedded", "postgres")}
    present = {backend: report for backend, report in runs.items() if report is not None}
    if not present:
        return "(no API results)"

    def value(report: dict[str, Any], path: tuple[Any, ...]) -> Any:
        """The figure at ``path``; a tuple as the last step: those figures, shown as "a / b"."""
        found: Any = report
        for key in path:
            if isinstance(key, tuple):
                parts = [found.get(part) if isinstance(found, dict) else None for part in key]
                return None if None in parts else parts
            found = found.get(key) if isinstance(found, dict) else None
        return found

    measures: list[tuple[str, tuple[Any, ...], int]] = [
        ("create to first exec, p50, HTTP (ms)", ("http", "create_to_exec_ms", "p50"), 1),
        ("create to first exec, p95, HTTP (ms)", ("http", "create_to_exec_ms", "p95"), 1),
        ("create to first exec, p50, SDK (ms)", ("sdk", "create_to_exec_ms", "p50"), 1),
        ("exec of `true`, p50, HTTP (ms)", ("http", "exec_ms", "p50"), 1),
        ("exec of `true`, p95, HTTP (ms)", ("http", "exec_ms", "p95"), 1),
        ("exec of `true`, p50, SDK (ms)", ("sdk", "exec_ms", "p50"), 1),
        ("web server (uvicorn) CPU per exec (ms)", ("http", "cpu_ms_per_exec", "web"), 2),
        ("engine CPU per exec (ms)", ("http", "cpu_ms_per_exec", "engine"), 2),
    ]
    for way, prefix in (("straight to the host (the SDK's way)", "direct_"), ("through the web server", "")):
        for mode, name in (("exec", "exec of `true`"), ("read", "file read (small)"), ("write", "file write (small)")):
            key = f"{prefix}{mode}"
            measures += [
                (f"throughput {way}, 32 connections, 64 sandboxes: {name}, per second", ("throughput", key, "per_second"), 1),
                (f"  {name}: p50 / p99 at that load (ms)", ("throughput", key, "latency_ms", ("p50", "p99")), 1),
                (
                    f"  {name}: web server / engine CPU per request (ms)",
                    ("throughput", key, "cpu_ms_per_request", ("web", "engine")),
                    2,
                ),
            ]
    measures += [
        (
            "the engine alone, same run, same sandboxes, 32 clients: exec of `true` per second",
            ("throughput", "engine_exec", "per_second"),
            1,
        ),
        ("  its p50 (ms)", ("throughput", "engine_exec", "latency_ms", "p50"), 1),
    ]
    for key, name in (("launch", "launch of 1,000 from the template"), ("fork_launch", "launch of 1,000 forks of a snapshot")):
        measures += [
            (f"{name}: all running, as the API shows (s)", (key, "all_running_s"), 2),
            (f"{name}: all answered an exec (s)", (key, "exec_ready_s"), 2),
            (f"{name}: worker CPU per sandbox (ms)", (key, "cpu_ms_per_sandbox", "worker"), 2),
            (f"{name}: web server CPU per sandbox (ms)", (key, "cpu_ms_per_sandbox", "web"), 2),
            (f"{name}: engine CPU per sandbox (ms)", (key, "cpu_ms_per_sandbox", "engine"), 2),
            (f"{name}: the machine's CPU per sandbox, all of it (ms)", (key, "cpu_ms_per_sandbox", "machine"), 2),
            (
                "  of it spawner / zygote / the sandbox's init (ms)",
                (key, "cpu_ms_per_sandbox", ("spawner", "zygote", "sandbox")),
                2,
            ),
            (
                "  of it the benchmark's client (the trainer) / the rest: database, kernel threads (ms)",
                (key, "cpu_ms_per_sandbox", ("client", "other")),
                2,
            ),
            (f"{name}: then execs across them, 8 clients, per second", (key, "execs_across", "execs_per_second"), 1),
            (f"{name}: their p50 at that load (ms)", (key, "execs_across", "exec_ms", "p50"), 1),
            (f"{name}: torn down (s)", (key, "teardown_s"), 2),
            (f"{name}: a snapshot asked for right behind its teardown, ready in (s)", (key, "snapshot_behind_the_teardown_s"), 2),
        ]
    measures += [
        ("the engine alone, same run: 1,000 made ready by 8 clients, per second", ("engine_same_run", "ready_per_second"), 1),
        (
            "the engine alone, same run: the machine's CPU per sandbox made ready, all of it (ms)",
            ("engine_same_run", "machine_cpu_ms_per_ready"),
            2,
        ),
        (
            "  of it engine / spawner / zygote / the sandbox's init (ms)",
            ("engine_same_run", "cpu_ms_per_create", ("engine", "spawner", "zygote", "sandbox")),
            2,
        ),
        ("the engine alone, same run: 1,000 destroyed by 8 clients, per second", ("engine_same_run", "destroys_per_second"), 1),
        ("API's share of the engine's rate: creates", ("share_of_engine_rate", "creates"), 2),
        ("API's share of the engine's rate: destroys", ("share_of_engine_rate", "destroys"), 2),
        ("API's share of the engine's rate: execs, straight to the host", ("share_of_engine_rate", "execs"), 2),
        (
            "API's share of the engine's rate: execs, through the web server",
            ("share_of_engine_rate", "execs_through_the_web_server"),
            2,
        ),
    ]
    names = {"embedded": "embedded (SQLite, filesystem broker)", "postgres": "PostgreSQL + Redis"}
    parts = [provenance(report, f"api-{backend}") for backend, report in present.items()]
    parts.append(
        table(
            ["measure", *(names[backend] for backend in present)],
            [[label, *(number(value(report, path), places) for report in present.values())] for label, path, places in measures],
        )
    )
    parts += [f"{names[backend]}:\n\n" + goals(report["goals_met"]) for backend, report in present.items()]
    return "\n\n".join(parts)


def snapshot() -> str:
    report = load("snapshot")
    if report is None:
        return "(no snapshot results)"
    ours, peer = report["forkyard"], report.get("podman") or {}
    fork_peer = peer.get("fork_to_exec_ms") or {}
    body = [
        ["fork 1,000 to exec-ready (service answering), cold (s)", number(ours["fork_1000_cold_s"], 2), "-", "-"],
        ["fork 1,000 to exec-ready, from a warm pool of the snapshot (s)", number(ours["fork_1000_pool_s"], 2), "-", "-"],
        ["(filling that pool of 1,000 beforehand, s)", number(ours["pool_fill_s"], 2), "-", "-"],
        [
            "single fork to first command, p50, cold (ms)",
            number(ours["single_fork_ms"]["p50"]),
            number(fork_peer.get("p50")),
            ratio(fork_peer.get("p50"), ours["single_fork_ms"]["p50"], False),
        ],
        [
            "single fork to first command, p95, cold (ms)",
            number(ours["single_fork_ms"]["p95"]),
            number(fork_peer.get("p95")),
            ratio(fork_peer.get("p95"), ours["single_fork_ms"]["p95"], False),
        ],
        ["single fork to first command, p50, pooled (ms)", number(ours["single_pooled_fork_ms"]["p50"]), "-", "-"],
        [
            "snapshot of 1 GiB of changed files, idle: total (s)",
            number(ours["snapshot_1gib_idle"]["seconds"], 2),
            number(peer.get("commit_1gib_s"), 2),
            ratio(peer.get("commit_1gib_s"), ours["snapshot_1gib_idle"]["seconds"], False),
        ],
        [
            "snapshot of 1 GiB, idle: sandbox frozen (ms)",
            number(ours["snapshot_1gib_idle"]["paused_ms"]),
            "the whole commit",
            "-",
        ],
        ["snapshot of 1 GiB while a process writes: total (s)", number(ours["snapshot_1gib_busy"]["seconds"], 2), "-", "-"],
        [
            "snapshot of 1 GiB while writing: frozen (ms)",
            f"{number(ours['snapshot_1gib_busy']['paused_ms'])} ({number(ours['snapshot_1gib_busy']['recopied_while_frozen_bytes'])} bytes re-copied frozen)",
            "-",
            "-",
        ],
        ["building the environment from scratch, per sandbox, p50 (ms)", number(ours["scratch_ms"]["p50"]), "-", "-"],
        [
            f"building it in 1,000 sandboxes (s, projected from {ours['scratch_measured']['sandboxes']})",
            number(ours["scratch_1000_projected_s"]),
            "-",
            "-",
        ],
    ]
    return "\n\n".join(
        [
            provenance(report, "snapshot"),
            table(["measure", "forkyard", "podman", "forkyard vs podman"], body),
            goals(
                {f"1000 forks exec-ready within 3 s ({kind}, in the engine)": met for kind, met in report["goals_met"].items()}
            ),
        ]
    )


def board() -> str:
    runs = [(name, load(name)) for name in ("board-embedded-1000", "board-postgres-1000", "board-embedded-simulated1000-32752")]
    present = [(name, report) for name, report in runs if report is not None]
    if not present:
        return "(no board results)"
    body = []
    for name, report in present:
        lag, split = report.get("lag_ms", {}), report.get("lag_split_ms", {})
        body.append(
            [
                name.removeprefix("board-"),
                number(report["count"]),
                number(report["launch_seconds"]),
                number(report["messages_per_second"]),
                number(report["bytes_per_second"], 0),
                number(lag.get("p50"), 0),
                number(lag.get("p95"), 0),
                number(lag.get("max"), 0),
                f"{number(split.get('ready_to_recorded', {}).get('p50'), 0)} / {number(split.get('ready_to_recorded', {}).get('p95'), 0)}",
                f"{number(split.get('recorded_to_pixel', {}).get('p50'), 0)} / {number(split.get('recorded_to_pixel', {}).get('p95'), 0)}",
                "met" if report["goal_lag_under_1s_met"] else "**not met**",
            ]
        )
    header = [
        "run",
        "pixels",
        "launch (s)",
        "frames/s",
        "bytes/s",
        "lag p50 (ms)",
        "lag p95 (ms)",
        "lag max (ms)",
        "ready -> written p50 / p95 (ms)",
        "written -> pixel p50 / p95 (ms)",
        "p95 under 1 s",
    ]
    return "\n\n".join([*(provenance(report, name) for name, report in present), table(header, body)])


def console() -> str:
    runs = [(backend, load(f"console-{backend}-32752")) for backend in ("embedded", "postgres")]
    present = [(backend, report) for backend, report in runs if report is not None]
    if not present:
        return "(no console results)"
    pages = list(present[0][1]["pages"])
    body = [
        [
            page,
            *(f"{number(report['pages'][page]['p50'], 0)} / {number(report['pages'][page]['p95'], 0)}" for _, report in present),
        ]
        for page in pages
    ]
    verdicts = [
        f"{backend}: goal (every page p95 under {report['goal_p95_under_ms']:g} ms) {'met' if report['goal_met'] else '**not met**'}"
        for backend, report in present
    ]
    return "\n\n".join(
        [
            *(provenance(report, f"console-{backend}-32752") for backend, report in present),
            table(["page", *(f"{backend} p50 / p95 (ms)" for backend, _ in present)], body),
            "; ".join(verdicts) + ".",
        ]
    )


def inference() -> str:
    parts = []
    for backend in ("embedded", "postgres"):
        report = load(f"inference-{backend}")
        if report is None:
            continue
        over, grades, ready = report["overhead"], report["grades"], report["time_to_ready"]
        parts.append(provenance(report, f"inference-{backend}"))
        parts.append(
            table(
                ["measure", "p50", "p95", "n"],
                [
                    [
                        "one-token completion, direct to the model server (ms)",
                        number(over["direct_ms"]["p50"], 2),
                        number(over["direct_ms"]["p95"], 2),
                        over["samples"],
                    ],
                    [
                        "the same through the gateway (ms)",
                        number(over["gateway_ms"]["p50"], 2),
                        number(over["gateway_ms"]["p95"], 2),
                        over["samples"],
                    ],
                    [
                        "gateway overhead, each pair (ms)",
                        number(over["overhead_of_pairs_ms"]["p50"], 2),
                        number(over["overhead_of_pairs_ms"]["p95"], 2),
                        over["samples"],
                    ],
                    [
                        "dedicated endpoint, create to ready (ms)",
                        number(ready["ms"]["p50"], 0),
                        number(ready["ms"]["p95"], 0),
                        ready["samples"],
                    ],
                    [
                        "a grade's item, its latency in a batch (ms)",
                        number(grades["item_latency_ms"]["p50"], 1),
                        number(grades["item_latency_ms"]["p95"], 1),
                        grades["items"],
                    ],
                ],
            )
        )
        parts.append(
            f"Overhead at p50 (difference of the medians): {number(over['overhead_p50_ms'], 2)} ms. "
            f"A batch of {grades['items']} grades: {number(grades['seconds'], 2)} s, {number(grades['grades_per_second'], 1)} grades/s "
            f"({number(grades['tokens_per_second'], 0)} output tokens/s)."
        )
        parts.append(goals(report["goals_met"]))
    return "\n\n".join(parts) or "(no run yet: bench/inference_bench.py)"


def board_lags(report: dict[str, Any]) -> dict[str, Any]:
    """A multi-engine run's board lag (``--board``); empty for a run without."""
    return dict((report.get("board") or {}).get("lag_ms") or {})


def hosts() -> str:
    """Every kept multi-engine run (``hosts-<backend>-<engines>x<count>-latest.json``), smallest first."""
    present = []
    for path in sorted(RESULTS.glob("hosts-*-latest.json")):
        name = path.name.removesuffix("-latest.json")
        report = load(name)
        if report is not None and not report.get("quick"):
            present.append((name, report))
    if not present:
        return "(no multi-engine results yet: bench/hosts_bench.py)"
    present.sort(key=lambda item: (item[1]["count"], item[1]["engines"]))
    body = []
    for name, report in present:
        spread = report.get("spread", {})
        body.append(
            [
                name.removeprefix("hosts-"),
                number(report["count"]),
                number(report["engines"]),
                number(report.get("overcommit")),
                f"{number(spread.get('min'))} - {number(spread.get('max'))}",
                number(report.get("all_running_s"), 2),
                number(report.get("rate_per_s")),
                " / ".join(number(value, 1) for value in report.get("last_ready_s_by_host", {}).values()),
                number(report.get("teardown_api_stopped_s"), 2),
                number(report.get("teardown_engines_empty_s"), 2),
                number((report.get("progress") or {}).get("failed")),
                " / ".join(number(lags.get(part), 0) for part in ("p50", "p95")) if (lags := board_lags(report)) else "-",
            ]
        )
    header = [
        "run",
        "sandboxes",
        "engines",
        "overcommit",
        "share per host (min - max)",
        "all running (s)",
        "started/s",
        "each host's last ready (s)",
        "API says stopped (s)",
        "engines empty (s)",
        "failed",
        "board lag p50 / p95 (ms)",
    ]
    return "\n\n".join([*(provenance(report, name) for name, report in present), table(header, body)])


def _cpu_cells(seconds: float, whole: float) -> list[str]:
    return [number(seconds), f"{100 * seconds / whole:.1f} %" if whole else "-"]


def hosts_cpu() -> str:
    """Where each kept multi-engine run's CPU went, by kind of process and phase (``cpu_s``: bench/cpu_census.py)."""
    parts = []
    for path in sorted(RESULTS.glob("hosts-*-latest.json")):
        name = path.name.removesuffix("-latest.json")
        report = load(name)
        if report is None or report.get("quick") or not report.get("cpu_s"):
            continue
        phases = {phase: report["cpu_s"][phase] for phase in ("launch", "teardown") if phase in report["cpu_s"]}
        kinds = list(dict.fromkeys(kind for phase in phases.values() for kind in phase["by_kind"]))
        # The machine's every field together is the phase's time on every core: the whole it is a share of.
        wholes = {phase: sum(spent["machine"].values()) for phase, spent in phases.items()}
        body = []
        for kind in kinds:
            row: list[Any] = [kind]
            for phase, spent in phases.items():
                row += _cpu_cells(spent["by_kind"].get(kind, 0.0), wholes[phase])
            body.append(row)
        for label, fields in (("the machine: user + system", ("user", "system")), ("the machine: idle", ("idle",))):
            row = [label]
            for phase, spent in phases.items():
                row += _cpu_cells(sum(spent["machine"].get(field, 0.0) for field in fields), wholes[phase])
            body.append(row)
        body.append(
            ["the phase, on every core", *(cell for phase in phases for cell in _cpu_cells(wholes[phase], wholes[phase]))]
        )
        header = ["process", *(f"{phase} {what}" for phase in phases for what in ("(CPU s)", "(of the machine)"))]
        parts += [provenance(report, name), table(header, body)]
    return "\n\n".join(parts) if parts else "(no multi-engine run with a CPU census yet: bench/hosts_bench.py)"


def pid1() -> str:
    """The machine's PID 1's CPU as idle sandboxes grow in number (bench/pid1_bench.py)."""
    report = load("pid1")
    if report is None:
        return "(no PID 1 results yet: bench/pid1_bench.py)"
    body = [
        [number(row["sandboxes"]), number(row["processes"]), f"{100 * row['pid1_core_share']:.1f} %"] for row in report["rows"]
    ]
    header = ["idle sandboxes", "processes on the machine", f"PID 1 ({report.get('pid1', '?')}): share of one core"]
    return provenance(report, "pid1") + "\n\n" + table(header, body)


def network() -> str:
    report = load("network")
    if report is None:
        return "(no network results)"
    create, traffic, alive, cycles = report["create"], report["traffic"], report["alive"], report["cycles"]
    rows_ = [
        [
            "create to first command, p50 / p95 (ms)"
            + (", right after an unpoliced sandbox" if "address_after_policed" in create else ""),
            *(number([create[kind]["p50"], create[kind]["p95"]], 2) for kind in ("none", "address", "name")),
        ],
        [
            "what the policy adds to the p50 (ms)",
            "-",
            number(create["address_adds_p50_ms"], 2),
            number(create["name_adds_p50_ms"], 2),
        ],
        *(
            [
                [
                    "the same, right after a policed sandbox was destroyed: p50 / p95 (ms)",
                    "-",
                    *(
                        number([create[f"{kind}_after_policed"]["p50"], create[f"{kind}_after_policed"]["p95"]], 2)
                        for kind in ("address", "name")
                    ),
                ],
                [
                    "what the policy adds to the p50 then (ms)",
                    "-",
                    number(create["address_after_policed_adds_p50_ms"], 2),
                    number(create["name_after_policed_adds_p50_ms"], 2),
                ],
            ]
            if "address_after_policed" in create
            else []
        ),
        [
            "exec of `true`, p50 (ms)",
            number(create["exec_ms"]["none"]["p50"], 2),
            number(create["exec_ms"]["address"]["p50"], 2),
            "-",
        ],
    ]
    connects = [
        [
            "connections a second, one after the other",
            number(traffic["connect_host"]["per_second"]),
            number(traffic["connect_address_rule"]["per_second"]),
            number(traffic["connect_name_rule_via_proxy"]["per_second"]),
        ],
        [
            f"throughput, {traffic['mib']} MiB on one connection (MiB/s)",
            number(traffic["throughput_host"]["mib_per_second"]),
            number(traffic["throughput_address_rule"]["mib_per_second"]),
            number((traffic.get("throughput_name_rule_via_proxy") or {}).get("mib_per_second")),
        ],
    ]
    loop = cycles["loop"]
    return "\n\n".join(
        [
            provenance(report, "network"),
            table(["measure", "no policy", "an address rule", "a name rule (443 and 80, through the proxy)"], rows_),
            table(["measure", "from the host", "a sandbox, address rule", "a sandbox, name rule (proxy: TLS on 443 to connect, HTTP on 80 to send)"], connects),
            f"{number(alive['count'])} sandboxes under a policy at once: made ready at {number(alive['ready_per_second'])} a second "
            f"by 8 clients; host memory per idle sandbox {number(alive['idle_memory_kib'])} KiB; a policy change for all of them "
            f"(`network.set_many`, what a policy's PUT sends a host) answered in {number(alive['policy_change_s'], 3)} s; "
            f"torn down in {number(alive['teardown_s'])} s, leaving {alive['left_after_teardown']['devices']} devices and "
            f"{alive['left_after_teardown']['rules']} rules.",
            f"The leak loop under a policy: {number(loop['cycles'])} cycles over {loop['clients']} clients in "
            f"{number(loop['seconds'])} s; grown: {cycles['grown'] or 'nothing'}; unreclaimable slab "
            f"{cycles['slab_change_pct']:+.2f} %; failed creates {cycles['create_failed']}.",
            goals(report["goals_met"]),
        ]
    )


def scale(name: str = "scale") -> str:
    report = load(name)
    if report is None:
        return f"(no {name} results)"
    parts = [provenance(report, name)]
    for mode, title in (
        ("own", "a memory cgroup each (the default)"),
        ("grouped", f"memory groups of {report.get('group_size')}"),
        ("grouped-cpu", f"memory groups of {report.get('group_size')}, the CPU quota the group's"),
    ):
        run = report.get(mode)
        if run is None:
            continue
        body = [
            [
                number(point["alive"]),
                number(point["creates_per_second"]),
                *(
                    number(point["kernel_and_inits_per_sandbox_kib"][key])
                    for key in ("SUnreclaim", "PageTables", "KernelStack", "Percpu", "inits_pss", "total")
                ),
                number(point["memory_cgroups"]),
                f"{point['sample_execs'] - point['sample_exec_failures']}/{point['sample_execs']}",
            ]
            for point in run["points"]
        ]
        parts.append(f"{title}:")
        parts.append(
            table(
                [
                    "alive",
                    "creates/s on the way",
                    "SUnreclaim",
                    "PageTables",
                    "KernelStack",
                    "Percpu",
                    "inits' PSS",
                    "total KiB per sandbox",
                    "memory cgroups",
                    "sample execs",
                ],
                body,
            )
        )
        teardown = run["teardown"]
        parts.append(
            (f"Stopped: {run['stopped']}. " if run["stopped"] else "")
            + f"Torn down: {number(teardown['count'])} in {number(teardown['seconds'])} s ({number(teardown['per_second'])} a second)."
        )
    if report.get("square_term"):
        parts.append(
            table(
                ["alive", "a memory cgroup each (KiB)", "memory groups (KiB)", "the square term's share (KiB)"],
                [
                    [number(row["alive"]), number(row["own_kib"]), number(row["grouped_kib"]), number(row["square_term_kib"])]
                    for row in report["square_term"]
                ],
            )
        )
    return "\n\n".join(parts)


def template() -> str:
    parts = []
    for backend in ("embedded", "postgres"):
        report = load(f"template-{backend}")
        if report is None:
            parts.append(f"(no template results for {backend})")
            continue
        ours, peer = report["forkyard"], report.get("podman") or {}
        body = [
            [
                "build of the 4-step environment with a service, cold (s)",
                number(ours["build_cold_s"], 2),
                number(peer.get("build_cold_s"), 2),
                ratio(peer.get("build_cold_s"), ours["build_cold_s"], False),
            ],
            [
                "rebuild of the same spec, cached (s)",
                number(ours["build_cached_s"], 3),
                number(peer.get("build_cached_s"), 3),
                ratio(peer.get("build_cached_s"), ours["build_cached_s"], False),
            ],
            [
                f"build whose last step changed ({ours['steps_reused_when_last_changed']} steps reused, s)",
                number(ours["build_last_step_changed_s"], 2),
                "-",
                "-",
            ],
            [
                "create to first command from the built template, p50 / p95 (ms)",
                number([ours["first_command_from_template_ms"]["p50"], ours["first_command_from_template_ms"]["p95"]]),
                "-",
                "-",
            ],
            [
                "the same from `base`, p50 / p95 (ms)",
                number([ours["first_command_from_base_ms"]["p50"], ours["first_command_from_base_ms"]["p95"]]),
                "-",
                "-",
            ],
        ]
        body += [[f"cold step: {name} (s)", number(seconds, 3), "-", "-"] for name, seconds in ours["steps_cold_s"].items()]
        for name, built in (report.get("shipped") or {}).items():
            podman = built.get("podman") or {}
            body += [
                [
                    f"shipped `{name}` from its spec, cold (s)",
                    number(built["build_cold_s"], 2),
                    number(podman.get("build_cold_s"), 2),
                    ratio(podman.get("build_cold_s"), built["build_cold_s"], False),
                ],
                [
                    f"shipped `{name}`, cached (s)",
                    number(built["build_cached_s"], 3),
                    number(podman.get("build_cached_s"), 3),
                    ratio(podman.get("build_cached_s"), built["build_cached_s"], False),
                ],
            ]
            body += [[f"`{name}` cold step: {step} (s)", number(seconds, 2), "-", "-"] for step, seconds in built["steps_cold_s"].items()]
        parts += [
            f"{backend}: " + provenance(report, f"template-{backend}"),
            table(["measure", "forkyard", "podman build", "forkyard vs podman"], body),
            goals(report["goals_met"]),
        ]
    return "\n\n".join(parts)


def desktop() -> str:
    parts = []
    for backend in ("embedded", "postgres"):
        report = load(f"desktop-{backend}")
        if report is None:
            parts.append(f"(no desktop results for {backend})")
            continue
        ours, peer = report["forkyard"], report.get("podman") or {}
        forked, cold, trips = ours["forked"], ours["cold"], ours["round_trips_ms"]
        peer_first = (peer.get("first_screenshot_ms") or {}).get("p50")
        body = [
            [
                "forked, not waiting: create to first screenshot, p50 / p95 (ms)",
                number([forked["first_screenshot_ms"]["p50"], forked["first_screenshot_ms"]["p95"]]),
                "-",
                "-",
            ],
            [
                "forked, waiting for the handover (the services it waits for: all but the browser), to first screenshot, p50 / p95 (ms)",
                number([forked["waited_first_screenshot_ms"]["p50"], forked["waited_first_screenshot_ms"]["p95"]]),
                "-",
                "-",
            ],
            [
                "of which the handover (services answering), p50 / p95 (ms)",
                number([forked["handover_ms"]["p50"], forked["handover_ms"]["p95"]]),
                "-",
                "-",
            ],
            [
                "cold: bare Debian, start Xvfb, first screenshot, p50 / p95 (ms)",
                number([cold["first_screenshot_ms"]["p50"], cold["first_screenshot_ms"]["p95"]]),
                number(peer_first),
                ratio(peer_first, cold["first_screenshot_ms"]["p50"], False),
            ],
        ]
        peer_trips = {"screenshot_png_full": "screenshot_png_full_ms", "move": "move_ms"}
        for name, times in trips.items():
            theirs = (peer.get(peer_trips.get(name, "")) or {}).get("p50")
            body.append(
                [
                    f"{name.replace('_', ' ')}, p50 / p95 (ms)",
                    number([times["p50"], times["p95"]]),
                    number(theirs),
                    ratio(theirs, times["p50"], False),
                ]
            )
        body += [
            ["build of the desktop template on the imported Debian, cold (s)", number(ours["build_cold_s"], 2), "-", "-"],
            ["rebuild of the same spec, cached (s)", number(ours["build_cached_s"], 3), "-", "-"],
        ]
        parts += [
            f"{backend}: " + provenance(report, f"desktop-{backend}"),
            table(["measure", "forkyard", "podman (exec per call)", "forkyard vs podman"], body),
            goals(report["goals_met"]),
        ]
    return "\n\n".join(parts)


def ports() -> str:
    parts = []
    for backend in ("embedded", "postgres"):
        report = load(f"ports-{backend}")
        if report is None:
            continue
        body = []
        for auth in ("public", "key"):
            run = report[auth]
            latency, cpu = run["latency_ms"], run["cpu_ms_per_request"]
            body.append(
                [
                    f"`{auth}`",
                    number(run["per_second"]),
                    number([latency["p50"], latency["p75"], latency["p90"]]),
                    number(cpu["web"], 2),
                    number(cpu["engine"], 2),
                ]
            )
        parts += [
            f"{backend}: " + provenance(report, f"ports-{backend}"),
            table(
                [
                    f"auth ({report['connections']} keep-alive connections, {report['seconds']} s)",
                    "requests a second",
                    "latency p50 / p75 / p90 (ms)",
                    "web server CPU a request (ms)",
                    "engine CPU a request (ms)",
                ],
                body,
            ),
        ]
    return "\n\n".join(parts) if parts else "(no ports results)"


SECTIONS: dict[str, Callable[[], str]] = {
    "engine": engine,
    "leak": leak,
    "api": api,
    "snapshot": snapshot,
    "board": board,
    "console": console,
    "hosts": hosts,
    "hosts-cpu": hosts_cpu,
    "pid1": pid1,
    "network": network,
    "ports": ports,
    "scale": scale,
    "scale-grouped": lambda: scale("scale-grouped"),
    # The same engine before and after sandboxes bound one shared sysfs (docs/benchmarks.md, Scale).
    "scale-sysfs": lambda: scale("scale-before-sysfs") + "\n\n" + scale("scale-sysfs-shared"),
    # Memory groups with a CPU quota each and with the group's, in both orders (docs/benchmarks.md, Scale).
    "scale-group-cpu": lambda: scale("scale-group-cpu-16k") + "\n\n" + scale("scale-group-cpu-16k-b"),
    "inference": inference,
    "template": template,
    "desktop": desktop,
}


def main() -> int:
    wanted = sys.argv[1:] or list(SECTIONS)
    unknown = [name for name in wanted if name not in SECTIONS]
    if unknown:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        print(f"no such section: {', '.join(unknown)}", file=sys.stderr)
        return 2
    for name in wanted:
        print(f"<!-- bench/report.py {name} -->\n")
        print(SECTIONS[name]())
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
