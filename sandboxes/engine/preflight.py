"""Host preflight: the kernel limits that break first at scale, what ``max_sandboxes`` needs of each, and
what a sandbox costs this host's kernel in memory.

At start (``Engine.start``, once recovery knows how many sandboxes it adopted)
the engine reads each limit below, computes what ``max_sandboxes`` sandboxes
need of it, and raises those it may (as root, writing ``/proc/sys``; never
lowering one: a value is written only when it is short, read back, and put
back if the kernel answered lower).  The limits it cannot raise (memory cgroup
ids, a ``threads-max`` the kernel caps by memory) or that failed are reported
with the exact command to run, in the engine's log and in ``info()``'s
``preflight`` section (``forkyard-engine info``; ``forkyard-engine preflight``
without a running engine).  The network limits (the neighbour table,
conntrack) are checked only once sandboxes have networks here: at start if
any ever had one, else when the first one gets one.

What one sandbox takes of each limit is an allowance, not a measurement: an
idle sandbox is one process (its init) with its seven namespaces and one
memory cgroup; an allowance leaves room for what it runs.  Where the kernel
counts what is in use (tasks, open files, memory cgroups, conntrack entries)
the need is that count plus the allowance for the sandboxes still to come;
where it does not, a reserve for the host's own use plus the allowance for
every sandbox.  The per-user limits (the ``user.max_*_namespaces``, inotify's
instances and watches) are not the host's to share out: each sandbox's user
namespace is owned by a uid of its own (zygote.c), and the kernel counts
them per owner, so what one sandbox needs of them (one of each namespace) is
all any needs, however many there are; raising them would only let one
sandbox hold more.  ``fits`` is how many sandboxes the limits that bound a
sandbox's very existence allow (tasks, pids, namespaces, memory cgroup ids,
open files, the engine's uid ranges); the others (inotify, the engine's own
descriptors, the network's) are reported (the host-wide ones raised) but
bound only what sandboxes do, not how many there are.

One kernel serves every engine on the host: its limits are the host's, and
another engine's sandboxes count in what is in use.

``OverheadMeter`` measures the kernel's own memory per sandbox (unreclaimable
slab, page tables, kernel stacks, per-CPU: what no memory limit charges) from
this engine's fleet as it grows, for the control plane's admission.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import resource
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .config import EngineConfig

log = logging.getLogger("forkyard.engine.preflight")

PID_MAX_LIMIT = 4_194_304  # the kernel's ceiling for kernel.pid_max on 64-bit (and the customary value)
SYSCTL_MAX = 2**31 - 1  # an int sysctl
MEMORY_CGROUP_IDS = 65_535  # MEM_CGROUP_ID_MAX: a memory cgroup holds its id until it is freed, dying ones too
ENGINE_FILES = 8_192  # the engine's own descriptors apart from its sandboxes' (sockets, stores, watches)
KERNEL_MEMORY = ("SUnreclaim", "PageTables", "KernelStack", "Percpu")  # what no memory cgroup limit charges

# How a limit's value is read and written.
SYSCTL, FIXED, RLIMIT = "sysctl", "fixed", "rlimit"
# What became of a limit.
OK, RAISED, SHORT, ABSENT = "ok", "raised", "short", "absent"


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def tasks_in_use(proc: Path) -> int | None:
    """Every task on the host (threads included): the total of ``/proc/loadavg``'s ``running/total``."""
    try:
        return int((proc / "loadavg").read_text().split()[3].split("/")[1])
    except (OSError, ValueError, IndexError):
        return None


def files_in_use(proc: Path) -> int | None:
    """Open files on the host: the first figure of ``fs.file-nr``."""
    return _read_int(proc / "sys" / "fs" / "file-nr")


def memory_cgroups_in_use(proc: Path) -> int | None:
    """Memory cgroups that hold an id: ``/proc/cgroups``' count for the memory controller's hierarchy.

    The count falls only when a cgroup is freed, so dying cgroups (removed, but
    still pinned by the page cache they charged) are in it, as they are in the
    ids.  On cgroup v2 the row counts the whole unified hierarchy, an upper bound.
    """
    try:
        for line in (proc / "cgroups").read_text().splitlines():
            columns = line.split()
            if columns and columns[0] == "memory":
                return int(columns[2])
    except (OSError, ValueError, IndexError):
        return None
    return None


def conntrack_in_use(proc: Path) -> int | None:
    return _read_int(proc / "sys" / "net" / "netfilter" / "nf_conntrack_count")


@dataclass(frozen=True)
class Limit:
    """One limit: where it is, what a sandbox takes of it, and whether it bounds how many sandboxes fit."""

    name: str  # as sysctl names it (or a name of our own for the others)
    per_sandbox: float
    why: str  # what a sandbox takes of it, in a few words
    kind: str = SYSCTL
    reserve: int = 0  # what the host keeps for itself, when the kernel does not count what is in use
    in_use: Callable[[Path], int | None] | None = None
    caps: bool = True  # bounds how many sandboxes fit (else: what they do)
    per_user: bool = False  # counted per owner uid, and each sandbox has its own: one sandbox's need is all
    networks: bool = False  # only once sandboxes have networks here
    raisable: bool = True
    suggested: int = 0  # when raising: at least this
    maximum: int = SYSCTL_MAX  # the most the kernel takes
    fixed_value: int = 0  # a FIXED limit's value
    cannot_raise: str = ""  # why not, for one that is not raisable

    def path(self, proc: Path) -> Path:
        return proc / "sys" / self.name.replace(".", "/")


NAMESPACES = ("user", "pid", "mnt", "net", "ipc", "uts", "cgroup")

LIMITS: tuple[Limit, ...] = (
    Limit(
        "kernel.pid_max",
        2,
        "a pid for its init and one for a command",
        in_use=tasks_in_use,
        suggested=PID_MAX_LIMIT,
        maximum=PID_MAX_LIMIT,
    ),
    # Its default is sized by memory at boot (RAM / (8 x a task's stack)); a write may go past it.
    Limit("kernel.threads-max", 2, "a task for its init and one for a command", in_use=tasks_in_use, maximum=1 << 30),
    Limit(
        "memory cgroup ids",
        1,
        "one memory cgroup",
        kind=FIXED,
        in_use=memory_cgroups_in_use,
        raisable=False,
        fixed_value=MEMORY_CGROUP_IDS,
        cannot_raise="the kernel has 65,535 memory cgroup ids, dying cgroups included: fewer sandboxes per host",
    ),
    *(Limit(f"user.max_{namespace}_namespaces", 1, f"one {namespace} namespace", per_user=True) for namespace in NAMESPACES),
    Limit("fs.file-max", 16, "its init's descriptors and a command's pipes", in_use=files_in_use),
    Limit("fs.inotify.max_user_instances", 1, "an inotify instance", per_user=True, caps=False),
    Limit("fs.inotify.max_user_watches", 64, "64 inotify watches", per_user=True, caps=False),
    Limit(
        "fs.nr_open",
        2,
        "the ceiling of the engine's own descriptors (a background process's pidfd and pipe)",
        reserve=ENGINE_FILES,
        caps=False,
        maximum=1 << 30,
    ),
    Limit(
        "RLIMIT_NOFILE",
        2,
        "the engine's own descriptors (a background process's pidfd and pipe)",
        kind=RLIMIT,
        reserve=ENGINE_FILES,
        caps=False,
        cannot_raise="the engine raises its soft limit only: sandboxes inherit its hard one; set LimitNOFILE in its unit",
    ),
    # The neighbour table is one for every network namespace: each policed
    # sandbox adds an entry on the host's side of its link and one on its own.
    Limit("net.ipv4.neigh.default.gc_thresh3", 2, "two neighbour entries", reserve=1024, caps=False, networks=True),
    Limit("net.ipv4.neigh.default.gc_thresh2", 2, "two neighbour entries", reserve=512, caps=False, networks=True),
    Limit("net.ipv4.neigh.default.gc_thresh1", 2, "two neighbour entries", reserve=128, caps=False, networks=True),
    Limit(
        "net.netfilter.nf_conntrack_max",
        16,
        "16 tracked connections",
        in_use=conntrack_in_use,
        caps=False,
        networks=True,
    ),
)


@dataclass
class Finding:
    """One limit on this host, against what ``max_sandboxes`` needs of it."""

    name: str
    status: str  # ok, raised, short, absent
    value: int  # now
    need: int
    per_sandbox: float
    in_use: int | None  # as the kernel counts it (None: it does not)
    fits: int  # sandboxes this limit allows (those alive now included)
    caps: bool
    per_user: bool = False  # each sandbox is a user of its own: ``need`` is one sandbox's
    before: int | None = None  # the value found, when it was raised
    how: str = ""  # for a short one: what to set, or why it cannot be

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Report:
    max_sandboxes: int
    live: int
    networks: bool
    findings: list[Finding] = field(default_factory=list)

    @property
    def fits(self) -> int:
        """How many sandboxes this host's limits allow, at most ``max_sandboxes``."""
        return min([self.max_sandboxes, *(finding.fits for finding in self.findings if finding.caps)])

    @property
    def limiting(self) -> str:
        """The limit that bounds ``fits`` ("max_sandboxes" when none does)."""
        capping = [finding for finding in self.findings if finding.caps and finding.fits < self.max_sandboxes]
        return min(capping, key=lambda finding: finding.fits).name if capping else "max_sandboxes"

    @property
    def short(self) -> list[Finding]:
        return [finding for finding in self.findings if finding.status == SHORT]

    @property
    def raised(self) -> list[Finding]:
        return [finding for finding in self.findings if finding.status == RAISED]

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_sandboxes": self.max_sandboxes,
            "live": self.live,
            "networks": self.networks,
            "fits": self.fits,
            "limiting": self.limiting,
            "to_set": [finding.how for finding in self.short],
            "raised": [f"{finding.name}: {finding.before} -> {finding.value}" for finding in self.raised],
            "limits": [finding.to_dict() for finding in self.findings],
        }


def network_slots(pool: str) -> int:
    """How many sandboxes with a network the engine's pool holds (a /31 each)."""
    try:
        return int(ipaddress.ip_network(pool, strict=False).num_addresses // 2)
    except ValueError:
        return 0


def _current(limit: Limit, proc: Path) -> int | None:
    if limit.kind == FIXED:
        return limit.fixed_value
    if limit.kind == RLIMIT:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return int(soft if soft != resource.RLIM_INFINITY else SYSCTL_MAX)
    return _read_int(limit.path(proc))


def _assess(limit: Limit, value: int, config: EngineConfig, live: int) -> Finding:
    """What ``config.max_sandboxes`` sandboxes (``live`` of them alive now) need of ``limit``, against ``value``."""
    proc = config.proc_dir
    wanted = config.max_sandboxes
    if limit.networks:
        # Only sandboxes with a network take the network's limits, and the pool bounds how many have one.
        wanted = min(wanted, network_slots(config.network_pool))
        live = min(live, wanted)
    counted = limit.in_use(proc) if limit.in_use is not None else None
    if limit.per_user:
        # Each sandbox is a user of its own: what one needs, whatever their number.
        need = math.ceil(limit.per_sandbox)
        fits = wanted if value >= need else 0
    elif counted is not None:
        need = counted + int(limit.per_sandbox * max(0, wanted - live))
        fits = live + int(max(0, value - counted) // limit.per_sandbox)
    else:
        need = limit.reserve + int(limit.per_sandbox * wanted)
        fits = int(max(0, value - limit.reserve) // limit.per_sandbox)
    status = OK if value >= need else SHORT
    finding = Finding(limit.name, status, value, need, limit.per_sandbox, counted, fits, limit.caps, per_user=limit.per_user)
    if status == SHORT:
        finding.how = _how(limit, need, wanted)
    return finding


def _how(limit: Limit, need: int, wanted: int) -> str:
    """What an operator sets for a short limit (or why it cannot be), in one line."""
    if limit.per_user:
        reason = f"each sandbox, a user of its own, needs {need:,} ({limit.why})"
    else:
        reason = f"{wanted:,} sandboxes need {need:,} ({limit.why} each)"
    if limit.kind == SYSCTL and (limit.raisable or not limit.cannot_raise):
        target = min(limit.maximum, max(need, limit.suggested))
        return f"sysctl -w {limit.name}={target} (and in /etc/sysctl.d/ to keep it): {reason}"
    return f"{limit.name}: {reason}; {limit.cannot_raise}"


def check(
    config: EngineConfig, *, live: int = 0, networks: bool = False, uid_ranges: int = 0, limits: tuple[Limit, ...] = LIMITS
) -> Report:
    """Read every limit and compare it with what ``config.max_sandboxes`` needs (read only)."""
    wanted = config.max_sandboxes
    report = Report(max_sandboxes=wanted, live=live, networks=networks)
    for limit in limits:
        if limit.networks and not networks:
            continue
        value = _current(limit, config.proc_dir)
        if value is None:
            report.findings.append(Finding(limit.name, ABSENT, 0, 0, limit.per_sandbox, None, 0, False))
            continue
        report.findings.append(_assess(limit, value, config, live))
    if uid_ranges:
        # Not the kernel's: each sandbox needs a uid range of its own (uid_ranges.py).
        status = OK if uid_ranges >= wanted else SHORT
        finding = Finding("engine uid ranges", status, uid_ranges, wanted, 1, None, uid_ranges, True)
        if status == SHORT:
            finding.how = f"engine uid ranges: {wanted:,} sandboxes need {wanted:,}; lower FORKYARD_ENGINE_UID_BASE or uid_count"
        report.findings.append(finding)
    return report


def _write(limit: Limit, proc: Path, target: int) -> str:
    """Write a raised value; "" or why it could not be written."""
    if limit.kind == RLIMIT:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target if hard == resource.RLIM_INFINITY else min(target, hard), hard))
        return limit.cannot_raise  # its hard limit stays: sandboxes inherit it
    try:
        limit.path(proc).write_text(f"{target}\n")
    except OSError as error:
        return f"could not write it ({error.strerror})"
    return ""


def raise_short(report: Report, config: EngineConfig, limits: tuple[Limit, ...] = LIMITS) -> Report:
    """Raise every short limit that may be raised, to what is needed (never lower); the report after."""
    proc = config.proc_dir
    by_name = {limit.name: limit for limit in limits}
    findings = []
    for finding in report.findings:
        limit = by_name.get(finding.name)
        if finding.status != SHORT or limit is None or not limit.raisable:
            findings.append(finding)
            continue
        before = finding.value
        target = min(limit.maximum, max(finding.need, limit.suggested))
        failure = _write(limit, proc, target)
        after = _current(limit, proc)
        if after is not None and after < before and limit.kind == SYSCTL:
            limit.path(proc).write_text(f"{before}\n")  # the kernel took it lower: never lower a limit
            after = before
        now = _assess(limit, after if after is not None else before, config, report.live)
        now.before = before
        if now.status == OK:
            now.status = RAISED
        else:
            notes = [f"raised from {before:,} to {now.value:,}, still short"] if now.value > before else []
            if failure and failure not in now.how:
                notes.append(failure)
            elif not failure and now.value <= before:
                notes.append(f"the kernel kept {now.value:,}: {limit.cannot_raise or 'it would not take more'}")
            if notes:
                now.how = f"{now.how} ({'; '.join(notes)})"
        findings.append(now)
    return replace(report, findings=findings)


def run(config: EngineConfig, *, live: int = 0, networks: bool = False, uid_ranges: int = 0) -> Report:
    """The start's preflight: check, raise what may be raised (``config.raise_limits``), log what is done and
    what is left to an operator."""
    report = check(config, live=live, networks=networks, uid_ranges=uid_ranges)
    if config.raise_limits and report.short:
        report = raise_short(report, config)
    for finding in report.raised:
        log.info(
            "raised %s from %s to %s: %s sandboxes need %s",
            finding.name,
            f"{finding.before:,}",
            f"{finding.value:,}",
            f"{config.max_sandboxes:,}",
            f"{finding.need:,}",
        )
    for finding in report.short:
        log.warning("host limit short: %s", finding.how)
    log.info(
        "preflight: %s of max_sandboxes %s fit on this host (bound by %s)",
        f"{report.fits:,}",
        f"{config.max_sandboxes:,}",
        report.limiting,
    )
    return report


# --- what a sandbox costs this host's kernel -------------------------------------------------------


def kernel_memory_kib(proc: Path) -> int | None:
    """The kernel's own memory now: unreclaimable slab, page tables, kernel stacks, per-CPU (KiB)."""
    try:
        fields = {}
        for line in (proc / "meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            fields[key] = int(rest.split()[0])
        return sum(fields[key] for key in KERNEL_MEMORY if key in fields)
    except (OSError, ValueError, IndexError):
        return None


class OverheadMeter:
    """The kernel's memory per sandbox on this host, from this engine's own fleet.

    A baseline is the kernel's memory when the engine held the fewest sandboxes
    it has held (taken again whenever it holds as few or fewer); once it holds
    ``MIN_GROWTH`` more than then, the figure is what the kernel's memory grew
    by, per sandbox added.  The figure answered is the larger of that and the
    configured default: the kernel's memory per sandbox grows with their number
    (the memory cgroups' per-superblock bookkeeping), so a measure at a small
    fleet under-counts a large one.  One read of ``/proc/meminfo`` a call.
    """

    MIN_GROWTH = 200

    def __init__(self, proc: Path, default_kib: int) -> None:
        self.proc = proc
        self.default_kib = default_kib
        self.baseline: tuple[int, int] | None = None  # (sandboxes, kernel KiB)

    def sample(self, live: int) -> dict[str, Any]:
        kernel = kernel_memory_kib(self.proc)
        measured: float | None = None
        grown = 0
        if kernel is not None:
            if self.baseline is None or live <= self.baseline[0]:
                self.baseline = (live, kernel)
            grown = live - self.baseline[0]
            if grown >= self.MIN_GROWTH:
                measured = max(0.0, (kernel - self.baseline[1]) / grown)
        return {
            "kib": max(self.default_kib, round(measured or 0)),
            "default_kib": self.default_kib,
            "measured_kib": round(measured, 1) if measured is not None else None,
            "measured_over": grown if measured is not None else 0,
        }
