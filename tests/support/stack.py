"""The whole product running for tests: engine, Celery worker, Daphne, a database.

``FORKYARD_TEST_BACKEND`` picks the parts: ``embedded`` (the default: SQLite,
the filesystem broker, the database channel layer) or ``postgres`` (a fresh
PostgreSQL database on 127.0.0.1:5432 and Redis on 127.0.0.1:6379); a test may
ask for ``rabbitmq`` (``postgres`` with RabbitMQ on 127.0.0.1:5672 as the
broker).  Every
name the stack puts in a shared service (database, queues, Redis keys) carries
a per-session tag, so concurrent sessions never meet.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.engine import PROJECT_ROOT, EngineProcess
from tests.support.reaper import Reaper

POSTGRES_ADMIN_URL = os.environ.get("FORKYARD_TEST_POSTGRES", "postgres://postgres@127.0.0.1:5432/test")
REDIS_TEST_URL = os.environ.get("FORKYARD_TEST_REDIS", "redis://127.0.0.1:6379/0")
RABBITMQ_TEST_URL = os.environ.get("FORKYARD_TEST_RABBITMQ", "amqp://guest:guest@127.0.0.1:5672//")
SERVER_BACKENDS = ("postgres", "rabbitmq")
# The tests shorten the control plane's clocks so that a lost command or a dead
# host shows within seconds; benchmarks run with the settings' own defaults
# (what a deployment runs), since a reconciliation pass every second over
# thousands of sandboxes is load a deployment does not have.
TEST_TIMING = {"FORKYARD_RECONCILE_S": "1", "FORKYARD_HOST_STALE_S": "10", "FORKYARD_STUCK_AFTER_S": "4"}
PRODUCTION_TIMING = {"FORKYARD_RECONCILE_S": "5", "FORKYARD_HOST_STALE_S": "30", "FORKYARD_STUCK_AFTER_S": "60"}
# Every engine of a test deployment shares it (an engine on TCP asks for it first).
ENGINE_TOKEN = "test-engine-token-" + uuid.uuid4().hex


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Team:
    key: str
    team_id: str
    username: str
    password: str


@dataclass
class ExtraHost:
    name: str
    engine: EngineProcess
    worker_pid: int


@dataclass
class Stack:
    base_dir: Path
    backend: str = field(default_factory=lambda: os.environ.get("FORKYARD_TEST_BACKEND", "embedded"))
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    engine: EngineProcess | None = None
    port: int = 0
    worker_pid: int | None = None
    web_pid: int | None = None
    database: str | None = None
    teams: list[Team] = field(default_factory=list)
    extra_hosts: list[ExtraHost] = field(default_factory=list)
    timing: dict[str, str] = field(default_factory=lambda: dict(TEST_TIMING))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def host_name(self) -> str:
        return f"test-{self.tag}"

    def environment(self) -> dict[str, str]:
        assert self.engine is not None
        environment = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("FORKYARD_", "DATABASE_URL", "REDIS_URL", "CELERY_"))
        }
        environment.update(
            {
                "DJANGO_SETTINGS_MODULE": "console.settings",
                "FORKYARD_DATA_DIR": str(self.base_dir / "web"),
                "FORKYARD_ENGINE_SOCKET": str(self.engine.config.socket_path),
                "FORKYARD_ENGINE_TOKEN": ENGINE_TOKEN,
                "FORKYARD_HOST_NAME": self.host_name,
                "FORKYARD_CONTROL_QUEUE": f"control-{self.tag}",
                "FORKYARD_REDIS_PREFIX": f"fytest-{self.tag}",
                **self.timing,
                "FORKYARD_BROKER_POLL_S": "0.005",
                "FORKYARD_REGION": "test-region-1",
                "PYTHONPATH": str(PROJECT_ROOT),
            }
        )
        if self.backend in SERVER_BACKENDS:
            assert self.database is not None
            environment["DATABASE_URL"] = POSTGRES_ADMIN_URL.rsplit("/", 1)[0] + f"/{self.database}"
            environment["REDIS_URL"] = REDIS_TEST_URL
        if self.backend == "rabbitmq":
            environment["CELERY_BROKER_URL"] = RABBITMQ_TEST_URL
        return environment

    @property
    def queues(self) -> list[str]:
        """The broker queues this stack's workers consume (named after its tag)."""
        return [f"host.{self.host_name}", f"control-{self.tag}", *(f"host.{host.name}" for host in self.extra_hosts)]

    def manage(self, *args: str) -> str:
        completed = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=PROJECT_ROOT,
            env=self.environment(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        if completed.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{completed.stdout}\n{completed.stderr}")
        return completed.stdout

    def _postgres(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as connection:
            connection.execute(sql)

    def start(self) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.engine = EngineProcess(self.base_dir / "engine", tag=self.tag, warm_pools="base:tiny=4")
        self.engine.start()
        with self.engine.client() as client:
            client.call("templates.build_base", name="base", replace=True)
            client.call("pools.set", template="base", size="tiny", count=4)
        if self.backend in SERVER_BACKENDS:
            self.database = f"forkyard_test_{self.tag}"
            self._postgres(f'CREATE DATABASE "{self.database}"')
        self.manage("migrate", "-v", "0")
        # Team A runs the suite's heavy traffic; the rate-limit tests use a team of their own.
        self.teams.append(self.new_team("Team A", requests_per_second=5000))
        self.start_worker()
        self.start_web()
        self.wait_for_host()

    def new_team(self, name: str, **limits: int) -> Team:
        path = self.base_dir / f"team-{uuid.uuid4().hex[:6]}.json"
        username = f"user-{uuid.uuid4().hex[:6]}"
        self.manage("forkyard_setup", "--demo", "--team", name, "--username", username, "--key-file", str(path))
        data = json.loads(path.read_text())
        team = Team(key=data["api_key"], team_id=data["team"], username=username, password=data["password"])
        if limits:
            self.set_limits(team, **limits)
        return team

    def set_limits(self, team: Team, **limits: int) -> None:
        assignments = ", ".join(f"{name}={int(value)}" for name, value in limits.items())
        self.manage(
            "shell",
            "-c",
            f"from console.models import TeamLimits; TeamLimits.objects.filter(team_id={team.team_id!r}).update({assignments})",
        )

    def shell(self, code: str) -> str:
        return self.manage("shell", "-c", code)

    def start_worker(self) -> None:
        self.worker_pid = self._worker(f"control-{self.tag},host.{self.host_name}", self.environment(), "worker")

    def add_host(self, suffix: str = "2") -> ExtraHost:
        """Another host: its own engine, reached over TCP with the stack's token, and its own worker."""
        port = _free_port()
        engine = EngineProcess(
            self.base_dir / f"engine-{suffix}",
            tag=f"{self.tag}{suffix}",
            env={"FORKYARD_ENGINE_LISTEN": f"127.0.0.1:{port}", "FORKYARD_ENGINE_TOKEN": ENGINE_TOKEN},
        )
        engine.start()
        with engine.client() as client:
            client.call("templates.build_base", name="base", replace=True)
        name = f"{self.host_name}-{suffix}"
        environment = {
            **self.environment(),
            "FORKYARD_ENGINE_SOCKET": str(engine.config.socket_path),
            "FORKYARD_ENGINE_ADDRESS": f"tcp://127.0.0.1:{port}",
            "FORKYARD_HOST_NAME": name,
        }
        host = ExtraHost(name, engine, self._worker(f"host.{name}", environment, f"worker-{suffix}"))
        self.extra_hosts.append(host)
        return host

    def _worker(self, queues: str, environment: dict[str, str], name: str) -> int:
        log = self.base_dir / f"{name}.log"
        return Reaper.get().spawn(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "console",
                "worker",
                "-Q",
                queues,
                "--pool",
                "threads",
                "-c",
                "8",
                "-B",
                "-n",
                f"{name}-{self.tag}@%h",
                "-l",
                "info",
                "--schedule",
                str(self.base_dir / f"{name}-beat-schedule"),
            ],
            environment,
            str(PROJECT_ROOT),
            str(log),
        )

    def start_web(self) -> None:
        self.port = self.port or _free_port()
        self.web_pid = Reaper.get().spawn(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port), "console.asgi:application"],
            self.environment(),
            str(PROJECT_ROOT),
            str(self.base_dir / "web.log"),
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/api/v1/me", timeout=2).status_code == 401:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"the web server did not start:\n{(self.base_dir / 'web.log').read_text()[-3000:]}")

    def wait_for_host(self, timeout_s: float = 30, name: str | None = None) -> None:
        """Until the host (this stack's first, or ``name``) has registered and reported its templates."""
        name = name or self.host_name
        deadline = time.monotonic() + timeout_s
        with self.client() as client:
            while time.monotonic() < deadline:
                templates = client.get("/api/v1/templates").json()
                if isinstance(templates, list) and any(
                    template["name"] == "base" and name in template["hosts"] for template in templates
                ):
                    return
                time.sleep(0.1)
        raise RuntimeError(f"the host did not register:\n{(self.base_dir / 'worker.log').read_text()[-3000:]}")

    def client(self, team: Team | None = None, **options: Any) -> httpx.Client:
        team = team or self.teams[0]
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {team.key}"}, timeout=120, **options)

    def kill(self, pid: int | None) -> None:
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + 10
            while Reaper.get().status(pid) is None and time.monotonic() < deadline:
                time.sleep(0.02)

    def stop(self) -> None:
        self.kill(self.web_pid)
        self.kill(self.worker_pid)
        for host in self.extra_hosts:
            self.kill(host.worker_pid)
            host.engine.reclaim()
        if self.engine is not None:
            self.engine.reclaim()
        if self.database:
            try:
                self._postgres(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
            except Exception:  # noqa: BLE001 - cleanup must not hide the test's own failure
                pass
        if self.backend == "rabbitmq":
            import kombu

            with kombu.Connection(RABBITMQ_TEST_URL, connect_timeout=5) as connection:
                channel: Any = connection.default_channel  # kombu types it as the abstract StdChannel
                for queue in self.queues:
                    channel.queue_delete(queue)
        if self.backend in SERVER_BACKENDS:
            import redis

            client = redis.Redis.from_url(REDIS_TEST_URL)
            for key in client.scan_iter(f"*{self.tag}*"):
                client.delete(key)
        keep = os.environ.get("FORKYARD_TEST_LOGS")
        if keep:  # for a post-mortem: the processes' logs outlive the stack
            target = Path(keep) / f"stack-{self.tag}"
            target.mkdir(parents=True, exist_ok=True)
            for log in [
                *self.base_dir.glob("*.log"),
                *self.base_dir.glob("engine/*.log"),
                *self.base_dir.glob("engine/state/*.log"),
            ]:
                shutil.copy(log, target / log.name)
        shutil.rmtree(self.base_dir, ignore_errors=True)


# --- launches, through the API (for any test holding a team's client) ---------------------------


def wait_for_launch(client: httpx.Client, launch_id: str, states: set[str], timeout_s: float = 120) -> dict[str, Any]:
    """The launch once its state is one of ``states``; fails naming where it stuck."""
    deadline = time.monotonic() + timeout_s
    while True:
        launch: dict[str, Any] = client.get(f"/api/v1/launches/{launch_id}").json()
        if launch["state"] in states:
            return launch
        if time.monotonic() > deadline:
            raise AssertionError(f"launch {launch_id} stuck: {launch}")
        time.sleep(0.2)


def launch_members(client: httpx.Client, launch_id: str) -> list[dict[str, Any]]:
    """Every sandbox of a launch, all pages of them."""
    members: list[dict[str, Any]] = []
    cursor = None
    while True:
        page = client.get(f"/api/v1/launches/{launch_id}/sandboxes", params={"cursor": cursor} if cursor else {}).json()
        members += page["sandboxes"]
        cursor = page["next_cursor"]
        if not cursor:
            return members
