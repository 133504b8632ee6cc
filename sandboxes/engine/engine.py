"""The engine: owns the sandboxes of one host.

It validates requests, keeps the durable record, drives the spawner, cgroups,
exec and files, enforces TTLs, and notices sandboxes that die.  Everything
runs on one asyncio loop; slow file work goes to threads.

Create, in the order :meth:`Engine.create` runs it:
  validate -> claim a uid range (uid_ranges.py) -> record ``creating`` ->
  cgroup with limits -> spawner (see spawner.py for the kernel steps) ->
  record ``running`` -> TTL timer.
Destroy, in the order :meth:`Engine.destroy` runs it:
  record ``destroying`` -> SIGKILL init (its pid namespace dies with it,
  taking every process and every mount of the sandbox) -> wait for exit ->
  remove the cgroup -> unlink the control socket -> the uid range rests once
  the cgroup is gone -> record ``destroyed``.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import dataclasses
import logging
import os
import re
import secrets
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

from . import (
    disks,
    egress_proxy,
    exec_keys,
    execution,
    faults,
    fork_services,
    network,
    ports,
    preflight,
    processes,
    resolver,
    rootfs,
    statedir,
    users,
)
from .cgroups import GROUP_CPU_MAX, GROUP_PREFIX, PREFIX, Cgroups, Limits, detect, favor_moves, split_name
from .config import EngineConfig
from .desktop import Desktop
from .errors import (
    CreateFailed,
    EngineError,
    InvalidRequest,
    InvalidSize,
    NoCapacity,
    SandboxNotFound,
    SandboxNotRunning,
    ServiceNotReady,
    TooLarge,
    TtlOverMaximum,
    Unavailable,
)
from .kernel import PR_SET_CHILD_SUBREAPER, RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, Kernel, KernelError
from .model_servers import ModelServers
from .native import BUILD_DIR, build_init
from .pool import WarmPools, parse_targets
from .recovery import RecoveryReport, init_alive, kill_init, reconcile
from .sandbox_files import FileWriter, IdleWriters, SandboxTree
from .sizes import MAX_SIZE_NAME, MEBIBYTE, MIN_DISK_MIB, Size, explicit_size
from .snapshots import Snapshots
from .spawner_client import SpawnerClient
from .store import LIVE_STATES, SandboxRecord, Store, open_store
from .template_store import TemplateStore, layer_directory_name
from .trees import IdShift, Tree
from .uid_ranges import RangeRecord, UidRanges
from .watches import Watch, Watches

log = logging.getLogger("forkyard.engine")


def _on_sigchld(loop: asyncio.AbstractEventLoop, reap: Callable[[], None]) -> None:
    """Run ``reap`` on the loop whenever a child exits. asyncio's loop takes SIGCHLD as any signal; uvloop keeps
    it for its own child watcher (which the engine does not use: it never spawns through the loop), so there
    the handler is the process's own, and it hands the work to the loop."""
    try:
        loop.add_signal_handler(signal.SIGCHLD, reap)
    except RuntimeError:
        signal.signal(signal.SIGCHLD, lambda *_: loop.call_soon_threadsafe(reap))


ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{2,62}$")
LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-/]{0,62}$")
EXIT_WAIT_S = 5.0
VERSION = "0.1.0"
EXEC_CGROUP_PREFIX = "x-"
# Empty exec cgroups kept per sandbox for its next commands: making and
# removing one per exec (mkdir, rmdir) was a fourteenth of the engine's time.
EXEC_CGROUPS_KEPT = 4
NETWORK_SET_CHUNK = 1000  # sandboxes whose rules change in one nftables transaction (network.replace_many)
NetworkChange = tuple[SandboxRecord, "builtins.list[network.Rule]", str]  # a sandbox, its new rules and group
MAX_DESTROY_MANY = 1000  # ids in one destroy_many
DESTROY_PARALLEL = 32  # of one destroy_many, destroys under way at once


def new_sandbox_id() -> str:
    return "sb-" + base64.b32encode(secrets.token_bytes(10)).decode().lower()[:14]


def _number(args: dict[str, Any], name: str, default: Any, minimum: float, maximum: float, integer: bool = False) -> Any:
    value = args.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not float(value).is_integer()):
        raise InvalidRequest(f"{name} must be {'an integer' if integer else 'a number'}", field=name)
    if not minimum <= value <= maximum:
        raise InvalidRequest(f"{name} must be between {minimum:g} and {maximum:g}", field=name)
    return int(value) if integer else float(value)


def _offset(args: dict[str, Any], name: str) -> int:
    """An output offset: a whole number of bytes, 0 (the start) unless given."""
    return int(_number(args, name, 0, 0, 1 << 62, integer=True))


def _explicit_size(args: dict[str, Any]) -> Size:
    """The limits of a shape given as ``cpu`` and ``memory_mib``, within what this host has."""
    host_cpus = float(os.cpu_count() or 1)
    host_mib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // MEBIBYTE
    try:
        cpu = _number(args, "cpu", None, 0.01, host_cpus)
        memory_mib = _number(args, "memory_mib", None, 16, host_mib, integer=True)
    except InvalidRequest as error:
        raise InvalidSize(error.message, **error.details) from None
    return explicit_size(cpu, memory_mib)


def _is_shape(size: Size, cpu: Any, memory_mib: Any) -> bool:
    """Whether unvalidated ``cpu`` and ``memory_mib`` are exactly ``size``'s shape."""
    numbers = all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in (cpu, memory_mib))
    return numbers and size.has_shape(cpu, memory_mib)


def _labels(raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > 64:
        raise InvalidRequest("labels must be an object of at most 64 string pairs", field="labels")
    for key, value in raw.items():
        if not isinstance(key, str) or not LABEL_KEY.match(key) or not isinstance(value, str) or len(value) > 255:
            raise InvalidRequest(
                f"label {str(key)[:64]!r}: keys are 1-63 of A-Z a-z 0-9 _ . - /, values strings of at most 255", field="labels"
            )
    return dict(raw)


class RequestedSize(NamedTuple):
    name: str  # as the caller gave it ("" for a shape without one)
    limits: Size
    shape_is_named_size: bool  # the limits are exactly that size's: its warm pool may serve the create


@dataclass
class CreateRequest:
    sandbox_id: str
    explicit_id: bool
    key: str
    template: str
    size: str  # as the caller gave it ("" for a shape without one)
    shape_is_named_size: bool  # see RequestedSize
    cpu: float
    memory_mib: int
    pids: int
    disk_bytes: int
    ttl_s: int
    env: dict[str, str]
    labels: dict[str, str]
    idle_timeout_s: int = 0
    egress: list[network.Rule] | None = None  # a network policy's rules; None: loopback only
    network_group: str = ""  # sandboxes of the same group reach each other (network.py)
    memory_group: str = ""  # sandboxes of the same memory group share one memory cgroup (cgroups.py)
    memory_group_mib: int = 0  # ... with this limit
    memory_group_cpu: float = 0.0  # ... and this CPU quota for the whole group (none each then); 0: a quota each


MEMORY_GROUP = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")


def _memory_group(raw: Any) -> dict[str, Any]:
    """``memory_group``: ``{"id", "memory_mib", "cpu"?}``, the memory group a sandbox joins (made by its first
    member with this limit and, with ``cpu``, that CPU quota for the group in place of one each); none when absent."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or set(raw) - {"id", "memory_mib", "cpu"}:
        raise InvalidRequest('memory_group must be {"id": ..., "memory_mib": ..., "cpu": ...}', field="memory_group")
    group, mib = raw.get("id"), raw.get("memory_mib")
    if not isinstance(group, str) or not MEMORY_GROUP.match(group):
        raise InvalidRequest("memory_group.id must be 1-40 characters of a-z, 0-9 and '-'", field="memory_group.id")
    if not isinstance(mib, int) or isinstance(mib, bool) or not 16 <= mib <= 64 * 1024 * 1024:
        raise InvalidRequest(
            "memory_group.memory_mib must be a whole number of MiB, at least 16", field="memory_group.memory_mib"
        )
    cpu = raw.get("cpu", 0)
    if not isinstance(cpu, int | float) or isinstance(cpu, bool) or not (cpu == 0 or 0.01 <= cpu <= GROUP_CPU_MAX):
        raise InvalidRequest(f"memory_group.cpu must be a number of cores, 0.01 to {GROUP_CPU_MAX}", field="memory_group.cpu")
    return {"memory_group": group, "memory_group_mib": mib, "memory_group_cpu": float(cpu)}


class Engine:
    def __init__(self, config: EngineConfig, kernel: Kernel | None = None, cgroups: Cgroups | None = None) -> None:
        self.config = config
        self.kernel = kernel or Kernel()
        self.cgroups = cgroups or detect(config)
        self.store: Store = open_store(config.database_path)
        self.templates = TemplateStore(config, self.store)
        self.shift = IdShift(config.uid_base, config.uid_count)  # the layers' range, on disk
        self.ranges = UidRanges(config.uid_base, config.uid_count, config.uid_ranges, config.uid_cooldown_s)
        self.sandboxes: dict[str, SandboxRecord] = {}
        self.by_pid: dict[int, str] = {}
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.busy: dict[str, asyncio.Future[None]] = {}  # sandbox id -> create, destroy or snapshot in flight
        self.spawner = SpawnerClient(config, self._init_exited)
        self.pools = WarmPools(self, parse_targets(config.warm_pools))
        self.snapshots = Snapshots(self)
        self.desktop = Desktop(self)  # screenshots and input of a sandbox's X desktop (desktop.py)
        self.network = network.Network(config.network_pool, config.network_table, self.kernel)
        self.disks = disks.Disks(config, self.kernel)  # sandboxes' writable layers, on disk (disks.py)
        self.resolvers = resolver.Resolvers(
            self.network.admit, config.network_hosts, config.network_upstream
        )  # one per policed sandbox
        # ... and a name proxy for those whose name rules cover the web's ports (egress_proxy.py)
        self.proxies = egress_proxy.NameProxies(self.resolvers.resolve, self.resolvers.refuse)
        self._networks_used = False  # has any sandbox here had a network? (else recovery leaves the firewall alone)
        self.recovery: RecoveryReport | None = None
        self.cgroup_moves = "left as the host has them (favor_cgroup_moves=0)"
        # The host's kernel limits, checked (and raised) at start, and its kernel memory per sandbox (preflight.py).
        self.preflight: preflight.Report | None = None
        self.overhead = preflight.OverheadMeter(config.proc_dir, config.sandbox_overhead_kib)
        self.started_at = time.time()
        self.counters = {
            "created": 0,
            "destroyed": 0,
            "create_failed": 0,
            "execs": 0,
            "exec_cgroups_made": 0,
            "exec_cgroups_reused": 0,  # kept ones, each found empty first
            "ttl_expired": 0,
            "idle_expired": 0,
            "died": 0,
        }
        # Idle timeouts: when each sandbox last had an exec or a file call, and how many execs it runs now
        # (memory only: a restart counts as a call).
        self.active_at: dict[str, float] = {}
        self.running_execs: dict[str, int] = {}
        self.exec_keys = exec_keys.ExecKeys(config.state_dir)  # execs with a key: at most once
        self.exec_cgroups: dict[str, set[str]] = {}  # sandbox id -> exec cgroups left to what their command started
        self.exec_cgroups_kept: dict[str, list[str]] = {}  # sandbox id -> empty exec cgroups for its next commands
        self.init_connections = execution.InitConnections()  # kept between execs (execution.py)
        self.writers = IdleWriters()  # sandboxes' file writers, kept a moment between calls (sandbox_files.py)
        self.hosts_files: dict[tuple[str, ...], rootfs.TemplateHosts | None] = {}  # by layers (never change)
        self.watches = Watches()  # directories watched for changes (watches.py)
        self.processes = processes.Processes(  # background processes and terminals (processes.py)
            str(config.proc_dir), self._end_process_cgroup, self._kill_process_cgroup, self._process_cgroup_pids
        )
        self.sys_dir = ""  # the sandboxes' shared sysfs once start() has it (rootfs.prepare_sys); "": one each
        self.model_servers = ModelServers(  # dedicated endpoints' servers, host processes (model_servers.py)
            config.state_dir,
            config.model_server_host,
            config.model_server_user,
            self.kernel.pidfd_open,
            str(config.proc_dir),
            config.vllm_command,
        )

    # --- lifecycle --------------------------------------------------------------

    async def start(self) -> RecoveryReport:
        config = self.config
        # Private to root, the layers nosuid and nodev (statedir.py).
        if statedir.prepare(config, self.kernel):
            log.info("mounted %s nosuid,nodev", config.layers_dir)
        for directory, mode in ((config.run_dir, 0o700), (config.sandbox_socket_dir, 0o700), (config.mount_dir, 0o755)):
            directory.mkdir(parents=True, exist_ok=True)
            os.chmod(directory, mode)
        for shared in ("root", "scratch"):
            (config.mount_dir / shared).mkdir(exist_ok=True)
        self.disks.setup()  # before recovery, which deletes the disks of sandboxes that are gone
        log.info("sandbox disks: %s", self.disks.info())
        # In place: every adopted sandbox's /dev is a bind of this directory.
        if remade := rootfs.prepare_dev(str(config.state_dir / "dev")):
            log.info("made %d entries of %s", remade, config.state_dir / "dev")
        rootfs.prepare_empty(str(config.mount_dir / "empty"))
        shared_sys = str(config.state_dir / "sys")
        try:  # every sandbox's /sys is a bind of it
            if rootfs.prepare_sys(shared_sys):
                log.info("mounted %s: a sysfs of no network device", shared_sys)
            self.sys_dir = shared_sys
        except OSError as error:
            log.warning("%s: each sandbox mounts a sysfs of its own", error)  # self.sys_dir stays ""
        if config.init_binary == BUILD_DIR / "forkyard-init":
            build_init()  # a no-op unless init.c changed
        elif not config.init_binary.exists():
            raise Unavailable(f"init binary {config.init_binary} is missing", path=str(config.init_binary))
        # Orphaned sandbox inits (should the spawner die) come to us, and we reap them.
        self.kernel.prctl(PR_SET_CHILD_SUBREAPER, 1)
        loop = asyncio.get_running_loop()
        _on_sigchld(loop, self._reap_children)
        self.cgroups.setup()
        if config.favor_cgroup_moves:
            self.cgroup_moves = favor_moves(self.kernel, config.proc_dir)
            (log.info if self.cgroup_moves in ("set", "already") else log.warning)("cgroup moves: %s", self.cgroup_moves)

        def on_spawner_lost() -> None:
            loop.create_task(self._spawner_lost())

        self.spawner.on_lost = on_spawner_lost
        self.spawner.start()
        report, adopted = reconcile(config, self.store, self.cgroups, self.kernel)
        for record in adopted:
            self._track(record)
            if record.network and record.state in ("running", "paused"):
                rules = network.parse_egress(record.network.get("egress", []))
                try:
                    await self._start_resolver(record, rules)
                except EngineError as error:
                    log.error("%s", error)
            if record.pool and record.state == "running":
                self.pools.adopt(record)
        self.recovery = report
        self._rebuild_ranges()
        self._preflight()
        loop.create_task(self._housekeeping())
        threading.Thread(target=network.preload, name="preload", daemon=True).start()
        self.pools.fill()
        log.info("model servers: %s", await self.model_servers.start())
        log.info("engine started: %s", report.to_dict())
        return report

    def _preflight(self) -> None:
        """The host's limits for max_sandboxes, raised where we may (preflight.py); the network's once sandboxes have networks."""
        live = sum(1 for record in self.sandboxes.values() if record.state in LIVE_STATES)
        self.preflight = preflight.run(self.config, live=live, networks=self.store_has_networks(), uid_ranges=self.ranges.last)

    def store_has_networks(self) -> bool:
        if not self._networks_used:
            self._networks_used = bool(self.store.get_meta("networks_used"))
        return self._networks_used

    async def stop(self) -> None:
        """Leave sandboxes running: a restarted engine adopts them."""
        for timer in self.timers.values():
            timer.cancel()
        self.writers.close_all()
        self.init_connections.close_all()
        self.watches.close()
        self.resolvers.close()
        self.proxies.close()
        self.model_servers.close()
        self.spawner.close()
        self.store.close()

    async def _spawner_lost(self) -> None:
        log.warning("the spawner went away; starting another")
        delay = 0.1
        while self.spawner.connection is None:
            await asyncio.sleep(delay)
            try:
                self.spawner.start()
            except EngineError as error:
                log.error("could not restart the spawner: %s", error)
                delay = min(delay * 2, 5.0)
        self._sweep_dead()

    def _rebuild_ranges(self) -> None:
        """Which uid ranges are held, after recovery: see uid_ranges.py."""
        existing = {split_name(name)[1] for name in self.cgroups.names()}
        self.ranges.rebuild(
            [
                RangeRecord(
                    record.id,
                    record.root_uid,
                    live=record.id in self.sandboxes and record.state in LIVE_STATES,
                    cgroup_exists=split_name(record.cgroup)[1] in existing,
                    ended_at=record.ended_at or time.time(),
                )
                for record in self.store.sandboxes()
                if record.root_uid
            ],
            time.time(),
        )

    def _free_range(self, record: SandboxRecord, cgroup_removed: bool = False) -> None:
        """The sandbox's uid range may go once its cgroup is gone (uid_ranges.py); ``cgroup_removed``: it
        was just removed without an error, so it need not be looked for."""
        if record.root_uid and (cgroup_removed or not self.cgroups.exists(record.cgroup)):
            self.ranges.release(record.root_uid, record.id, time.time())

    def _cgroup_of(self, sandbox_id: str) -> str:
        """The cgroup name of a sandbox that may be gone: its memory group's too, if it is in one."""
        own = PREFIX + sandbox_id
        return next((name for name in self.cgroups.names() if split_name(name)[1] == own), own)

    def _sweep_ranges(self) -> None:
        """Ranges still held for sandboxes that are gone: their cgroup could not
        be removed when they went; try again, and let the range go once it is."""
        for index, holder in list(self.ranges.held.items()):
            record = self.sandboxes.get(holder)
            if record is not None and record.state in LIVE_STATES:
                continue
            cgroup = self._cgroup_of(holder)
            try:
                self.cgroups.remove(cgroup)
            except EngineError as error:
                log.warning("the cgroup of %s still holds uid range %d: %s", holder, index, error)
                continue
            if not self.cgroups.exists(cgroup):
                self.ranges.release(self.ranges.host_uid(index), holder, time.time())

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(60)
            self._sweep_dead()
            self._sweep_ranges()
            self.store.purge_tombstones(time.time() - self.config.tombstone_s)
            self.pools.fill()

    def _reap_children(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._init_exited(pid, status)

    def _sweep_dead(self) -> None:
        """Catch deaths we were not told about (the spawner was down)."""
        for record in list(self.sandboxes.values()):
            if record.state in ("running", "paused") and not init_alive(record, str(self.config.proc_dir)):
                self._init_exited(record.pid, 0)

    def _track(self, record: SandboxRecord) -> None:
        self.sandboxes[record.id] = record
        if record.pid:
            self.by_pid[record.pid] = record.id
        if record.state in ("running", "paused", "stopped"):
            self.touch(record)
            self._arm_ttl(record)

    def _arm_ttl(self, record: SandboxRecord) -> None:
        """One timer per sandbox, for whichever comes first: its TTL or its idle timeout."""
        loop = asyncio.get_running_loop()
        previous = self.timers.pop(record.id, None)
        if previous:
            previous.cancel()
        deadline = record.expires_at
        idle_at = self._idle_deadline(record)
        if idle_at is not None:
            deadline = min(deadline, idle_at)
        delay = max(0.0, deadline - time.time())
        self.timers[record.id] = loop.call_later(delay, lambda: loop.create_task(self._expire(record.id)))

    def _idle_deadline(self, record: SandboxRecord) -> float | None:
        """When the sandbox counts as idle, if it can: a running one with an idle timeout and no exec running
        (a paused one was paused on purpose and is kept; an exec in flight is activity)."""
        if not record.idle_timeout_s or record.state != "running" or self.running_execs.get(record.id):
            return None
        return self.active_at.get(record.id, record.ready_at or record.created_at) + record.idle_timeout_s

    def touch(self, record: SandboxRecord) -> None:
        """An exec or a file call: the idle clock starts again (the timer, when it fires, sees it)."""
        self.active_at[record.id] = time.time()

    async def _expire(self, sandbox_id: str) -> None:
        self.timers.pop(sandbox_id, None)
        record = self.sandboxes.get(sandbox_id)
        if record is None:
            return
        now = time.time()
        if record.expires_at <= now + 0.01:
            self.counters["ttl_expired"] += 1
            reason = "ttl expired"
        elif (idle_at := self._idle_deadline(record)) is not None and idle_at <= now + 0.01:
            self.counters["idle_expired"] += 1
            reason = f"idle timeout: no exec or file call for {record.idle_timeout_s} s"
        else:  # the TTL was extended, or the sandbox was used since
            self._arm_ttl(record)
            return
        try:
            await self.destroy(sandbox_id, reason=reason)
        except EngineError as error:
            log.error("%s: destroy of %s failed: %s", reason, sandbox_id, error)

    def update(self, sandbox_id: Any, args: dict[str, Any]) -> dict[str, Any]:
        """Move a live sandbox's expiry (``expires_at``, epoch seconds, or ``ttl_s`` from now: at most
        ``max_ttl_s`` from now) and/or set its idle timeout (``idle_timeout_s``, 0: none). Recorded, so a
        restarted engine keeps it."""
        record = self.find(sandbox_id)
        if record.state not in ("creating", "running", "paused", "stopped") or record.pool:
            raise SandboxNotRunning(f"sandbox {record.id} is {record.state}", sandbox=record.id, state=record.state)
        unknown = sorted(set(args) - {"id", "expires_at", "ttl_s", "idle_timeout_s"})
        if unknown:
            raise InvalidRequest(f"unknown field {unknown[0][:40]!r}", field=unknown[0][:40])
        now = time.time()
        maximum = self.config.max_ttl_s
        if args.get("expires_at") is not None and args.get("ttl_s") is not None:
            raise InvalidRequest("give expires_at or ttl_s, not both", field="ttl_s")
        if args.get("ttl_s") is not None:
            ttl_s = _number(args, "ttl_s", None, 1, float("inf"), integer=True)
            if ttl_s > maximum:
                raise TtlOverMaximum(f"ttl_s is over this host's maximum TTL of {maximum} s", field="ttl_s", max_ttl_s=maximum)
            record.expires_at = now + ttl_s
        elif args.get("expires_at") is not None:
            expires_at = _number(args, "expires_at", None, 0, float("inf"))
            if expires_at <= now:
                raise InvalidRequest("expires_at is in the past", field="expires_at")
            if expires_at > now + maximum + 1:
                raise TtlOverMaximum(
                    f"expires_at is more than this host's maximum TTL of {maximum} s from now",
                    field="expires_at",
                    max_ttl_s=maximum,
                )
            record.expires_at = expires_at
        if args.get("idle_timeout_s") is not None:
            record.idle_timeout_s = _number(args, "idle_timeout_s", 0, 0, maximum, integer=True)
            self.touch(record)  # the clock starts now, not at the last call
        self.store.put_sandbox(record)
        if record.id in self.timers:
            self._arm_ttl(record)
        return record.public()

    def _init_exited(self, pid: int, status: int) -> None:
        sandbox_id = self.by_pid.pop(pid, None)
        record = self.sandboxes.get(sandbox_id) if sandbox_id else None
        if record is None or record.state not in ("running", "paused"):
            return
        # Not asked to die: it crashed or was killed from outside.
        self.counters["died"] += 1
        if record.pool:
            self.pools.forget(record.id)
        record.state = "stopped"
        record.reason = f"init exited (status {status})"
        record.ended_at = time.time()
        self._release(record)
        self.store.put_sandbox(record)

    def _release(self, record: SandboxRecord) -> None:
        self.writers.forget(record.id)  # it died with the sandbox; its connection goes too
        self.init_connections.forget(record.socket_path)
        self.processes.forget_sandbox(record.id)  # they died with it
        self.exec_cgroups.pop(record.id, None)  # removed with the sandbox's cgroup
        self.exec_cgroups_kept.pop(record.id, None)  # these too
        self.exec_keys.forget_sandbox(record.id)
        if record.network:
            self.resolvers.stop(record.id)
            self.proxies.stop(record.id)
            try:
                self.network.detach(record.id, record.network.get("address", ""), record.network.get("group", ""))
            except EngineError as error:
                log.error("removing the network of %s: %s", record.id, error)
        cgroup_removed = False
        try:
            self.cgroups.remove(record.cgroup)  # raises unless every directory of it is gone
            cgroup_removed = True
            self.cgroups.remove_empty_group(split_name(record.cgroup)[0])  # its last member gone: the group goes
        except EngineError as error:
            log.error("removing cgroup of %s: %s", record.id, error)
        try:
            os.unlink(record.socket_path)
        except FileNotFoundError:
            pass
        if record.disk_volume:
            try:
                self.disks.remove(record.id)  # its space comes back as btrfs's cleaner gets to it
            except EngineError as error:
                log.error("%s", error)  # recovery's reclaim deletes it at the next start
        self._free_range(record, cgroup_removed)

    # --- queries ------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        states: dict[str, int] = {}
        committed_mib = 0
        pooled = 0
        live = 0
        for record in self.sandboxes.values():
            if record.pool:
                pooled += 1
            else:
                states[record.state] = states.get(record.state, 0) + 1
            if record.state in LIVE_STATES:
                committed_mib += record.memory_mib
                live += 1
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return {
            "version": VERSION,
            "hostname": os.uname().nodename,
            "cpus": os.cpu_count(),
            "memory_mib": pages // MEBIBYTE,
            "cgroup_version": self.cgroups.version,
            "cgroup_moves": self.cgroup_moves,  # what start did about favordynmods (cgroups.favor_moves)
            "max_sandboxes": self.config.max_sandboxes,
            "sandboxes": sum(states.get(state, 0) for state in LIVE_STATES),
            "states": states,
            "pooled": pooled,
            "pools": self.pools.status(),
            "pool_claims": self.pools.claims,
            "pool_misses": self.pools.misses,
            "committed_memory_mib": committed_mib,
            "watches": self.watches.count,
            "model_servers": len(self.model_servers.servers),
            "disks": self.disks.info(),  # where writable layers live, and the pool's space (disks.py)
            "sizes": {name: vars(size) for name, size in self.config.sizes.items()},
            "counters": dict(self.counters),
            "processes": self.processes.count(),
            "exec_keys": self.exec_keys.status(),
            "init_connections": self.init_connections.status(),
            "recovery": self.recovery.to_dict() if self.recovery else None,
            "started_at": self.started_at,
            "spawner_pid": self.spawner.pid,
            "uid_ranges": self.ranges.status(time.time()),
            "resolvers": len(self.resolvers.by_sandbox),
            "name_proxies": self.proxies.info(),
            # The host's limits as they are now (read again each time), and what start raised.
            "preflight": {
                **preflight.check(
                    self.config, live=live, networks=self.store_has_networks(), uid_ranges=self.ranges.last
                ).to_dict(),
                "raised_at_start": self.preflight.to_dict()["raised"] if self.preflight else [],
            },
            "sandbox_overhead_kib": self.overhead.sample(live),
        }

    def find(self, sandbox_id: Any) -> SandboxRecord:
        """The record of a sandbox this engine holds; SandboxNotRunning for one that
        is gone (its tombstone), SandboxNotFound for one never seen."""
        if not isinstance(sandbox_id, str) or not sandbox_id:
            raise InvalidRequest("id must be a sandbox id", field="id")
        record = self.sandboxes.get(sandbox_id)
        if record is None:
            tombstone = self._tombstone(sandbox_id)
            if tombstone is not None:
                raise SandboxNotRunning(f"sandbox {sandbox_id} is {tombstone.state}", sandbox=sandbox_id, state=tombstone.state)
            raise SandboxNotFound(f"no sandbox {sandbox_id[:80]!r} on this host", sandbox=sandbox_id[:80])
        return record

    def _tombstone(self, sandbox_id: str) -> SandboxRecord | None:
        for record in self.store.sandboxes_by_id([sandbox_id]):
            return record
        return None

    def get(self, sandbox_id: Any) -> dict[str, Any]:
        try:
            return self.find(sandbox_id).public()
        except SandboxNotRunning:
            tombstone = self._tombstone(sandbox_id)
            assert tombstone is not None
            return tombstone.public()

    def list(self, state: Any = None, label: Any = None) -> list[dict[str, Any]]:
        wanted_labels = _labels(label) if isinstance(label, dict) else {}
        if isinstance(label, str):
            key, _, value = label.partition("=")
            wanted_labels = {key: value}
        records = self.sandboxes.values()
        return [
            record.public()
            for record in records
            if not record.pool
            and (state is None or record.state == state)
            and all(record.labels.get(key) == value for key, value in wanted_labels.items())
        ]

    def stats(self, sandbox_id: Any) -> dict[str, Any]:
        record = self.find(sandbox_id)
        if record.state not in ("running", "paused"):
            raise SandboxNotRunning(f"sandbox {record.id} is {record.state}", sandbox=record.id, state=record.state)
        stats = self.cgroups.stats(record.cgroup)
        age_s = max(time.time() - (record.ready_at or record.created_at), 0.001)
        disk_used, disk_files = self._disk_used(record)
        return {
            **vars(stats),
            "cpu_s": stats.cpu_usage_us / 1e6,
            "cpu_limit": record.cpu,
            # The part of its CPU allowance it has used since it was ready (1.0: all of it, all along).
            "cpu_share": round(stats.cpu_usage_us / 1e6 / age_s / max(record.cpu, 0.001), 6),
            "memory_limit_bytes": record.memory_mib * MEBIBYTE,
            "pids_max": record.pids_max,
            "disk_used_bytes": disk_used,
            "disk_files": disk_files,
            "disk_limit_bytes": record.disk_bytes,
            "age_s": round(age_s, 3),
            "network": self._network_stats(record) if record.network else None,
            # In a memory group, its memory figures are the group's (cgroups.py): shared, and limited together.
            "memory_group": split_name(record.cgroup)[0].removeprefix(GROUP_PREFIX) or None,
        }

    def _network_stats(self, record: SandboxRecord) -> dict[str, Any]:
        """What the host's rules counted and refused, and what its resolver and name proxy refused by name."""
        stats = self.network.stats(record.id)
        refused = self.resolvers.refusals(record.id)
        stats["denied"] = sorted([*stats["denied"], *refused], key=lambda attempt: attempt["at"], reverse=True)[
            : network.DENIED_SHOWN
        ]
        stats["denied_names"] = len(refused)
        return stats

    def _disk_used(self, record: SandboxRecord) -> tuple[int, int | None]:
        """What its disk holds (its writes, ``/dev/shm``): on disk, the bytes its quota group counts (data and
        metadata; files are not counted there: None); in a tmpfs of its own, its bytes and files (init holds it
        open as fd 5). (0, 0) for a sandbox whose init went."""
        if record.disk_volume:
            return self.disks.usage(record.disk_volume), None
        try:
            usage = os.statvfs(f"{self.config.proc_dir}/{record.pid}/fd/5")
        except OSError:
            return 0, 0
        if not init_alive(record, str(self.config.proc_dir)):  # the pid may have named another process
            return 0, 0
        return (usage.f_blocks - usage.f_bfree) * usage.f_frsize, usage.f_files - usage.f_ffree

    # --- one operation at a time per sandbox -------------------------------------

    @asynccontextmanager
    async def exclusive(self, sandbox_id: str) -> AsyncIterator[None]:
        """Work on a sandbox that no create, destroy or snapshot may overlap: wait
        for the one in flight, then be the one in flight until the block ends."""
        pending = self.busy.get(sandbox_id)
        if pending is not None:
            await asyncio.shield(pending)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.busy[sandbox_id] = done
        try:
            yield
        finally:
            self.busy.pop(sandbox_id, None)
            done.set_result(None)

    # --- create -------------------------------------------------------------------

    def parse_create(self, args: dict[str, Any]) -> CreateRequest:
        sandbox_id = args.get("id") or new_sandbox_id()
        if not isinstance(sandbox_id, str) or not ID_PATTERN.match(sandbox_id):
            raise InvalidRequest("id must be 3-63 characters of a-z, 0-9 and '-'", field="id")
        key = args.get("key") or ""
        if not isinstance(key, str) or len(key) > 255:
            raise InvalidRequest("key must be a string of at most 255 characters", field="key")
        template = args.get("template", "base")
        if not isinstance(template, str):
            raise InvalidRequest("template must be a template name", field="template")
        self.templates.get(template)  # raises TemplateNotFound
        size = self._parse_size(args)
        if args.get("disk_mib") is not None:
            disk_mib = _number(args, "disk_mib", None, MIN_DISK_MIB, self.config.max_disk_mib, integer=True)
            if disk_mib * MEBIBYTE != size.limits.disk_bytes:  # not the size's own disk: not its warm pool's
                size = RequestedSize(size.name, dataclasses.replace(size.limits, disk_mib=disk_mib), shape_is_named_size=False)
        ttl_s = _number(args, "ttl_s", self.config.default_ttl_s, 1, self.config.max_ttl_s, integer=True)
        idle_timeout_s = _number(args, "idle_timeout_s", 0, 0, self.config.max_ttl_s, integer=True)
        return CreateRequest(
            sandbox_id=sandbox_id,
            explicit_id=bool(args.get("id")),
            key=key,
            template=template,
            size=size.name,
            shape_is_named_size=size.shape_is_named_size,
            cpu=size.limits.cpu,
            memory_mib=size.limits.memory_mib,
            pids=size.limits.pids,
            disk_bytes=size.limits.disk_bytes,
            ttl_s=ttl_s,
            env=execution.validate_env(args.get("env")),
            labels=_labels(args.get("labels")),
            idle_timeout_s=idle_timeout_s,
            egress=self._parse_network(args.get("network")),
            network_group=network.parse_group((args.get("network") or {}).get("group")),
            **_memory_group(args.get("memory_group")),
        )

    @staticmethod
    def _parse_network(raw: Any) -> builtins.list[network.Rule] | None:
        """``network``: None (loopback only) or ``{"egress": [rules], "group": ...}`` (network.py)."""
        if raw is None:
            return None
        if not isinstance(raw, dict) or set(raw) - {"egress", "group"}:
            raise InvalidRequest('network must be {"egress": [rules], "group": name} or null', field="network")
        return network.parse_egress(raw.get("egress", []))

    async def set_network(self, sandbox_id: Any, args: dict[str, Any]) -> dict[str, Any]:
        """Replace a running sandbox's egress rules (its policy changed): one nftables transaction,
        applied before this returns.  A sandbox created without a policy keeps loopback only."""
        change = self._network_change({**args, "id": sandbox_id})
        await self._apply_networks([change])
        return change[0].public()

    async def set_networks(self, items: Any) -> builtins.list[dict[str, Any]]:
        """``set_network`` for many sandboxes (a policy changed under a launch): their rules replaced in one
        nftables transaction per ``NETWORK_SET_CHUNK``, off the event loop; for each item, in order, the
        sandbox's record, or ``{"id", "error"}`` for one that could not take it (its old rules stay)."""
        if not isinstance(items, list) or not 1 <= len(items) <= MAX_DESTROY_MANY or not all(isinstance(i, dict) for i in items):
            raise InvalidRequest(f"items must be a list of 1 to {MAX_DESTROY_MANY} objects", field="items")
        answers: builtins.list[dict[str, Any]] = [{} for _ in items]
        ready: builtins.list[tuple[int, NetworkChange]] = []
        for index, args in enumerate(items):
            try:
                ready.append((index, self._network_change(args)))
            except EngineError as error:
                answers[index] = {"id": str(args.get("id"))[:80], "error": error.to_dict()}
        for start in range(0, len(ready), NETWORK_SET_CHUNK):
            chunk = ready[start : start + NETWORK_SET_CHUNK]
            try:
                await self._apply_networks([change for _, change in chunk])
            except EngineError as error:
                for index, change in chunk:
                    answers[index] = {"id": change[0].id, "error": error.to_dict()}
                continue
            for index, change in chunk:
                answers[index] = change[0].public()
        return answers

    async def _apply_networks(self, changes: builtins.list[NetworkChange]) -> None:
        """New rules (and groups) for these sandboxes, in one nftables transaction; then their resolvers,
        name proxies and records."""
        await asyncio.to_thread(
            self.network.replace_many,
            [
                (record.id, record.network["address"], rules, group, record.network.get("group", ""))
                for record, rules, group in changes
            ],
        )
        for record, rules, group in changes:
            self.resolvers.update(record.id, rules)
            await self.proxies.update(record.id, record.network["host_address"], rules)
            record.network = {**record.network, "egress": [rule.to_dict() for rule in rules], "group": group}
        self.store.put_sandboxes([record for record, _, _ in changes])

    def _network_change(self, args: dict[str, Any]) -> NetworkChange:
        record = self.find(args.get("id"))
        if record.state not in ("running", "paused"):
            raise SandboxNotRunning(f"sandbox {record.id} is {record.state}", sandbox=record.id, state=record.state)
        unknown = sorted(set(args) - {"id", "network"})
        if unknown:
            raise InvalidRequest(f"unknown field {unknown[0][:40]!r}", field=unknown[0][:40])
        rules = self._parse_network(args.get("network"))
        if rules is None:
            raise InvalidRequest('network must be {"egress": [rules]}', field="network")
        if not record.network:
            raise SandboxNotRunning(
                f"sandbox {record.id} was created without a network policy: it has loopback only",
                sandbox=record.id,
                state=record.state,
            )
        return record, rules, network.parse_group(args["network"].get("group"))

    def _parse_size(self, args: dict[str, Any]) -> RequestedSize:
        """The size a create asks for.

        ``size`` alone names a size; ``cpu`` and ``memory_mib`` alone give a
        shape.  All three (what the control plane sends) are the named size if
        its shape is exactly the given one; otherwise the given shape, under the
        given name (the control plane's sizes need not be this engine's).
        """
        size_name = args.get("size")
        cpu_given, memory_given = args.get("cpu") is not None, args.get("memory_mib") is not None
        if cpu_given != memory_given:
            missing = "memory_mib" if cpu_given else "cpu"
            raise InvalidSize(f"{missing} is missing: cpu and memory_mib go together", field=missing)
        if not cpu_given:
            return self._named_size("default" if size_name is None else size_name)
        if size_name is None:
            return RequestedSize("", _explicit_size(args), shape_is_named_size=False)
        if not isinstance(size_name, str) or len(size_name) > MAX_SIZE_NAME:
            raise InvalidSize(f"size must be a size name of at most {MAX_SIZE_NAME} characters", field="size")
        named = self.config.sizes.get(size_name)
        # Checked before the host's bounds: a named size is accepted on its own,
        # whatever the host, and so is its exact shape.
        if named is not None and _is_shape(named, args.get("cpu"), args.get("memory_mib")):
            return RequestedSize(size_name, named, shape_is_named_size=True)
        return RequestedSize(size_name, _explicit_size(args), shape_is_named_size=False)

    def _named_size(self, size_name: Any) -> RequestedSize:
        if not isinstance(size_name, str) or size_name not in self.config.sizes:
            raise InvalidSize(
                f"unknown size {str(size_name)[:40]!r}: use one of {', '.join(self.config.sizes)} or cpu and memory_mib",
                field="size",
                sizes=sorted(self.config.sizes),
            )
        return RequestedSize(size_name, self.config.sizes[size_name], shape_is_named_size=True)

    async def create(self, args: dict[str, Any]) -> dict[str, Any]:
        """Ensure a sandbox exists: the public create.

        Idempotent on ``id`` or ``key``: a replay gets the same sandbox (or the
        news that it is already gone), never a second one.  Without an ``id``,
        a warm pool of the template and size turns the create into a claim,
        if the create asks for exactly that size's limits.
        """
        request = self.parse_create(args)
        replay = await self._replay(request)
        if replay is not None:
            return replay.public()
        # A pooled sandbox has its pool's size exactly: a create of another shape
        # (even under that size's name) must not get one.
        if not request.explicit_id and request.shape_is_named_size and request.egress is None and not request.memory_group:
            claimed = self.pools.claim(request.template, request.size)
            if claimed is not None:
                return self._hand_over(claimed, request).public()
        return (await self.create_record(args, request=request)).public()

    async def _replay(self, request: CreateRequest) -> SandboxRecord | None:
        existing: SandboxRecord | None = None
        if request.key:
            bound = self.store.claim_key(request.key, request.sandbox_id)
            if bound != request.sandbox_id:
                existing = self.sandboxes.get(bound) or self._tombstone(bound)
        elif request.explicit_id:
            existing = self.sandboxes.get(request.sandbox_id) or self._tombstone(request.sandbox_id)
        if existing is None:
            return None
        pending = self.busy.get(existing.id)
        if pending is not None:
            await asyncio.shield(pending)
        return self.sandboxes.get(existing.id) or self._tombstone(existing.id) or existing

    def _hand_over(self, record: SandboxRecord, request: CreateRequest) -> SandboxRecord:
        """A pooled sandbox becomes the caller's: their labels, env and TTL."""
        now = time.time()
        record.pool = ""
        record.key = request.key
        record.labels = request.labels
        record.env = {**record.env, **request.env}
        record.created_at = record.ready_at = now
        record.expires_at = now + request.ttl_s
        record.idle_timeout_s = request.idle_timeout_s
        self.touch(record)
        if request.key:
            self.store.release_key(request.key, request.sandbox_id)
            self.store.claim_key(request.key, record.id)
        self.store.put_sandbox(record)
        self._arm_ttl(record)
        self.counters["created"] += 1
        return record

    async def create_record(self, args: dict[str, Any], pool: str = "", request: CreateRequest | None = None) -> SandboxRecord:
        """Create a sandbox from nothing (the cold path); pools call this too."""
        request = request or self.parse_create(args)
        # Counting live records walks all of them: only worth it near the limit
        # (every live sandbox is in self.sandboxes), not on every create.
        if len(self.sandboxes) >= self.config.max_sandboxes and (
            sum(1 for record in self.sandboxes.values() if record.state in LIVE_STATES) >= self.config.max_sandboxes
        ):
            if request.key:
                self.store.release_key(request.key, request.sandbox_id)
            raise NoCapacity(f"this host runs its maximum of {self.config.max_sandboxes} sandboxes", retry_after_s=5)
        template = self.templates.get(request.template)
        try:
            self.disks.check_room()  # NoCapacity while the disk pool is (nearly) full
        except NoCapacity:
            if request.key:
                self.store.release_key(request.key, request.sandbox_id)
            raise
        now = time.time()
        root_uid = self.ranges.claim(request.sandbox_id, now)
        if root_uid is None:
            if request.key:
                self.store.release_key(request.key, request.sandbox_id)
            raise NoCapacity(
                "no uid range is free on this host: every one is held, or resting after its sandbox went",
                retry_after_s=self.config.uid_cooldown_s,
            )
        record = SandboxRecord(
            id=request.sandbox_id,
            state="creating",
            template=request.template,
            layers=list(template.layers),
            cpu=request.cpu,
            memory_mib=request.memory_mib,
            pids_max=request.pids,
            disk_bytes=request.disk_bytes,
            cgroup=(f"{GROUP_PREFIX}{request.memory_group}/" if request.memory_group else "") + PREFIX + request.sandbox_id,
            cgroup_dirs=[],
            socket_path=str(self.config.sandbox_socket(request.sandbox_id)),
            env={**template.env, **request.env},
            user=template.user,
            labels=request.labels,
            workdir=template.workdir,
            created_at=now,
            # A pooled sandbox waits without a TTL of its own; claiming sets one.
            expires_at=now + (self.config.max_ttl_s if pool else request.ttl_s),
            size=request.size,
            pool=pool,
            key=request.key,
            exec_cgroups=True,
            init_files=True,
            init_reuse=True,
            root_uid=root_uid,
            idle_timeout_s=0 if pool else request.idle_timeout_s,
        )
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.busy[record.id] = done
        self.sandboxes[record.id] = record
        try:
            self.store.put_sandbox(record)
            faults.reached("create:recorded")
            await self._bring_up(
                record,
                ready=not template.services,
                egress=request.egress,
                network_group=request.network_group,
                group_memory_bytes=request.memory_group_mib * MEBIBYTE,
                group_cpu=request.memory_group_cpu,
            )
            if template.services:
                # Still "creating" (no exec, not listed as running) until they answer.
                await self._start_services(record, template.services)
                self._ready(record)
        except BaseException as error:
            self.sandboxes.pop(record.id, None)
            record.state, record.ended_at = "destroyed", time.time()
            record.reason = f"create failed: {getattr(error, 'message', error)}"
            self.store.put_sandbox(record)
            if request.key:  # a failed create may be retried with the same key
                self.store.release_key(request.key, record.id)
            self._free_range(record)  # unless its cgroup could not be removed
            self.counters["create_failed"] += 1
            raise
        finally:
            self.busy.pop(record.id, None)
            done.set_result(None)
        if not pool:
            self.counters["created"] += 1
        return record

    def _reserve_network(self, record: SandboxRecord) -> int:
        """A /31 of the pool for the sandbox, held in its record before anything is made, so that recovery
        finds what a crash leaves."""
        if not self.store_has_networks():
            self.store.set_meta("networks_used", "1")
            self._networks_used = True
            self._preflight()  # the network's limits, now that sandboxes have networks
        taken = {other.network["slot"] for other in self.sandboxes.values() if other.network}
        slot = self.network.free_slot(taken)
        record.network = {"slot": slot}
        self.store.put_sandbox(record)
        return slot

    async def _attach_network(
        self,
        record: SandboxRecord,
        egress: builtins.list[network.Rule],
        group: str,
        rules_written: asyncio.Future[None],
        resolv_written: bool = False,
    ) -> None:
        """Its devices and addresses (its rules were written while its init started: ``rules_written``), then
        its resolver and name proxy; its ``/etc/resolv.conf`` is written meanwhile, unless the spawn wrote
        it (``resolv_written``: beside its /etc/hosts)."""
        await rules_written
        slot = record.network["slot"]
        # Its resolver is the host side of its link (a file of its own: it may change it, to no avail).
        nameserver = f"nameserver {self.network.host_address(slot)}\n".encode()

        def write(tree: Tree) -> int:
            if isinstance(tree, SandboxTree):  # what is at the name (a symlink too) is replaced
                return tree.write("/etc/resolv.conf", nameserver, 0o644, make_parents=True, replace=True)
            return tree.write("/etc/resolv.conf", nameserver, 0o644, make_parents=True)

        devices = asyncio.to_thread(
            self.network.make_devices, record.id, record.pid, slot, egress, str(self.config.proc_dir), group
        )
        if resolv_written:
            made = await devices
        else:
            made, _ = await asyncio.gather(devices, self.with_writer(record.id, write, starting=True))
        record.network = made
        faults.reached("create:network")
        await self._start_resolver(record, egress)

    async def _start_resolver(self, record: SandboxRecord, egress: builtins.list[network.Rule]) -> None:
        try:
            await self.resolvers.start(record.id, record.network["host_address"], egress)
            await self.proxies.start(record.id, record.network["host_address"], egress)
        except OSError as error:
            raise network.NetworkError(f"starting the resolver of {record.id} failed: {error}") from None

    async def _bring_up(
        self,
        record: SandboxRecord,
        ready: bool = True,
        egress: builtins.list[network.Rule] | None = None,
        network_group: str = "",
        group_memory_bytes: int = 0,
        group_cpu: float = 0.0,
    ) -> None:
        limits = Limits(cpu=record.cpu, memory_bytes=record.memory_mib * MEBIBYTE, pids=record.pids_max)
        try:
            if self.disks.backend == "btrfs":
                record.disk_volume = self.disks.make(record.id, self.root_uid(record), record.disk_bytes)
            procs = self.cgroups.create(record.cgroup, limits, group_memory_bytes, group_cpu)
            record.cgroup_dirs = [str(directory) for directory in self.cgroups.directories(record.cgroup)]
            faults.reached("create:cgroup")
            spec: dict[str, Any] = {
                "sandbox_id": record.id,
                "uid_base": self.root_uid(record),
                "uid_count": self.config.uid_count,
                "layers_uid": self.config.uid_base,
                "cgroup_procs": procs,
                "socket_path": record.socket_path,
                "rootfs": {
                    "layers_dir": str(self.config.layers_dir),
                    "lower": [layer_directory_name(layer) for layer in record.layers],
                    "scratch_dir": str(self.config.mount_dir / "scratch"),
                    "root_dir": str(self.config.mount_dir / "root"),
                    "disk_bytes": record.disk_bytes,
                    "dev_dir": str(self.config.state_dir / "dev"),
                    "sys_dir": self.sys_dir,
                    "empty_dir": str(self.config.mount_dir / "empty"),
                    "disk_dir": str(self.disks.path(record.id)) if record.disk_volume else "",
                    **self._hosts_file(record.layers),
                },
            }
            rules_written: asyncio.Future[None] | None = None
            if egress is not None:
                # Its rules need no device: they are written while the spawner makes the sandbox.
                slot = self._reserve_network(record)
                rules_written = asyncio.ensure_future(
                    asyncio.to_thread(self.network.write_rules, record.id, slot, egress, network_group)
                )
                if spec["rootfs"].get("hosts"):  # its resolv.conf goes beside its hosts file, at the spawn
                    spec["resolv"] = f"nameserver {self.network.host_address(slot)}\n"
            try:
                record.pid, record.start_time = await self.spawner.spawn(spec)
                faults.reached("create:spawned")
                if egress is not None and rules_written is not None:
                    await self._attach_network(record, egress, network_group, rules_written, "resolv" in spec)
            finally:
                if rules_written is not None and not rules_written.done():
                    await asyncio.wait([rules_written])  # never removed (below) while still being written
        except BaseException:
            self._release(record)
            raise
        if ready:
            self._ready(record)
        else:
            self.by_pid[record.pid] = record.id
            self.store.put_sandbox(record)  # its pid, for recovery to reap if we die now

    def _hosts_file(self, layers: builtins.list[str]) -> dict[str, Any]:
        """The rootfs spec's ``hosts`` and ``etc_mode`` (rootfs.template_hosts), read once per stack of
        layers: a layer's content never changes."""
        key = tuple(layers)
        if key not in self.hosts_files:
            paths = [str(self.templates.layer_path(layer)) for layer in layers]
            try:
                self.hosts_files[key] = rootfs.template_hosts(paths, self.config.uid_base)
            except OSError as error:  # a layer gone: the create fails on it anyway
                log.warning("reading the hosts file of layers %s failed: %s", layers, error)
                return {}
            if len(self.hosts_files) > 1024:
                self.hosts_files.pop(next(iter(self.hosts_files)))
        made = self.hosts_files[key]
        return {} if made is None else {"hosts": made.text, "etc_mode": made.etc_mode}

    def _ready(self, record: SandboxRecord) -> None:
        record.state = "running"
        record.ready_at = time.time()
        self._track(record)
        self.store.put_sandbox(record)

    async def _start_services(self, record: SandboxRecord, wanted: builtins.list[dict[str, Any]]) -> None:
        """Start a snapshot's services and wait until each answers (but those with ``wait`` off); on
        failure the sandbox goes (the caller records the failed create)."""
        proc = str(self.config.proc_dir)

        async def run(command: str) -> int:
            request = self.parse_exec(record, {"cmd": command, "timeout_s": 5, "max_output_bytes": 0})
            return (await execution.run(record.socket_path, request)).exit_code

        try:
            for service in wanted:
                request = self.parse_exec(
                    record, {"cmd": fork_services.start_argv(service), "timeout_s": 10, "max_output_bytes": 4096}
                )
                started = await execution.run(record.socket_path, request)
                if started.exit_code != 0:
                    raise ServiceNotReady(
                        f"service {service['name']!r} did not start: {started.stderr.decode(errors='replace')[:500]}",
                        service=service["name"],
                    )
            await asyncio.gather(
                *(
                    fork_services.wait_ready(service, lambda: fork_services.netns_socket(self.kernel, proc, record.pid), run)
                    for service in wanted
                    if fork_services.waited(service)
                )
            )
        except BaseException:
            timer = self.timers.pop(record.id, None)
            if timer:
                timer.cancel()
            self.by_pid.pop(record.pid, None)
            await self._kill_and_wait(record, False)
            self._release(record)
            raise

    # --- destroy ---------------------------------------------------------------------

    async def destroy(self, sandbox_id: Any, reason: str = "destroyed") -> dict[str, Any]:
        try:
            record = self.find(sandbox_id)
        except SandboxNotRunning:
            tombstone = self._tombstone(sandbox_id)
            assert tombstone is not None
            return tombstone.public()  # already gone: destroy is idempotent
        pending = self.busy.get(record.id)
        if pending is not None:
            await asyncio.shield(pending)
            return await self.destroy(sandbox_id, reason)
        if record.pool:
            self.pools.forget(record.id)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.busy[record.id] = done
        try:
            timer = self.timers.pop(record.id, None)
            if timer:
                timer.cancel()
            if record.state != "stopped":
                frozen = record.state == "paused"
                record.state = "destroying"
                self.store.put_sandbox(record)
                faults.reached("destroy:recorded")
                await self._kill_and_wait(record, frozen)
                faults.reached("destroy:killed")
                self._release(record)
            record.state = "destroyed"
            record.reason = record.reason if record.reason and reason == "destroyed" else reason
            record.ended_at = record.ended_at or time.time()
            self.store.put_sandbox(record)
            self.sandboxes.pop(record.id, None)
            self.by_pid.pop(record.pid, None)
            self.active_at.pop(record.id, None)
            self.counters["destroyed"] += 1
            self._collect_orphan_layers(record.layers)
        finally:
            self.busy.pop(record.id, None)
            done.set_result(None)
        return record.public()

    async def destroy_many(self, sandbox_ids: Any) -> builtins.list[dict[str, Any]]:
        """Destroy many in one call (a teardown's chunk), ``DESTROY_PARALLEL`` at a time: for each id,
        in order, what :meth:`destroy` answers, or ``{"id", "error"}`` with the error it raised."""
        if (
            not isinstance(sandbox_ids, list)
            or not 1 <= len(sandbox_ids) <= MAX_DESTROY_MANY
            or not all(isinstance(sandbox_id, str) for sandbox_id in sandbox_ids)
        ):
            raise InvalidRequest(f"ids must be a list of 1 to {MAX_DESTROY_MANY} sandbox ids", field="ids")
        gate = asyncio.Semaphore(DESTROY_PARALLEL)

        async def one(sandbox_id: str) -> dict[str, Any]:
            async with gate:
                try:
                    return await self.destroy(sandbox_id)
                except EngineError as error:
                    return {"id": sandbox_id[:80], "error": error.to_dict()}

        return list(await asyncio.gather(*(one(sandbox_id) for sandbox_id in sandbox_ids)))

    async def _kill_and_wait(self, record: SandboxRecord, frozen: bool) -> None:
        if frozen:
            # A frozen task cannot die until thawed; SIGKILL first, then thaw,
            # so that nothing in the sandbox runs another instruction.
            kill_init(record, self.kernel, str(self.config.proc_dir))
            self.cgroups.freeze(record.cgroup, False)
        try:
            pidfd = self.kernel.pidfd_open(record.pid)
        except KernelError:
            return  # already gone
        try:
            if not init_alive(record, str(self.config.proc_dir)):
                return
            self.kernel.pidfd_send_signal(pidfd, signal.SIGKILL)
            exited = asyncio.get_running_loop().create_future()
            loop = asyncio.get_running_loop()

            def on_exit() -> None:
                if not exited.done():
                    exited.set_result(None)

            loop.add_reader(pidfd, on_exit)
            try:
                await asyncio.wait_for(exited, EXIT_WAIT_S)
            except TimeoutError:
                log.error("sandbox %s init %s did not exit within %ss of SIGKILL", record.id, record.pid, EXIT_WAIT_S)
            finally:
                loop.remove_reader(pidfd)
        except KernelError:
            pass
        finally:
            os.close(pidfd)

    # --- pause and resume --------------------------------------------------------------

    async def pause(self, sandbox_id: Any) -> dict[str, Any]:
        record = self.find(sandbox_id)
        if record.state == "paused":
            return record.public()
        if record.state != "running":
            raise SandboxNotRunning(f"sandbox {record.id} is {record.state}", sandbox=record.id, state=record.state)
        await asyncio.to_thread(self.cgroups.freeze, record.cgroup, True)
        record.state, record.paused_at = "paused", time.time()
        self.store.put_sandbox(record)
        return record.public()

    async def resume(self, sandbox_id: Any) -> dict[str, Any]:
        record = self.find(sandbox_id)
        if record.state == "running":
            return record.public()
        if record.state != "paused":
            raise SandboxNotRunning(f"sandbox {record.id} is {record.state}", sandbox=record.id, state=record.state)
        await asyncio.to_thread(self.cgroups.freeze, record.cgroup, False)
        record.state, record.paused_at = "running", 0.0
        self.store.put_sandbox(record)
        self.touch(record)  # its idle clock starts again (a paused sandbox is never idle)
        self._arm_ttl(record)
        return record.public()

    # --- exec ----------------------------------------------------------------------------

    def parse_exec(self, record: SandboxRecord, args: dict[str, Any]) -> execution.ExecRequest:
        argv = execution.validate_argv(args.get("cmd"))
        cwd = execution.validate_directory(args.get("cwd") or record.workdir or "/", "cwd")
        env = {**record.env, **execution.validate_env(args.get("env"))}
        stdin = args.get("stdin")
        if args.get("stdin_b64") is not None:
            try:
                stdin_bytes = base64.b64decode(args["stdin_b64"], validate=True)
            except (ValueError, TypeError):
                raise InvalidRequest("stdin_b64 is not valid base64", field="stdin_b64") from None
        elif stdin is None:
            stdin_bytes = b""
        elif isinstance(stdin, str):
            stdin_bytes = stdin.encode()
        else:
            raise InvalidRequest("stdin must be a string", field="stdin")
        if len(stdin_bytes) > self.config.max_file_bytes:
            raise InvalidRequest("stdin is too large: upload a file instead", field="stdin")
        timeout_s = _number(args, "timeout_s", 60.0, 0.001, 24 * 3600)
        max_output = _number(
            args, "max_output_bytes", self.config.max_output_bytes, 0, self.config.max_output_limit, integer=True
        )
        return execution.ExecRequest(
            argv=argv, cwd=cwd, env=env, stdin=stdin_bytes, timeout_s=timeout_s, max_output_bytes=max_output
        )

    async def exec(
        self,
        sandbox_id: Any,
        args: dict[str, Any],
        on_output: Callable[[str, bytes], None] | None = None,
        flow: execution.Flow | None = None,
    ) -> execution.ExecResult:
        """Run a command (see execution.py); its output goes to ``on_output`` as
        it is read.  With a ``key``, at most once per sandbox (exec_keys.py)."""
        record = self.find(sandbox_id)
        if record.state != "running":
            raise SandboxNotRunning(
                f"sandbox {record.id} is {record.state}: it cannot run commands", sandbox=record.id, state=record.state
            )
        key = exec_keys.validate_key(args.get("key"))
        request = self.parse_exec(record, args)
        user = users.validate(args.get("user") if args.get("user") is not None else record.user or None)
        if user is not None:
            request = await self._as_user(record, request, user, args.get("env"))
        # Activity for the idle timeout: when it starts, while it runs, when it ends.
        self.touch(record)
        self.running_execs[record.id] = self.running_execs.get(record.id, 0) + 1
        try:
            if not key:
                return await self._exec_once(record, request, on_output, flow)
            return await self.exec_keys.run(
                record.id, key, on_output, flow, lambda output: self._exec_once(record, request, output, flow)
            )
        finally:
            left = self.running_execs.pop(record.id, 1) - 1
            if left:
                self.running_execs[record.id] = left
            self.touch(record)

    async def _as_user(self, record: SandboxRecord, request: execution.ExecRequest, user: str, env: Any) -> execution.ExecRequest:
        """The request run as ``user`` of the sandbox's own /etc/passwd (users.py):
        its ids, and its HOME, USER and LOGNAME unless the exec's ``env`` names them."""
        found: users.User = await self.with_tree(record.id, lambda tree: users.resolve(tree, user))
        return dataclasses.replace(
            request, identity=found.identity, env={**record.env, **found.env(), **execution.validate_env(env)}
        )

    async def _exec_once(
        self,
        record: SandboxRecord,
        request: execution.ExecRequest,
        on_output: Callable[[str, bytes], None] | None,
        flow: execution.Flow | None,
    ) -> execution.ExecResult:
        oom_before = self.cgroups.oom_kills(record.cgroup)
        self.counters["execs"] += 1
        # record.init_reuse: its init takes another command on a connection (made by an engine from before: one each).
        connections = self.init_connections
        if not record.exec_cgroups:  # made by an engine whose init takes no cgroup per exec
            result = await execution.run(
                record.socket_path, request, on_output, flow, connections=connections, reuse=record.init_reuse
            )
        else:
            command, procs = self._exec_cgroup(record)
            try:
                result = await execution.run(
                    record.socket_path,
                    request,
                    on_output,
                    flow,
                    cgroup_procs=procs,
                    connections=connections,
                    reuse=record.init_reuse,
                )
            except BaseException:
                # Its caller went away (or the sandbox did): closing init's
                # connection killed the command's process group; this ends
                # what left it with setsid too.  The kill waits for them to
                # go, in a thread (this call is being cancelled); the
                # bookkeeping after it, back on the loop.
                killing = asyncio.get_running_loop().run_in_executor(None, self.cgroups.kill_exec, record.cgroup, command)
                killing.add_done_callback(lambda _: self._end_exec_cgroup(record, command))
                raise
            finally:
                os.close(procs)
            self._end_exec_cgroup(record, command, keep=True)
        if record.state not in ("running", "paused"):  # going while the command ran: what was kept for it goes too
            self.init_connections.forget(record.socket_path)
        if result.signal == signal.SIGKILL and not result.timed_out:
            result.oom_killed = self.cgroups.oom_kills(record.cgroup) > oom_before
        return result

    def _exec_cgroup(self, record: SandboxRecord) -> tuple[str, int]:
        """A cgroup for one command, and an fd on its cgroup.procs for the command
        to join: a kept one that is still empty (so that everything in it is
        this command's), or a new one."""
        kept = self.exec_cgroups_kept.get(record.id)
        while kept:
            command = kept.pop()
            if not self.cgroups.exec_empty(record.cgroup, command):
                self._end_exec_cgroup(record, command)  # not ours any more: removed once empty
                continue
            try:
                procs_fd = os.open(
                    f"{self.cgroups.exec_directory(record.cgroup, command)}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC
                )
            except OSError:
                self._end_exec_cgroup(record, command)
                continue
            self.counters["exec_cgroups_reused"] += 1
            return command, procs_fd
        while True:
            command = EXEC_CGROUP_PREFIX + secrets.token_hex(6)
            try:
                procs = self.cgroups.create_exec(record.cgroup, command)
                break
            except FileExistsError:  # left by an earlier command (a service), under the same name
                continue
        self.counters["exec_cgroups_made"] += 1
        try:
            return command, os.open(procs, os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            self.cgroups.remove_exec(record.cgroup, command)
            raise

    def _end_exec_cgroup(self, record: SandboxRecord, command: str, keep: bool = False) -> None:
        """Remove a command's cgroup; one that still holds what the command
        started (a service) is removed later, once empty (tried again as the
        sandbox's next commands end, and with the sandbox).  With ``keep`` (an
        exec that ended by itself, not a background process, whose cgroup
        others may still look up by name), it is kept for the sandbox's next
        command instead, up to EXEC_CGROUPS_KEPT, which takes it only if it is
        empty then."""
        try:
            # Whether it is empty is asked when it is taken (_exec_cgroup): once per exec is enough.
            if keep and record.state == "running" and len(self.exec_cgroups_kept.get(record.id, ())) < EXEC_CGROUPS_KEPT:
                self.exec_cgroups_kept.setdefault(record.id, []).append(command)
                if record.id not in self.exec_cgroups:
                    return
            else:
                self.exec_cgroups.setdefault(record.id, set()).add(command)
            lingering = self.exec_cgroups.setdefault(record.id, set())
            for name in list(lingering):
                if self.cgroups.remove_exec(record.cgroup, name):
                    lingering.discard(name)
            if not lingering:
                self.exec_cgroups.pop(record.id, None)
        except Exception as error:  # noqa: BLE001 - the sandbox's destroy removes them all
            log.warning("exec cgroup %s of %s: %s", command, record.id, error)

    # --- background processes (processes.py) ----------------------------------------------

    def _running_record(self, sandbox_id: Any, doing: str) -> SandboxRecord:
        record = self.find(sandbox_id)
        if record.state != "running":
            raise SandboxNotRunning(
                f"sandbox {record.id} is {record.state}: it cannot {doing}", sandbox=record.id, state=record.state
            )
        return record

    async def start_process(self, sandbox_id: Any, args: dict[str, Any]) -> dict[str, Any]:
        """Start a command without waiting for it; with ``pty`` ({rows, cols}), on a terminal of its own."""
        record = self._running_record(sandbox_id, "run commands")
        request = self.parse_exec(record, {name: args.get(name) for name in ("cmd", "cwd", "env")})
        user = users.validate(args.get("user") if args.get("user") is not None else record.user or None)
        if user is not None:  # as an exec: the user named, else its template's default user
            request = await self._as_user(record, request, user, args.get("env"))
        self.touch(record)  # a start is a call, for the idle timeout, as an exec is
        terminal = processes.parse_terminal(args.get("pty"))
        timeout_s = None if args.get("timeout_s") is None else _number(args, "timeout_s", 0, 0.001, 7 * 24 * 3600)
        self.processes.make_room(record.id)
        terminal_fds = None
        if terminal is not None:
            request = dataclasses.replace(request, terminal=True)
            tree = self.open_tree(record.id)
            try:
                terminal_fds = processes.open_terminal(
                    lambda: self.kernel.openat2(
                        tree.root_fd,
                        "dev/pts/ptmx",
                        os.O_RDWR | os.O_NOCTTY,
                        RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
                    ),
                    self.root_uid(record),
                    terminal,
                )
            except (OSError, KernelError) as error:
                raise SandboxNotRunning(f"cannot open a terminal in sandbox {record.id}: {error}", step="pty") from error
            finally:
                os.close(tree.root_fd)
        cgroup = self._exec_cgroup(record) if record.exec_cgroups else None
        self.counters["execs"] += 1
        process = await self.processes.start(record.id, record.socket_path, request, timeout_s, terminal, terminal_fds, cgroup)
        return process.answer()

    def list_processes(self, sandbox_id: Any) -> builtins.list[dict[str, Any]]:
        return self.processes.listing(self.find(sandbox_id).id)

    def find_process(self, args: dict[str, Any]) -> processes.Process:
        """The process ``pid`` of sandbox ``id`` (``process_not_found`` if it has none by that pid)."""
        return self.processes.find(self.find(args.get("id")).id, args.get("pid"))

    def process_output(self, args: dict[str, Any]) -> dict[str, Any]:
        """Its state, and its output from ``stdout_offset`` and ``stderr_offset`` (what is still kept)."""
        return self.find_process(args).answer(_offset(args, "stdout_offset"), _offset(args, "stderr_offset"))

    def signal_process(self, args: dict[str, Any]) -> dict[str, Any]:
        process = self.find_process(args)
        self.processes.send_signal(process, processes.parse_signal(args.get("signal", "TERM")), bool(args.get("group")))
        return process.summary()

    async def wait_process(self, args: dict[str, Any]) -> dict[str, Any]:
        """Until it exits or ``timeout_s`` passes; an exit seen here is reaped (the answer has the rest of its output)."""
        process = self.find_process(args)
        timeout_s = _number(args, "timeout_s", 30.0, 0, processes.MAX_WAIT_S)
        ended = await self.processes.wait(process, timeout_s)
        answer = process.answer(_offset(args, "stdout_offset"), _offset(args, "stderr_offset"))
        if ended:
            self.processes.forget(process)
        return answer

    async def process_input(self, args: dict[str, Any]) -> dict[str, Any]:
        process = self.find_process(args)
        try:
            data = base64.b64decode(args.get("data_b64") or "", validate=True)
        except (ValueError, TypeError):
            raise InvalidRequest("data_b64 is not valid base64", field="data_b64") from None
        if len(data) > processes.MAX_INPUT_BYTES:
            raise InvalidRequest(f"input is over {processes.MAX_INPUT_BYTES} bytes a call", field="data")
        written = await self.processes.write_input(process, data, bool(args.get("eof")))
        return {**process.summary(), "written": written}

    def resize_process(self, args: dict[str, Any]) -> dict[str, Any]:
        process = self.find_process(args)
        terminal = processes.parse_terminal({"rows": args.get("rows"), "cols": args.get("cols")})
        assert terminal is not None
        self.processes.resize(process, terminal)
        return process.summary()

    def _end_process_cgroup(self, sandbox_id: str, command: str) -> None:
        record = self.sandboxes.get(sandbox_id)
        if record is not None:
            self._end_exec_cgroup(record, command)

    def _kill_process_cgroup(self, sandbox_id: str, command: str) -> None:
        record = self.sandboxes.get(sandbox_id)
        if record is not None:
            self.cgroups.kill_exec(record.cgroup, command)

    def _process_cgroup_pids(self, sandbox_id: str, command: str) -> builtins.list[int]:
        record = self.sandboxes.get(sandbox_id)
        return [] if record is None else self.cgroups.exec_pids(record.cgroup, command)

    # --- files ---------------------------------------------------------------------------

    def open_tree(self, sandbox_id: Any, starting: bool = False) -> Tree:
        """The sandbox's root as its init sees it; close ``tree.root_fd`` after.  ``starting``: the engine's
        own change to a sandbox still ``creating`` (its ``/etc/resolv.conf``)."""
        record = self.find(sandbox_id)
        if record.state not in ("running", "paused") and not (starting and record.state == "creating"):
            raise SandboxNotRunning(f"sandbox {record.id} is {record.state}", sandbox=record.id, state=record.state)
        self.touch(record)  # every file call opens the tree: activity for the idle timeout
        try:
            root_fd = os.open(f"{self.config.proc_dir}/{record.pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as error:
            raise SandboxNotRunning(f"sandbox {record.id} is not running", sandbox=record.id) from error
        # Checked after opening: if the pid now names another process, the
        # root we opened may be its root, not the sandbox's.
        if not init_alive(record, str(self.config.proc_dir)):
            os.close(root_fd)
            raise SandboxNotRunning(f"sandbox {record.id} is not running", sandbox=record.id)
        return Tree(root_fd, self.sandbox_shift(record), self.kernel)

    def root_uid(self, record: SandboxRecord) -> int:
        """The host uid of root in the sandbox: its own range's (uid_base for one an older engine made)."""
        return record.root_uid or self.config.uid_base

    def sandbox_shift(self, record: SandboxRecord) -> IdShift:
        """Ids as the host sees the sandbox's files (its own range)."""
        return IdShift(self.root_uid(record), self.config.uid_count)

    async def with_tree(self, sandbox_id: Any, operation: Callable[[Tree], Any]) -> Any:
        """Read a sandbox's files (stat, list), in a worker thread."""
        tree = self.open_tree(sandbox_id)
        root = self.root_uid(self.find(sandbox_id))

        def run() -> Any:
            try:
                # As the sandbox's root, in this worker thread only (see
                # Kernel.filesystem_identity): what an older sandbox's changes
                # make (see with_writer) must be ownable there.
                with self.kernel.filesystem_identity(root, root):
                    return operation(tree)
            finally:
                os.close(tree.root_fd)

        return await asyncio.to_thread(run)

    async def with_writer(self, sandbox_id: Any, operation: Callable[[Tree], Any], starting: bool = False) -> Any:
        """Change a sandbox's files (write, upload, mkdir, remove), in a worker thread.

        The changes are made by the sandbox's own file writer (sandbox_files.py),
        so that they count against the sandbox's memory and disk, not the
        engine's.  A paused sandbox runs nothing, its writer included: its
        files can be read, not changed, until it is resumed.
        """
        record = self.find(sandbox_id)
        if not record.init_files:  # made by an older engine: its init has no writer
            return await self.with_tree(sandbox_id, operation)
        if record.state == "paused":
            raise SandboxNotRunning(
                f"sandbox {record.id} is paused: resume it to change its files (reading them works)",
                sandbox=record.id,
                state=record.state,
            )
        tree = self.open_tree(sandbox_id, starting)

        def oom_kills() -> int:
            return self.cgroups.oom_kills(record.cgroup)

        def new_writer() -> FileWriter:
            writer = self.writers.take(record.id, record.socket_path)
            if writer.served == 1:  # a new one: what would tell that the kernel ended it
                writer.oom_kills = oom_kills()
            return writer

        def run() -> Any:
            changes: SandboxTree | None = None
            try:
                changes = SandboxTree(tree.root_fd, tree.shift, new_writer(), self.kernel, oom_kills, new_writer)
                return operation(changes)
            finally:
                if changes is not None:
                    self.writers.give_back(changes.writer)
                os.close(tree.root_fd)

        try:
            return await asyncio.to_thread(run)
        finally:
            # A writer kept for the next call goes once idle (or with its sandbox).
            asyncio.get_running_loop().call_later(self.writers.idle_s + 0.1, self.writers.expire)

    def open_file(self, tree: Tree, path: str) -> tuple[int, int]:
        """A regular file of a sandbox's ``tree`` (``open_tree``, on the loop) opened to read, resolved in its
        root, and its size: (fd, size); ``tree.root_fd`` is closed, the caller closes the fd. Blocking: for a
        worker thread. A file over ``max_file_bytes`` is ``too_large``."""
        try:
            fd, size = tree.open_regular(path)
        finally:
            os.close(tree.root_fd)
        limit = self.config.max_file_bytes
        if size > limit:
            os.close(fd)
            raise TooLarge(f"{path} is {size} bytes, over the {limit}-byte limit", path=path, size=size)
        return fd, size

    async def write_file(
        self,
        sandbox_id: Any,
        path: str,
        chunks: Callable[[], Iterator[bytes]] | bytes,
        mode: int = 0o644,
        make_parents: bool = False,
    ) -> dict[str, Any]:
        """Create or replace a sandbox's file from ``chunks`` (a blocking iterator, pulled in the writer's
        thread, or the whole content), charged to the sandbox (``with_writer``), at most ``max_file_bytes``:
        ``{path, bytes}``."""
        limit = self.config.max_file_bytes

        def write(tree: Any) -> dict[str, Any]:
            return {"path": path, "bytes": tree.write(path, chunks, mode, limit=limit, make_parents=make_parents)}

        result: dict[str, Any] = await self.with_writer(sandbox_id, write)
        return result

    async def watch(self, sandbox_id: Any, path: str) -> Watch:
        """Watch a directory of a sandbox (watches.py); ``close()`` the watch when done."""
        directory = await self.with_tree(sandbox_id, lambda tree: tree.open(path, os.O_PATH | os.O_DIRECTORY))
        try:
            return self.watches.add(directory, path)
        finally:
            os.close(directory)

    # --- ports (ports.py) ------------------------------------------------------------------

    def _port_socket(self, record: SandboxRecord) -> Callable[[], Any]:
        proc = str(self.config.proc_dir)
        return lambda: fork_services.netns_socket(self.kernel, proc, record.pid)

    async def connect_port(self, sandbox_id: Any, port: Any) -> Any:
        """A socket connected to ``port`` on the sandbox's loopback (``port_not_listening`` if none accepts)."""
        port = ports.parse_port(port)
        record = self._running_record(sandbox_id, "be reached on a port")
        self.touch(record)  # a request to one of its ports is activity, for the idle timeout
        return await ports.connect(self._port_socket(record), port, record.id)

    async def wait_port(self, sandbox_id: Any, port: Any, timeout_s: Any) -> dict[str, Any]:
        """Until something accepts on ``port`` or ``timeout_s`` passes: ``{port, listening, waited_s}``."""
        port = ports.parse_port(port)
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not 0 <= timeout_s <= ports.MAX_WAIT_S:
            raise InvalidRequest(f"timeout_s is from 0 to {ports.MAX_WAIT_S:g} seconds", field="timeout_s")
        record = self._running_record(sandbox_id, "be reached on a port")

        async def no_exec(command: str) -> int:
            return 1  # a tcp check runs no command

        try:
            waited = await fork_services.wait_ready(
                ports.wait_service(port, float(timeout_s)), self._port_socket(record), no_exec
            )
        except ServiceNotReady:
            return {"port": port, "listening": False, "waited_s": float(timeout_s)}
        return {"port": port, "listening": True, "waited_s": round(waited, 6)}

    def still_running(self, sandbox_id: str) -> bool:
        """Is the sandbox running or paused (for what follows it, such as a watch)?"""
        try:
            return self.find(sandbox_id).state in ("running", "paused")
        except EngineError:
            return False

    # --- templates -------------------------------------------------------------------------

    def layers_in_use(self, layers: builtins.list[str]) -> bool:
        wanted = set(layers)
        return any(wanted & set(record.layers) for record in self.sandboxes.values())

    def _collect_orphan_layers(self, layers: builtins.list[str]) -> None:
        """The last sandbox on a deleted snapshot's layers is gone: so are they."""
        if not set(layers) <= self.templates.referenced_layers():
            self.templates.collect_layers(self.layers_in_use)

    def delete_template(self, name: Any) -> None:
        if not isinstance(name, str):
            raise InvalidRequest("name must be a template name", field="name")
        self.templates.delete(name, self.layers_in_use)

    async def destroy_all(self) -> int:
        ids = list(self.sandboxes)
        await asyncio.gather(*(self.destroy(sandbox_id) for sandbox_id in ids), return_exceptions=True)
        return len(ids)


__all__ = ["Engine", "CreateFailed", "VERSION"]
