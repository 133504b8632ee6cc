"""The engine's link to its spawner: start or adopt it, ask it to create.

On engine start an already running spawner of the same version is adopted
(its sandboxes' init processes stay its children); one of another version is
asked to retire (it exits once its last sandbox is gone) and a new one is
started.  The spawner reports every init it reaps, so the engine needs no
per-sandbox file descriptor to notice a sandbox dying.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import EngineConfig
from .errors import CreateFailed, Unavailable
from .seccomp import compile_filter

log = logging.getLogger("forkyard.engine.spawner")
PROJECT_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 30.0


def version_of(init_binary: Path) -> str:
    """Identifies the engine's code and init binary: a restarted engine reuses
    a running spawner only if nothing changed."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")) + [init_binary]:
        try:
            digest.update(path.read_bytes())
        except OSError:
            digest.update(b"missing")
    return digest.hexdigest()[:16]


def _environment(config: EngineConfig, version: str, seccomp_path: Path) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "FORKYARD_ENGINE_RUN_DIR": str(config.run_dir),
        "FORKYARD_ENGINE_INIT_BINARY": str(config.init_binary),
        "FORKYARD_SPAWNER_SECCOMP": str(seccomp_path),
        "FORKYARD_SPAWNER_VERSION": version,
    }


class SpawnerClient:
    def __init__(self, config: EngineConfig, on_exit: Callable[[int, int], None]) -> None:
        self.config = config
        self.on_exit = on_exit
        self.connection: socket.socket | None = None
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.ids = itertools.count(1)
        self.reader: asyncio.Task[None] | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.pid = 0
        self.on_lost: Callable[[], None] | None = None

    # --- lifecycle ------------------------------------------------------------

    def _connect_blocking(self) -> socket.socket | None:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            connection.connect(str(self.config.spawner_socket_path))
        except OSError:
            connection.close()
            return None
        return connection

    def _ask_blocking(self, connection: socket.socket, message: dict[str, Any]) -> dict[str, Any] | None:
        connection.settimeout(5.0)
        try:
            connection.send(json.dumps(message).encode())
            while True:
                reply = json.loads(connection.recv(1 << 20))
                if "event" not in reply:
                    return dict(reply)
        except (OSError, ValueError):
            return None

    def start(self) -> None:
        """Adopt a running spawner of our version, or start a new one."""
        program = compile_filter()
        wanted = version_of(self.config.init_binary) + hashlib.sha256(program).hexdigest()[:8]
        existing = self._connect_blocking()
        if existing is not None:
            reply = self._ask_blocking(existing, {"op": "ping", "request_id": 0})
            if reply and reply.get("version") == wanted:
                log.info("adopted spawner %s with %s children", reply.get("pid"), reply.get("children"))
                self.pid = int(reply["pid"])
                self._attach(existing)
                return
            if reply:
                log.info("retiring spawner %s (version %s, want %s)", reply.get("pid"), reply.get("version"), wanted)
                self._ask_blocking(existing, {"op": "retire", "request_id": 0})
            existing.close()
        self.config.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        seccomp_path = self.config.run_dir / "seccomp.bpf"
        seccomp_path.write_bytes(program)
        log_path = self.config.state_dir / "spawner.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log_file:
            # Its own session: a signal to the engine's process group (or the
            # engine's death) does not take the spawner and its sandboxes along.
            # -S: no site packages, a smaller heap for every clone to copy.
            self.process = subprocess.Popen(
                [sys.executable, "-S", "-m", "sandboxes.engine.spawner"],
                env=_environment(self.config, wanted, seccomp_path),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                start_new_session=True,
                close_fds=True,
                cwd=str(PROJECT_ROOT),
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise Unavailable(f"the spawner exited at start; see {log_path}", log=str(log_path))
            connection = self._connect_blocking()
            if connection is not None:
                reply = self._ask_blocking(connection, {"op": "ping", "request_id": 0})
                if reply and reply.get("version") == wanted:
                    self.pid = int(reply["pid"])
                    self._attach(connection)
                    return
                connection.close()
            time.sleep(0.02)
        raise Unavailable(f"the spawner did not start within {START_TIMEOUT_S}s; see {log_path}")

    def _attach(self, connection: socket.socket) -> None:
        connection.setblocking(False)
        self.connection = connection
        self.reader = asyncio.get_running_loop().create_task(self._read_loop(connection))

    async def _read_loop(self, connection: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                raw = await loop.sock_recv(connection, 1 << 20)
            except OSError:
                raw = b""
            if not raw:
                break
            try:
                message = json.loads(raw)
            except ValueError:
                continue
            if message.get("event") == "exited":
                self.on_exit(int(message["pid"]), int(message.get("status", 0)))
                continue
            future = self.pending.pop(message.get("request_id"), None)
            if future is not None and not future.done():
                future.set_result(message)
        if self.connection is not connection:
            return  # an old connection, already replaced
        for future in self.pending.values():
            if not future.done():
                future.set_exception(Unavailable("the spawner went away"))
        self.pending.clear()
        self.connection = None
        connection.close()
        if self.on_lost is not None:
            self.on_lost()

    def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
        if self.connection is not None:
            self.connection.close()
            self.connection = None

    # --- requests ---------------------------------------------------------------

    async def request(self, message: dict[str, Any]) -> dict[str, Any]:
        if self.connection is None:
            raise Unavailable("the spawner is not connected")
        request_id = next(self.ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[request_id] = future
        await asyncio.get_running_loop().sock_sendall(self.connection, json.dumps({**message, "request_id": request_id}).encode())
        return await future

    async def spawn(self, spec: dict[str, Any]) -> tuple[int, int]:
        reply = await self.request({"op": "spawn", "spec": spec})
        if not reply.get("ok"):
            error = reply.get("error") or {}
            raise CreateFailed(
                f"creating sandbox {spec.get('sandbox_id')} failed at '{error.get('step')}': {error.get('message')}",
                sandbox=spec.get("sandbox_id"),
                step=error.get("step"),
                target=error.get("target"),
                errno=error.get("errno"),
            )
        return int(reply["pid"]), int(reply["start_time"])
