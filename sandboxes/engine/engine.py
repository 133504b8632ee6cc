"""The engine: owns the sandboxes of one host.

It validates requests, keeps the durable record, drives the spawner, cgroups,
exec and files, enforces TTLs, and notices sandboxes that die.  Everything
runs on one asyncio loop; slow file work goes to threads.

Create, in the order :meth:`Engine.create` runs it:
  validate -> record ``creating`` -> cgroup with limits -> spawner (see
  spawner.py for the kernel steps) -> record ``running`` -> TTL timer.
Destroy, in the order :meth:`Engine.destroy` runs it:
  record ``destroying`` -> SIGKILL init (its pid namespace dies with it,
  taking every process and every mount of the sandbox) -> wait for exit ->
  remove the cgroup -> unlink the control socket -> record ``destroyed``.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import logging
import os
import re
import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import execution, faults, rootfs, services
from .cgroups import PREFIX, Cgroups, Limits, detect
from .config import MEBIBYTE, EngineConfig, Size
from .errors import (
    CreateFailed,
    EngineError,
    InvalidRequest,
    InvalidSize,
    NoCapacity,
    SandboxNotFound,
    SandboxNotRunning,
    ServiceNotReady,
    Unavailable,
)
from .kernel import PR_SET_CHILD_SUBREAPER, Kernel, KernelError
from .native import BUILD_DIR, build_init
from .pool import WarmPools, parse_targets
from .recovery import RecoveryReport, init_alive, kill_init, reconcile
from .snapshots import Snapshots
from .spawner_client import SpawnerClient
from .store import LIVE_STATES, SandboxRecord, Store, open_store
from .templates import Templates, layer_directory_name
from .trees import IdShift, Tree

log = logging.getLogger("forkyard.engine")
ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{2,62}$")
LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-/]{0,62}$")
EXIT_WAIT_S = 5.0
VERSION = "0.1.0"


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


@dataclass
class CreateRequest:
    sandbox_id: str
    explicit_id: bool
    key: str
    template: str
    size: str
    cpu: float
    memory_mib: int
    pids: int
    disk_bytes: int
    ttl_s: int
    env: dict[str, str]
    labels: dict[str, str]


class Engine:
    def __init__(self, config: EngineConfig, kernel: Kernel | None = None, cgroups: Cgroups | None = None) -> None:
        self.config = config
        self.kernel = kernel or Kernel()
        self.cgroups = cgroups or detect(config)
        self.store: Store = open_store(config.database_path)
        self.templates = Templates(config, self.store)
        self.shift = IdShift(config.uid_base, config.uid_count)
        self.sandboxes: dict[str, SandboxRecord] = {}
        self.by_pid: dict[int, str] = {}
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.busy: dict[str, asyncio.Future[None]] = {}  # sandbox id -> create/destroy in flight
        self.spawner = SpawnerClient(config, self._init_exited)
        self.pools = WarmPools(self, parse_targets(config.warm_pools))
        self.snapshots = Snapshots(self)
        self.recovery: RecoveryReport | None = None
        self.started_at = time.time()
        self.counters = {"created": 0, "destroyed": 0, "create_failed": 0, "execs": 0, "ttl_expired": 0, "died": 0}

    # --- lifecycle --------------------------------------------------------------

    async def start(self) -> RecoveryReport:
        config = self.config
        for directory, mode in (
            (config.state_dir, 0o755),
            (config.run_dir, 0o700),
            (config.sandbox_socket_dir, 0o700),
            (config.layers_dir, 0o755),
            (config.mount_dir, 0o755),
        ):
            directory.mkdir(parents=True, exist_ok=True)
            os.chmod(directory, mode)
        for shared in ("root", "scratch"):
            (config.mount_dir / shared).mkdir(exist_ok=True)
        rootfs.prepare_dev(str(config.state_dir / "dev"))
        rootfs.prepare_empty(str(config.mount_dir / "empty"))
        if config.init_binary == BUILD_DIR / "forkyard-init":
            build_init()  # a no-op unless init.c changed
        elif not config.init_binary.exists():
            raise Unavailable(f"init binary {config.init_binary} is missing", path=str(config.init_binary))
        # Orphaned sandbox inits (should the spawner die) come to us, and we reap them.
        self.kernel.prctl(PR_SET_CHILD_SUBREAPER, 1)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGCHLD, self._reap_children)
        self.cgroups.setup()

        def on_spawner_lost() -> None:
            loop.create_task(self._spawner_lost())

        self.spawner.on_lost = on_spawner_lost
        self.spawner.start()
        report, adopted = reconcile(config, self.store, self.cgroups, self.kernel)
        for record in adopted:
            self._track(record)
            if record.pool and record.state == "running":
                self.pools.adopt(record)
        self.recovery = report
        loop.create_task(self._housekeeping())
        self.pools.fill()
        log.info("engine started: %s", report.to_dict())
        return report

    async def stop(self) -> None:
        """Leave sandboxes running: a restarted engine adopts them."""
        for timer in self.timers.values():
            timer.cancel()
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

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(60)
            self._sweep_dead()
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
            self._arm_ttl(record)

    def _arm_ttl(self, record: SandboxRecord) -> None:
        loop = asyncio.get_running_loop()
        previous = self.timers.pop(record.id, None)
        if previous:
            previous.cancel()
        delay = max(0.0, record.expires_at - time.time())
        self.timers[record.id] = loop.call_later(delay, lambda: loop.create_task(self._expire(record.id)))

    async def _expire(self, sandbox_id: str) -> None:
        self.timers.pop(sandbox_id, None)
        record = self.sandboxes.get(sandbox_id)
        if record is None:
            return
        if record.expires_at > time.time() + 0.01:  # the TTL was extended
            self._arm_ttl(record)
            return
        self.counters["ttl_expired"] += 1
        try:
            await self.destroy(sandbox_id, reason="ttl expired")
        except EngineError as error:
            log.error("TTL destroy of %s failed: %s", sandbox_id, error)

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
        try:
            self.cgroups.remove(record.cgroup)
        except EngineError as error:
            log.error("removing cgroup of %s: %s", record.id, error)
        try:
            os.unlink(record.socket_path)
        except FileNotFoundError:
            pass

    # --- queries ------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        states: dict[str, int] = {}
        committed_mib = 0
        pooled = 0
        for record in self.sandboxes.values():
            if record.pool:
                pooled += 1
            else:
                states[record.state] = states.get(record.state, 0) + 1
            if record.state in LIVE_STATES:
                committed_mib += record.memory_mib
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return {
            "version": VERSION,
            "hostname": os.uname().nodename,
            "cpus": os.cpu_count(),
            "memory_mib": pages // MEBIBYTE,
            "cgroup_version": self.cgroups.version,
            "max_sandboxes": self.config.max_sandboxes,
            "sandboxes": sum(states.get(state, 0) for state in LIVE_STATES),
            "states": states,
            "pooled": pooled,
            "pools": self.pools.status(),
            "pool_claims": self.pools.claims,
            "pool_misses": self.pools.misses,
            "committed_memory_mib": committed_mib,
            "sizes": {name: vars(size) for name, size in self.config.sizes.items()},
            "counters": dict(self.counters),
            "recovery": self.recovery.to_dict() if self.recovery else None,
            "started_at": self.started_at,
            "spawner_pid": self.spawner.pid,
        }

    def _find(self, sandbox_id: Any) -> SandboxRecord:
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
            return self._find(sandbox_id).public()
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
        record = self._find(sandbox_id)
        if record.state not in ("running", "paused"):
            raise SandboxNotRunning(f"sandbox {record.id} is {record.state}", sandbox=record.id, state=record.state)
        return vars(self.cgroups.stats(record.cgroup))

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
        size_name = args.get("size")
        explicit = args.get("cpu") is not None or args.get("memory_mib") is not None
        if size_name is not None and explicit:
            raise InvalidSize("give either size or cpu and memory_mib, not both", field="size")
        if explicit:
            host_cpus = float(os.cpu_count() or 1)
            host_mib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // MEBIBYTE
            try:
                cpu = _number(args, "cpu", 1.0, 0.01, host_cpus)
                memory_mib = _number(args, "memory_mib", 512, 16, host_mib, integer=True)
            except InvalidRequest as error:
                raise InvalidSize(error.message, **error.details) from None
            size = Size(cpu=cpu, memory_mib=memory_mib, pids=max(64, min(16384, memory_mib * 2)))
            size_name = ""
        else:
            size_name = "default" if size_name is None else size_name
            if not isinstance(size_name, str) or size_name not in self.config.sizes:
                raise InvalidSize(
                    f"unknown size {str(size_name)[:40]!r}: use one of {', '.join(self.config.sizes)} or cpu and memory_mib",
                    field="size",
                    sizes=sorted(self.config.sizes),
                )
            size = self.config.sizes[size_name]
        ttl_s = _number(args, "ttl_s", self.config.default_ttl_s, 1, self.config.max_ttl_s, integer=True)
        return CreateRequest(
            sandbox_id=sandbox_id,
            explicit_id=bool(args.get("id")),
            key=key,
            template=template,
            size=size_name,
            cpu=size.cpu,
            memory_mib=size.memory_mib,
            pids=size.pids,
            disk_bytes=size.disk_bytes,
            ttl_s=ttl_s,
            env=execution.validate_env(args.get("env")),
            labels=_labels(args.get("labels")),
        )

    async def create(self, args: dict[str, Any]) -> dict[str, Any]:
        """Ensure a sandbox exists: the public create.

        Idempotent on ``id`` or ``key``: a replay gets the same sandbox (or the
        news that it is already gone), never a second one.  Without an ``id``,
        a warm pool of the template and size turns the create into a claim.
        """
        request = self.parse_create(args)
        replay = await self._replay(request)
        if replay is not None:
            return replay.public()
        if not request.explicit_id and request.size:
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
        now = time.time()
        record = SandboxRecord(
            id=request.sandbox_id,
            state="creating",
            template=request.template,
            layers=list(template.layers),
            cpu=request.cpu,
            memory_mib=request.memory_mib,
            pids_max=request.pids,
            disk_bytes=request.disk_bytes,
            cgroup=PREFIX + request.sandbox_id,
            cgroup_dirs=[],
            socket_path=str(self.config.sandbox_socket(request.sandbox_id)),
            env={**template.env, **request.env},
            labels=request.labels,
            workdir=template.workdir,
            created_at=now,
            # A pooled sandbox waits without a TTL of its own; claiming sets one.
            expires_at=now + (self.config.max_ttl_s if pool else request.ttl_s),
            size=request.size,
            pool=pool,
            key=request.key,
        )
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.busy[record.id] = done
        self.sandboxes[record.id] = record
        try:
            self.store.put_sandbox(record)
            faults.reached("create:recorded")
            await self._bring_up(record, ready=not template.services)
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
            self.counters["create_failed"] += 1
            raise
        finally:
            self.busy.pop(record.id, None)
            done.set_result(None)
        if not pool:
            self.counters["created"] += 1
        return record

    async def _bring_up(self, record: SandboxRecord, ready: bool = True) -> None:
        limits = Limits(cpu=record.cpu, memory_bytes=record.memory_mib * MEBIBYTE, pids=record.pids_max)
        try:
            procs = self.cgroups.create(record.cgroup, limits)
            record.cgroup_dirs = [str(directory) for directory in self.cgroups.directories(record.cgroup)]
            faults.reached("create:cgroup")
            spec = {
                "sandbox_id": record.id,
                "uid_base": self.config.uid_base,
                "uid_count": self.config.uid_count,
                "cgroup_procs": procs,
                "socket_path": record.socket_path,
                "rootfs": {
                    "layers_dir": str(self.config.layers_dir),
                    "lower": [layer_directory_name(layer) for layer in record.layers],
                    "scratch_dir": str(self.config.mount_dir / "scratch"),
                    "root_dir": str(self.config.mount_dir / "root"),
                    "disk_bytes": record.disk_bytes,
                    "dev_dir": str(self.config.state_dir / "dev"),
                    "empty_dir": str(self.config.mount_dir / "empty"),
                },
            }
            record.pid, record.start_time = await self.spawner.spawn(spec)
            faults.reached("create:spawned")
        except BaseException:
            self._release(record)
            raise
        if ready:
            self._ready(record)
        else:
            self.by_pid[record.pid] = record.id
            self.store.put_sandbox(record)  # its pid, for recovery to reap if we die now

    def _ready(self, record: SandboxRecord) -> None:
        record.state = "running"
        record.ready_at = time.time()
        self._track(record)
        self.store.put_sandbox(record)

    async def _start_services(self, record: SandboxRecord, wanted: builtins.list[dict[str, Any]]) -> None:
        """Start a snapshot's services and wait until each answers; on failure
        the sandbox goes (the caller records the failed create)."""
        proc = str(self.config.proc_dir)

        async def run(command: str) -> int:
            request = self.parse_exec(record, {"cmd": command, "timeout_s": 5, "max_output_bytes": 0})
            return (await execution.run(record.socket_path, request)).exit_code

        try:
            for service in wanted:
                request = self.parse_exec(
                    record, {"cmd": services.start_argv(service), "timeout_s": 10, "max_output_bytes": 4096}
                )
                started = await execution.run(record.socket_path, request)
                if started.exit_code != 0:
                    raise ServiceNotReady(
                        f"service {service['name']!r} did not start: {started.stderr.decode(errors='replace')[:500]}",
                        service=service["name"],
                    )
            await asyncio.gather(
                *(
                    services.wait_ready(service, lambda: services.netns_socket(self.kernel, proc, record.pid), run)
                    for service in wanted
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
            record = self._find(sandbox_id)
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
            self.counters["destroyed"] += 1
            self._collect_orphan_layers(record.layers)
        finally:
            self.busy.pop(record.id, None)
            done.set_result(None)
        return record.public()

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
        record = self._find(sandbox_id)
        if record.state == "paused":
            return record.public()
        if record.state != "running":
            raise SandboxNotRunning(f"sandbox {record.id} is {record.state}", sandbox=record.id, state=record.state)
        await asyncio.to_thread(self.cgroups.freeze, record.cgroup, True)
        record.state, record.paused_at = "paused", time.time()
        self.store.put_sandbox(record)
        return record.public()

    async def resume(self, sandbox_id: Any) -> dict[str, Any]:
        record = self._find(sandbox_id)
        if record.state == "running":
            return record.public()
        if record.state != "paused":
            raise SandboxNotRunning(f"sandbox {record.id} is {record.state}", sandbox=record.id, state=record.state)
        await asyncio.to_thread(self.cgroups.freeze, record.cgroup, False)
        record.state, record.paused_at = "running", 0.0
        self.store.put_sandbox(record)
        return record.public()

    # --- exec ----------------------------------------------------------------------------

    def parse_exec(self, record: SandboxRecord, args: dict[str, Any]) -> execution.ExecRequest:
        argv = execution.validate_argv(args.get("cmd"))
        cwd = args.get("cwd") or record.workdir or "/"
        if not isinstance(cwd, str) or not cwd.startswith("/") or "\0" in cwd or len(cwd) > 4096:
            raise InvalidRequest("cwd must be an absolute path", field="cwd")
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
        self, sandbox_id: Any, args: dict[str, Any], on_output: Callable[[str, bytes], None] | None = None
    ) -> execution.ExecResult:
        record = self._find(sandbox_id)
        if record.state != "running":
            raise SandboxNotRunning(
                f"sandbox {record.id} is {record.state}: it cannot run commands", sandbox=record.id, state=record.state
            )
        request = self.parse_exec(record, args)
        oom_before = self.cgroups.stats(record.cgroup).oom_kills
        self.counters["execs"] += 1
        result = await execution.run(record.socket_path, request, on_output)
        if result.signal == signal.SIGKILL and not result.timed_out:
            result.oom_killed = self.cgroups.stats(record.cgroup).oom_kills > oom_before
        return result

    # --- files ---------------------------------------------------------------------------

    def open_tree(self, sandbox_id: Any) -> Tree:
        """The sandbox's root as its init sees it; close ``tree.root_fd`` after."""
        record = self._find(sandbox_id)
        if record.state not in ("running", "paused"):
            raise SandboxNotRunning(f"sandbox {record.id} is {record.state}", sandbox=record.id, state=record.state)
        try:
            root_fd = os.open(f"{self.config.proc_dir}/{record.pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as error:
            raise SandboxNotRunning(f"sandbox {record.id} is not running", sandbox=record.id) from error
        # Checked after opening: if the pid now names another process, the
        # root we opened may be its root, not the sandbox's.
        if not init_alive(record, str(self.config.proc_dir)):
            os.close(root_fd)
            raise SandboxNotRunning(f"sandbox {record.id} is not running", sandbox=record.id)
        return Tree(root_fd, self.shift, self.kernel)

    async def with_tree(self, sandbox_id: Any, operation: Callable[[Tree], Any]) -> Any:
        tree = self.open_tree(sandbox_id)

        def run() -> Any:
            try:
                # As the sandbox's root, in this worker thread only (see
                # Kernel.filesystem_identity): new files must be ownable there.
                with self.kernel.filesystem_identity(self.config.uid_base, self.config.uid_base):
                    return operation(tree)
            finally:
                os.close(tree.root_fd)

        return await asyncio.to_thread(run)

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
