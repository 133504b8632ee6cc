"""Model servers: the host processes behind dedicated inference endpoints, supervised by the engine.

A dedicated endpoint is a model server (an OpenAI-compatible HTTP server
holding one open model) running on a host, outside any sandbox: a sandbox
sees no GPU, and the server is the host's, not a tenant's. The engine runs
it because the engine is what a host keeps alive and reconciles: it outlives
the Celery worker that asked for it, and a restarted engine adopts the
servers it left running, as it adopts sandboxes.

What it does, in the order the code runs it:

1. ``ensure(spec)`` checks the spec (a kind the engine knows, a model file
   that exists, a served name, a token), takes a free port on
   ``model_server_host`` and records the server in ``model-servers.json``
   (0600, beside the engine's record: it holds the token) before starting
   it, so a crash in between leaves a record to act on, not an orphan.
2. The server is started from an argv the engine builds itself from the
   kind (``_argv``): never one a caller sent. ``llama_cpp`` is
   ``sandboxes/engine/llama_server.py`` (llama.cpp through llama-cpp-python,
   for CPU hosts); ``vllm`` is vLLM's OpenAI server (GPU hosts). It runs in
   a session of its own, its output to ``model-servers/<id>.log`` (the
   server logs no prompt). The llama.cpp server starts as root (the
   interpreter may live where only root can read, as under ``/root``),
   loads its model, then drops to ``model_server_user`` (``nobody``: no
   groups, no capabilities) before it takes a request; vLLM is started as
   that user directly.
3. A monitor task watches it through a pidfd (readable once it exits,
   whoever reaps it: the engine reaps every child), and polls ``/health``
   with the token: ``starting`` until it answers, then ``ready``. A server
   that exits, or stops answering for ``HUNG_AFTER`` polls, is killed and
   started again after a backoff (``restarts`` counts); one that never
   came up ``GIVE_UP_AFTER`` times in a row is ``failed``, with its log's
   last line as the reason.
4. ``remove(id)`` ends the monitor, sends SIGTERM (SIGKILL after
   ``STOP_GRACE_S``) and forgets the record.
5. At engine start (``start``) each recorded server still alive (same pid,
   same start time, its command line naming its id) is adopted; the others
   are started again.  At engine stop, servers are left running.

No Django here: the control plane drives it through the engine's socket
(``model_servers.ensure``, ``.remove``, ``.list``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import InvalidRequest, NotFound

log = logging.getLogger("forkyard.engine.model_servers")

KINDS = ("llama_cpp", "vllm")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,99}$")
IDENTIFIER = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
POLL_S = 0.25  # health polls while starting
WATCH_S = 5.0  # health polls while ready
HUNG_AFTER = 3  # unanswered polls in a row before a ready server is restarted
GIVE_UP_AFTER = 5  # starts in a row that never became ready
START_TIMEOUT_S = 600.0  # a start that has not answered by then counts as one that failed
BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
STOP_GRACE_S = 5.0
PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ServerRecord:
    """One model server as the engine keeps it (``model-servers.json``)."""

    id: str
    kind: str
    model: str
    name: str
    token: str
    context_length: int = 2048
    threads: int = 0
    port: int = 0
    pid: int = 0
    started: float = 0.0  # the process's start time (/proc/<pid>/stat), to know it again after a restart
    state: str = "starting"  # starting, ready, restarting, failed
    restarts: int = 0
    failures: int = 0  # starts in a row that never became ready
    reason: str = ""
    ready_at: float | None = None
    created_at: float = field(default_factory=time.time)

    def public(self, host: str) -> dict[str, Any]:
        """What the engine answers about it (never the token)."""
        return {
            "id": self.id,
            "kind": self.kind,
            "model": self.model,
            "name": self.name,
            "address": f"http://{host}:{self.port}",
            "pid": self.pid,
            "state": self.state,
            "restarts": self.restarts,
            "reason": self.reason,
            "ready_at": self.ready_at,
            "created_at": self.created_at,
        }


def _process_start(proc_dir: str, pid: int) -> float:
    """Its start time in clock ticks since boot (0 if gone): a pid reused by another process has another."""
    try:
        stat = Path(proc_dir, str(pid), "stat").read_text()
    except OSError:
        return 0.0
    return float(stat.rsplit(")", 1)[1].split()[19])


def _command_line(proc_dir: str, pid: int) -> list[str]:
    try:
        return Path(proc_dir, str(pid), "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


async def _healthy(host: str, port: int, token: str, timeout_s: float = 2.0) -> bool:
    """GET /health with the token answers 200."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, TimeoutError):
        return False
    try:
        request = f"GET /health HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n"
        writer.write(request.encode())
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), timeout_s)
        return status_line.split(b" ")[1:2] == [b"200"]
    except (OSError, TimeoutError, IndexError):
        return False
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def stop_recorded(state_dir: Path, proc_dir: str = "/proc") -> int:
    """Kill every recorded model server still running and forget them (an engine's state taken away for good:
    the tests' and benchmarks' reclaim); how many were running."""
    record_path = state_dir / "model-servers.json"
    try:
        servers = json.loads(record_path.read_text()).get("servers", [])
    except (OSError, ValueError):
        return 0
    killed = 0
    for server in servers:
        pid = int(server.get("pid") or 0)
        alive = pid and _process_start(proc_dir, pid) == server.get("started")
        if alive and f"--server-id={server.get('id')}" in _command_line(proc_dir, pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
                killed += 1
    record_path.unlink(missing_ok=True)
    return killed


class ModelServers:
    """Every model server on this host: started, watched, restarted, stopped; recorded across restarts."""

    def __init__(
        self,
        state_dir: Path,
        host: str,
        user: str,
        pidfd_open: Callable[[int], int],
        proc_dir: str = "/proc",
        vllm_command: str = "",
    ) -> None:
        self.directory = state_dir / "model-servers"
        self.record_path = state_dir / "model-servers.json"
        self.host = host
        self.user = user
        self.proc_dir = proc_dir
        self.vllm_command = vllm_command
        self._pidfd_open = pidfd_open
        self.servers: dict[str, ServerRecord] = {}
        self._monitors: dict[str, asyncio.Task[None]] = {}
        self._processes: dict[str, subprocess.Popen[bytes]] = {}

    # --- the record ----------------------------------------------------------------

    def _load(self) -> list[ServerRecord]:
        try:
            raw = json.loads(self.record_path.read_text())
        except FileNotFoundError:
            return []
        except ValueError:
            log.error("model server record %s is corrupt: set aside", self.record_path)
            self.record_path.rename(self.record_path.with_suffix(".corrupt"))
            return []
        known = set(ServerRecord.__dataclass_fields__)
        return [ServerRecord(**{k: v for k, v in item.items() if k in known}) for item in raw.get("servers", [])]

    def _save(self) -> None:
        partial = self.record_path.with_suffix(".partial")
        with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as handle:
            json.dump({"servers": [asdict(record) for record in self.servers.values()]}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, self.record_path)

    # --- the engine's calls ----------------------------------------------------------

    async def start(self) -> dict[str, int]:
        """Adopt the recorded servers still running; start again those that are not."""
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        counts = {"adopted": 0, "restarted": 0}
        for record in self._load():
            self.servers[record.id] = record
            if record.state == "failed":
                continue
            alive = record.pid and _process_start(self.proc_dir, record.pid) == record.started
            if alive and f"--server-id={record.id}" in _command_line(self.proc_dir, record.pid):
                counts["adopted"] += 1
                self._monitors[record.id] = asyncio.ensure_future(self._monitor(record, adopted=True))
            else:
                counts["restarted"] += 1
                record.state = "restarting"
                self._monitors[record.id] = asyncio.ensure_future(self._monitor(record))
        self._save()
        return counts

    def listed(self) -> list[dict[str, Any]]:
        return [record.public(self.host) for record in self.servers.values()]

    def get(self, server_id: str) -> dict[str, Any]:
        record = self.servers.get(server_id)
        if record is None:
            raise NotFound(f"no model server {server_id[:80]!r}", id=server_id)
        return record.public(self.host)

    async def ensure(self, args: dict[str, Any]) -> dict[str, Any]:
        """The server ``args['id']`` running (started if it is not): idempotent, a replay returns it as it is."""
        record = self._checked(args)
        existing = self.servers.get(record.id)
        if existing is not None:
            return existing.public(self.host)
        record.port = _free_port(self.host)
        self.servers[record.id] = record
        self._save()
        self._monitors[record.id] = asyncio.ensure_future(self._monitor(record))
        return record.public(self.host)

    async def remove(self, server_id: str) -> dict[str, Any]:
        """The server stopped and forgotten; removing one that is not here is done already."""
        record = self.servers.pop(server_id, None)
        if record is None:
            return {"id": server_id, "removed": False}
        monitor = self._monitors.pop(server_id, None)
        if monitor is not None:
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await monitor
        await self._stop_process(record)
        await asyncio.to_thread(shutil.rmtree, self.cache_directory(record), True)  # a vLLM server's caches
        self._save()
        return {"id": server_id, "removed": True}

    def close(self) -> None:
        """The engine stops: stop watching, leave the servers running (the next engine adopts them)."""
        for monitor in self._monitors.values():
            monitor.cancel()
        self._monitors.clear()

    # --- checks and the command line ----------------------------------------------------

    def _checked(self, args: dict[str, Any]) -> ServerRecord:
        server_id, kind, model, name, token = (args.get(key) for key in ("id", "kind", "model", "name", "token"))
        if not isinstance(server_id, str) or not IDENTIFIER.match(server_id):
            raise InvalidRequest("id must be 1-64 letters, digits, '_' or '-'", field="id")
        if kind not in KINDS:
            raise InvalidRequest(f"kind must be one of {', '.join(KINDS)}", field="kind")
        if not isinstance(model, str) or not os.path.isabs(model) or not os.path.exists(model):
            raise InvalidRequest(f"model {str(model)[:200]!r} is not a file or directory on this host", field="model")
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidRequest("name must be 1-100 letters, digits or ._:/-", field="name")
        if not isinstance(token, str) or len(token) < 16:
            raise InvalidRequest("token must be at least 16 characters", field="token")
        numbers: dict[str, int] = {}
        for key, default, top in (("context_length", 2048, 1 << 20), ("threads", 0, 1024)):
            value = args.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
                raise InvalidRequest(f"{key} must be an integer from 0 to {top}", field=key)
            numbers[key] = value
        return ServerRecord(
            id=server_id,
            kind=kind,
            model=model,
            name=name,
            token=token,
            context_length=numbers["context_length"],
            threads=numbers["threads"],
        )

    def _argv(self, record: ServerRecord) -> tuple[list[str], dict[str, str]]:
        """The server's command line and environment, built from its kind (never from a caller's argv)."""
        environment = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/nonexistent", "PYTHONPATH": str(PROJECT_ROOT)}
        if record.kind == "llama_cpp":
            argv = [sys.executable, "-m", "sandboxes.engine.llama_server"]
            argv += ["--model", record.model, "--name", record.name, "--host", self.host, "--port", str(record.port)]
            argv += ["--context", str(record.context_length), "--threads", str(record.threads)]
            if self.user and os.geteuid() == 0:
                argv += ["--user", self.user]  # it drops to this user once its model is loaded
            environment["FORKYARD_MODEL_SERVER_TOKEN"] = record.token
        else:
            # vLLM's OpenAI server (GPU hosts): the same HTTP interface, its own guided decoding for json_schema.
            argv = [*(self.vllm_command.split() or [sys.executable, "-m", "vllm.entrypoints.openai.api_server"])]
            argv += ["--model", record.model, "--served-model-name", record.name, "--host", self.host, "--port", str(record.port)]
            argv += ["--max-model-len", str(record.context_length)]
            environment["VLLM_API_KEY"] = record.token
            # No prompt in its log: request logging is off by default since vLLM 0.10, and its old switch
            # (--disable-log-requests) is gone since 0.12, where passing it stops the server from starting;
            # releases before 0.10 log requests at INFO, which this level leaves out.
            environment["VLLM_LOGGING_LEVEL"] = "WARNING"
            # Its caches (compiled kernels, the hub's files) in a directory of its own that its user owns:
            # it runs as model_server_user, whose home is /nonexistent.
            cache = str(self.cache_directory(record))
            environment.update(XDG_CACHE_HOME=cache, VLLM_CACHE_ROOT=f"{cache}/vllm", HF_HOME=f"{cache}/huggingface")
        return [*argv, f"--server-id={record.id}"], environment

    def cache_directory(self, record: ServerRecord) -> Path:
        """Where a vLLM server keeps its caches: made (owned by its user) before it starts, removed with it."""
        return self.directory / f"{record.id}.cache"

    # --- running one -------------------------------------------------------------------

    def _spawn(self, record: ServerRecord) -> None:
        argv, environment = self._argv(record)
        self.directory.mkdir(parents=True, exist_ok=True)
        log_path = self.directory / f"{record.id}.log"
        with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as output:
            user = pwd.getpwnam(self.user) if self.user and os.geteuid() == 0 and record.kind == "vllm" else None
            if record.kind == "vllm":
                cache = self.cache_directory(record)
                cache.mkdir(mode=0o700, exist_ok=True)
                if user is not None:
                    os.chown(cache, user.pw_uid, user.pw_gid)
            process = subprocess.Popen(  # noqa: S603 - argv built above from the kind, not from a caller
                argv,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                env=environment,
                cwd=str(PROJECT_ROOT),
                start_new_session=True,
                user=user.pw_uid if user else None,
                group=user.pw_gid if user else None,
                extra_groups=[] if user else None,
            )
        self._processes[record.id] = process
        record.pid = process.pid
        record.started = _process_start(self.proc_dir, process.pid)
        self._save()

    async def _wait_exit(self, pid: int, timeout_s: float | None) -> bool:
        """Until ``pid`` exits (True) or ``timeout_s`` passes (False)."""
        try:
            pidfd = self._pidfd_open(pid)
        except OSError:
            return True  # gone already
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[bool] = loop.create_future()

        def readable() -> None:
            if not exited.done():
                exited.set_result(True)

        loop.add_reader(pidfd, readable)
        try:
            return bool(await asyncio.wait_for(exited, timeout_s))
        except TimeoutError:
            return False
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)

    def _reap(self, record: ServerRecord) -> None:
        process = self._processes.pop(record.id, None)
        if process is not None:
            with contextlib.suppress(ChildProcessError, OSError):
                process.poll()  # the engine's own reaper may have reaped it first

    async def _stop_process(self, record: ServerRecord) -> None:
        if not record.pid or _process_start(self.proc_dir, record.pid) != record.started:
            self._reap(record)
            return
        for signal_number, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(record.pid, signal_number)  # the server and whatever it started
            if await self._wait_exit(record.pid, wait_s):
                break
        self._reap(record)

    def _last_line(self, record: ServerRecord) -> str:
        try:
            lines = (self.directory / f"{record.id}.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1][-300:] if lines else ""

    async def _monitor(self, record: ServerRecord, adopted: bool = False) -> None:
        """Keep ``record``'s server running and its state true, until it is removed."""
        while True:
            came_up = False
            try:
                if not adopted:
                    self._spawn(record)
                adopted = False
                came_up = await self._watch(record)
            except OSError as error:  # it could not be started at all (a missing interpreter, no permission)
                record.reason = f"could not start: {error}"
                log.error("model server %s %s", record.id, record.reason)
            await self._stop_process(record)  # exited, hung or never answered: make sure nothing is left
            if came_up:
                record.failures = 0
            else:
                record.failures += 1
            if record.failures >= GIVE_UP_AFTER:
                record.state, record.reason = "failed", record.reason or self._last_line(record) or "it never answered"
                log.error("model server %s failed: %s", record.id, record.reason)
                self._save()
                return
            record.restarts += 1
            record.state = "restarting"
            self._save()
            log.warning("model server %s restarts (%d so far)", record.id, record.restarts)
            await asyncio.sleep(BACKOFF_S[min(record.failures, len(BACKOFF_S) - 1)])

    async def _watch(self, record: ServerRecord) -> bool:
        """Until the server exits or hangs; True if it was ready meanwhile."""
        exited = asyncio.ensure_future(self._wait_exit(record.pid, None))
        try:
            came_up = record.state == "ready"
            deadline = time.monotonic() + START_TIMEOUT_S
            unanswered = 0
            while not exited.done():
                if await _healthy(self.host, record.port, record.token):
                    unanswered = 0
                    if record.state != "ready":
                        record.state, record.reason, record.ready_at = "ready", "", time.time()
                        self._save()
                    came_up = True
                elif came_up:
                    unanswered += 1
                    if unanswered >= HUNG_AFTER:
                        log.warning("model server %s stopped answering", record.id)
                        return True
                elif time.monotonic() > deadline:
                    return False
                else:
                    if record.state != "starting":
                        record.state = "starting"
                        self._save()
                await asyncio.wait((exited,), timeout=WATCH_S if came_up else POLL_S)
            return came_up
        finally:
            exited.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await exited
