"""Where a benchmark's CPU went, by kind of process, phase by phase: what a run's load average cannot say.

    census = CpuCensus()
    census.start()
    ...                                   # the launch
    report["cpu_s"] = {"launch": census.phase()}
    ...                                   # the teardown
    report["cpu_s"]["teardown"] = census.phase()
    census.stop()

Every process on the machine but the sandboxes' is read every ``every_s``
seconds (``/proc/<pid>/stat``: the whole thread group's user and system time,
and its reaped children's), and the growth since the phase began is summed by
kind: the machine's PID 1, the engines, their spawners and zygotes, the hosts'
bulk and interactive workers, the web server, the board's Daphne, kernel
threads, the rest. A sandbox's own CPU (its init's setup of its root, then
its own work; not the commands it ran) is read once, at the end of a phase,
from every sandbox init alive then (``schedstat``): reading tens of
thousands of processes every second would load the machine it measures. A process that
starts and ends between two reads is missed (its parent counts it once it
reaps it, except the spawners: their children are the sandboxes), so each
figure is a floor, and what the machine spent beyond them all is shown as
such. The machine's own split (user, system, idle, softirq) comes from
``/proc/stat``.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")
SANDBOX_INIT = "forkyard-init"
MACHINE_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def process_stat(pid: int | str) -> tuple[str, int, int, int] | None:
    """(command name, start time, its own CPU ticks, its reaped children's) or None if it is gone."""
    try:
        raw = open(f"/proc/{pid}/stat", "rb").read()
    except OSError:
        return None
    name = raw[raw.index(b"(") + 1 : raw.rindex(b")")].decode(errors="replace")
    fields = raw[raw.rindex(b")") + 2 :].split()
    return name, int(fields[19]), int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])


def _in_a_sandbox(pid: int) -> bool:
    """A process in a pid namespace of its own: a sandbox's init, maybe still setting up (named after the
    zygote it was cloned from until it becomes init)."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            return any(line.startswith("NSpid:") and len(line.split()) > 2 for line in handle)
    except OSError:
        return False


def _kind(pid: int, name: str) -> str:
    if pid == 1:
        return f"the machine's PID 1 ({name})"
    try:
        command = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        command = ""
    if not command:
        return "kernel threads"
    for needle, kind in (
        ("sandboxes.engine.spawner", "spawners"),
        ("forkyard-zygote", "zygotes"),
        ("forkyard-engine", "engines"),
        ("sandboxes.engine", "engines"),
        ("interactive", "interactive workers"),
        ("celery", "bulk workers"),
        ("uvicorn", "web server"),
        ("daphne", "board (Daphne)"),
        ("bench/", "the benchmark's client"),
    ):
        if needle in command or needle == name:
            return kind
    return "other processes"


def _machine() -> list[int]:
    with open("/proc/stat") as handle:
        return [int(value) for value in handle.readline().split()[1 : 1 + len(MACHINE_FIELDS)]]


class CpuCensus:
    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s = every_s
        self.known: dict[int, tuple[int, str]] = {}  # pid -> (start time, kind); sandboxes' inits as SANDBOX_INIT
        self.last: dict[tuple[int, int], int] = {}  # (pid, start time) -> ticks at the last read
        self.grown: dict[str, int] = defaultdict(int)  # kind -> ticks this phase
        self.sandboxes_before = 0  # the sandboxes' inits' ticks at the phase's start
        self.machine = _machine()
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cpu-census", daemon=True)

    def start(self) -> None:
        self._read()
        with self.lock:
            self.grown.clear()
        self.sandboxes_before = self._sandboxes()
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.done.wait(self.every_s):
            self._read()

    def _read(self) -> None:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            known = self.known.get(pid)
            if known is not None and known[1] == SANDBOX_INIT:
                continue
            stat = process_stat(pid)
            if stat is None:
                continue
            name, started, own, children = stat
            if known is None or known[0] != started:
                kind = SANDBOX_INIT if name == SANDBOX_INIT or _in_a_sandbox(pid) else _kind(pid, name)
                self.known[pid] = known = (started, kind)
                if kind == SANDBOX_INIT:
                    continue
            # The spawners' children are the sandboxes' inits: what they used is counted as theirs (or, for
            # those that ended, not at all), never again in their parent's share once it reaps them.
            ticks = own if known[1] == "spawners" else own + children
            with self.lock:
                before = self.last.get((pid, started))
                # A process first seen now: all its time is this run's if it started after the census.
                self.grown[known[1]] += ticks - before if before is not None else (ticks if self.last else 0)
                self.last[(pid, started)] = ticks

    def _sandboxes(self) -> int:
        """The sandboxes' inits' CPU so far, in ticks: from ``/proc/<pid>/schedstat``, the scheduler's own
        nanoseconds (an init runs a millisecond or two, and the ticks of ``stat`` charge whole ticks to
        whoever runs when one falls: most inits show none)."""
        nanoseconds = 0
        for pid, (_, kind) in list(self.known.items()):
            if kind == SANDBOX_INIT:
                try:
                    with open(f"/proc/{pid}/schedstat") as handle:
                        nanoseconds += int(handle.read().split()[0])
                except (OSError, ValueError, IndexError):
                    pass
        return nanoseconds * TICK // 1_000_000_000

    def phase(self) -> dict[str, Any]:
        """CPU seconds by kind since the phase began (the census's start, or the last call); a new phase begins."""
        self._read()
        sandboxes = self._sandboxes()
        machine = _machine()
        with self.lock:
            grown, self.grown = dict(self.grown), defaultdict(int)
        grown["sandboxes (their inits: setup, then their own work)"] = max(0, sandboxes - self.sandboxes_before)
        self.sandboxes_before = sandboxes
        spent = {kind: round(ticks / TICK, 1) for kind, ticks in sorted(grown.items(), key=lambda item: -item[1]) if ticks}
        split = {
            field: round((after - before) / TICK, 1)
            for field, before, after in zip(MACHINE_FIELDS, self.machine, machine, strict=True)
        }
        self.machine = machine
        busy = sum(value for field, value in split.items() if field not in ("idle", "iowait", "steal"))
        # What no read caught: processes that started and ended between two reads, and the sandboxes that
        # ended in the phase (their own exit, the kernel's teardown of their namespaces, runs as theirs).
        spent["none of these (ended between reads: the sandboxes' own exit among them)"] = round(
            max(0.0, busy - sum(spent.values())), 1
        )
        return {"by_kind": spent, "machine": split}
