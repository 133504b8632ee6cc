"""Run a real engine daemon for tests, and clean up after it with recovery's own code."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from sandboxes.engine.cgroups import detect
from sandboxes.engine.client import EngineClient
from sandboxes.engine.config import EngineConfig
from sandboxes.engine.errors import Unavailable
from sandboxes.engine.model_servers import stop_recorded
from sandboxes.engine.recovery import reconcile
from sandboxes.engine.store import open_store
from tests.support.reaper import Reaper

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# Where the engine's code is taken from (another checkout, to test one
# engine against another version of the rest); this checkout by default.
ENGINE_ROOT = Path(os.environ.get("FORKYARD_TEST_ENGINE_ROOT", str(PROJECT_ROOT)))


class EngineProcess:
    """``forkyard-engine serve`` in a subprocess with its own state, run dir and cgroups."""

    def __init__(self, base_dir: Path, tag: str | None = None, warm_pools: str = "", env: dict[str, str] | None = None) -> None:
        self.warm_pools = warm_pools
        self.tag = tag or uuid.uuid4().hex[:8]
        self.extra_env = {
            # Sandboxes with a network policy: a table and a /24 of their own, so engines of other tests
            # (and a real engine on this machine) are untouched.
            "FORKYARD_ENGINE_NETWORK_TABLE": f"fytest_{self.tag}",
            "FORKYARD_ENGINE_NETWORK_POOL": f"198.19.{int(uuid.uuid4().hex[:2], 16)}.0/24",
            # The names its sandboxes' resolvers answer (a test writes the file).
            "FORKYARD_ENGINE_NETWORK_HOSTS": str(base_dir / "hosts"),
            # Its sandboxes' disks: an image of its own, small (its space is allocated up front, and a
            # test session starts dozens of engines).
            "FORKYARD_ENGINE_DISK_POOL_GIB": "4",
            **(env or {}),  # FORKYARD_ENGINE_* settings of this engine's own
        }
        self.base_dir = base_dir
        self.config = EngineConfig.from_environment(
            self.extra_env,
            state_dir=base_dir / "state",
            run_dir=base_dir / "run",
            cgroup_parent=f"forkyard-test-{self.tag}",
        )
        self.engine_pid: int | None = None
        self.log_path = base_dir / "engine.log"

    def environment(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        environment = dict(os.environ)
        environment.update(
            {
                "FORKYARD_ENGINE_STATE_DIR": str(self.config.state_dir),
                "FORKYARD_ENGINE_RUN_DIR": str(self.config.run_dir),
                "FORKYARD_ENGINE_CGROUP_PARENT": self.config.cgroup_parent,
                # Off unless a test asks: pooled sandboxes would show up in every count.
                "FORKYARD_ENGINE_WARM_POOLS": self.warm_pools,
                "PYTHONPATH": str(PROJECT_ROOT),
            }
        )
        environment.pop("FORKYARD_ENGINE_CRASH_AT", None)
        environment.update(self.extra_env)
        environment.update(extra or {})
        return environment

    def start(self, crash_at: str | None = None, timeout_s: float = 30.0) -> None:
        extra = {"FORKYARD_ENGINE_CRASH_AT": crash_at} if crash_at else {}
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.reaper = Reaper.get()
        self.engine_pid = self.reaper.spawn(
            [sys.executable, "-m", "sandboxes.engine", "serve"], self.environment(extra), str(ENGINE_ROOT), str(self.log_path)
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.reaper.status(self.engine_pid) is not None:
                raise RuntimeError(f"engine exited at start:\n{self.log_path.read_text()[-3000:]}")
            try:
                with self.client() as client:
                    client.ping()
                return
            except Unavailable:
                time.sleep(0.05)
        raise RuntimeError(f"engine did not start:\n{self.log_path.read_text()[-3000:]}")

    def client(self, timeout_s: float | None = 120.0) -> EngineClient:
        return EngineClient(self.config.socket_path, timeout_s=timeout_s)

    @property
    def pid(self) -> int:
        assert self.engine_pid is not None
        return self.engine_pid

    def running(self) -> bool:
        return self.engine_pid is not None and self.reaper.status(self.engine_pid) is None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.running():
            os.kill(self.pid, signal.SIGKILL)
            self.wait_exit(10)

    def stop(self) -> None:
        if self.running():
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.wait_exit(10)
            except TimeoutError:
                self.kill()

    def wait_exit(self, timeout_s: float = 30.0) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = self.reaper.status(self.pid)
            if status is not None:
                return status
            time.sleep(0.02)
        raise TimeoutError(f"engine {self.pid} still running after {timeout_s}s")

    def spawner_pid(self) -> int | None:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        connection.settimeout(2)
        try:
            connection.connect(str(self.config.spawner_socket_path))
            connection.send(b'{"op": "ping", "request_id": 0}')
            import json

            return int(json.loads(connection.recv(65536))["pid"])
        except (OSError, ValueError, KeyError):
            return None
        finally:
            connection.close()

    def reclaim(self) -> dict[str, Any]:
        """Stop everything and remove every trace, with recovery's own code."""
        self.stop()
        spawner = self.spawner_pid()
        store = open_store(self.config.database_path)
        cgroups = detect(self.config)
        report, _ = reconcile(self.config, store, cgroups, adopt=False)
        store.close()
        stop_recorded(self.config.state_dir)  # dedicated endpoints' servers outlive an engine by design
        if spawner:
            try:
                os.kill(spawner, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for directory in getattr(cgroups, "parents", {}).values():
            _remove_tree(directory)
        if hasattr(cgroups, "parent"):
            _remove_tree(cgroups.parent)
        return report.to_dict()

    def remove_files(self) -> None:
        shutil.rmtree(self.base_dir, ignore_errors=True)


def _remove_tree(path: Path) -> None:
    """rmdir a cgroup parent bottom-up (cgroupfs only allows rmdir)."""
    if not path.exists():
        return
    for child in sorted(path.rglob("*"), key=lambda item: len(str(item)), reverse=True):
        if child.is_dir():
            try:
                child.rmdir()
            except OSError:
                pass
    try:
        path.rmdir()
    except OSError:
        pass
