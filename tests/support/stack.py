"""The whole product running for tests: engine, Celery worker, Daphne, a database.

``FORKYARD_TEST_BACKEND`` picks the parts: ``embedded`` (the default: SQLite,
the filesystem broker, the database channel layer) or ``postgres`` (a fresh
PostgreSQL database on 127.0.0.1:5432 and Redis on 127.0.0.1:6379); a test may
ask for ``rabbitmq`` (``postgres`` with RabbitMQ on 127.0.0.1:5672 as the
broker).  Every
name the stack puts in a shared service (database, queues, Redis keys) carries
a per-session tag, so concurrent sessions never meet.

A stack is one host unless asked for more (``hosts=N``, or ``add_host``): each
further host is an engine of its own (its state directory, cgroup parent,
network pool and table, socket, and a TCP listener the others reach it by)
with its own bulk and interactive workers on its own queues, as a second
machine would run them.  ``engine_env`` sets every engine's
``FORKYARD_ENGINE_*`` (a small ``MAX_SANDBOXES``), ``env`` every control-plane
process's settings (``FORKYARD_MEMORY_OVERCOMMIT``, ``FORKYARD_LAUNCH_CHUNK``).
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
from collections.abc import Iterator
from contextlib import contextmanager
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
    interactive_worker_pid: int | None = None
    suffix: str = ""  # its processes' logs: worker-<suffix>.log, interactive-<suffix>.log
    address: str = ""  # how the others reach its engine (tcp://...)


@dataclass
class Stack:
    base_dir: Path
    backend: str = field(default_factory=lambda: os.environ.get("FORKYARD_TEST_BACKEND", "embedded"))
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    engine: EngineProcess | None = None
    port: int = 0  # HTTP: the API and the console (uvicorn)
    ws_port: int = 0  # the board's websockets (Daphne)
    worker_pid: int | None = None
    interactive_worker_pid: int | None = None  # the host's interactive lane (sandboxes.commands)
    web_pid: int | None = None
    extra_web_pids: list[int] = field(default_factory=list)
    board_pid: int | None = None
    database: str | None = None
    teams: list[Team] = field(default_factory=list)
    extra_hosts: list[ExtraHost] = field(default_factory=list)
    timing: dict[str, str] = field(default_factory=lambda: dict(TEST_TIMING))
    hosts: int = 1  # how many hosts start() brings up, the first included
    engine_env: dict[str, str] = field(default_factory=dict)  # FORKYARD_ENGINE_* of every engine it starts
    env: dict[str, str] = field(default_factory=dict)  # settings of every control-plane process (web, workers)
    warm_pools: str = "base:tiny=4"  # the first host's

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
                "FORKYARD_WEBSOCKET_PORT": str(self.ws_port),
                "PYTHONPATH": str(PROJECT_ROOT),
                **self.env,
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
        hosts = [self.host_name, *(host.name for host in self.extra_hosts)]
        return [f"control-{self.tag}", *(f"host.{name}" for name in hosts), *(f"host.{name}.interactive" for name in hosts)]

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
        self.engine = EngineProcess(self.base_dir / "engine", tag=self.tag, warm_pools=self.warm_pools, env=self.engine_env)
        self.engine.start()
        with self.engine.client() as client:
            client.call("templates.build_base", name="base", replace=True)
            for item in filter(None, self.warm_pools.split(",")):
                key, _, count = item.partition("=")
                template, _, size = key.partition(":")
                client.call("pools.set", template=template, size=size, count=int(count))
        if self.backend in SERVER_BACKENDS:
            self.database = f"forkyard_test_{self.tag}"
            self._postgres(f'CREATE DATABASE "{self.database}"')
        self.manage("migrate", "-v", "0")
        # Team A runs the suite's heavy traffic; the rate-limit tests use a team of their own.
        self.teams.append(self.new_team("Team A", requests_per_second=5000))
        self.start_worker()
        self.start_interactive_worker()
        for number in range(2, self.hosts + 1):
            self.add_host(str(number))  # its engine made while the first host's workers start
        self.start_web()
        self.wait_for_host()
        self.wait_for_worker("interactive")
        for host in self.extra_hosts:
            self.wait_for_host(name=host.name, log=f"worker-{host.suffix}")
            self.wait_for_worker(f"interactive-{host.suffix}")

    def new_team(self, name: str, **limits: int) -> Team:
        path = self.base_dir / f"team-{uuid.uuid4().hex[:6]}.json"
        username = f"user-{uuid.uuid4().hex[:6]}"
        self.manage("forkyard_setup", "--demo", "--team", name, "--username", username, "--key-file", str(path))
        data = json.loads(path.read_text())
        team = Team(key=data["api_key"], team_id=data["team"], username=username, password=data["password"])
        if limits:
            self.set_limits(team, trusted=False, **limits)
        return team

    def set_limits(self, team: Team, trusted: bool = True, **limits: int) -> None:
        """``trusted``: the team's key may have been used already (not for a team just made)."""
        assignments = ", ".join(f"{name}={int(value)}" for name, value in limits.items())
        self.manage(
            "shell",
            "-c",
            f"from console.models import TeamLimits; TeamLimits.objects.filter(team_id={team.team_id!r}).update({assignments})",
        )
        # A web server trusts a key it checked, with its team's limits, for console.keys.RECENT_S (5 s), and
        # this change came from another process: wait that out, or the next request may see the old limits.
        if trusted:
            time.sleep(5.0)

    def shell(self, code: str) -> str:
        return self.manage("shell", "-c", code)

    def start_worker(self) -> None:
        """The host's bulk worker (control and host lanes), with its host agent and beat, as scripts/up runs it."""
        self.worker_pid = self._worker(f"control-{self.tag},host.{self.host_name}", self.environment(), "worker")

    def start_interactive_worker(self) -> None:
        """The host's interactive worker: its own process and pool, for the host's interactive lane only."""
        self.interactive_worker_pid = self._interactive_worker(self.host_name, self.environment(), "interactive")

    def add_host(self, suffix: str = "2") -> ExtraHost:
        """Another host: its own engine, reached over TCP with the stack's token, and its own workers (on
        ``host.<name>`` and its interactive lane); call ``wait_for_host(name=...)`` before placing on it."""
        port = _free_port()
        engine = EngineProcess(
            self.base_dir / f"engine-{suffix}",
            tag=f"{self.tag}{suffix}",
            env={**self.engine_env, "FORKYARD_ENGINE_LISTEN": f"127.0.0.1:{port}", "FORKYARD_ENGINE_TOKEN": ENGINE_TOKEN},
        )
        engine.start()
        with engine.client() as client:
            client.call("templates.build_base", name="base", replace=True)
        name = f"{self.host_name}-{suffix}"
        host = ExtraHost(name, engine, 0, suffix=suffix, address=f"tcp://127.0.0.1:{port}")
        self.start_host_workers(host)
        self.extra_hosts.append(host)
        return host

    def host_environment(self, host: ExtraHost) -> dict[str, str]:
        """A further host's workers' environment: the stack's, naming that host and its engine."""
        return {
            **self.environment(),
            "FORKYARD_ENGINE_SOCKET": str(host.engine.config.socket_path),
            "FORKYARD_ENGINE_ADDRESS": host.address,
            "FORKYARD_HOST_NAME": host.name,
        }

    def start_host_workers(self, host: ExtraHost) -> None:
        """A further host's bulk worker (its host agent and beat with it) and its interactive worker."""
        environment = self.host_environment(host)
        host.worker_pid = self._worker(f"host.{host.name}", environment, f"worker-{host.suffix}")
        host.interactive_worker_pid = self._interactive_worker(host.name, environment, f"interactive-{host.suffix}")

    def stop_host_workers(self, host: ExtraHost) -> None:
        """Both its workers killed (SIGKILL), as a machine that went away: its heartbeat stops with them."""
        self.kill(host.worker_pid)
        self.kill(host.interactive_worker_pid)

    def engines(self) -> dict[str, EngineProcess]:
        """Every host's engine, by host name."""
        assert self.engine is not None
        return {self.host_name: self.engine, **{host.name: host.engine for host in self.extra_hosts}}

    def held_by_engines(self, launch_id: str) -> dict[str, int]:
        """How many of a launch's sandboxes each host's engine itself holds (what the kernel runs, not the rows)."""
        held = {}
        for name, engine in self.engines().items():
            with engine.client() as direct:
                held[name] = sum(1 for sandbox in direct.list() if sandbox["labels"].get("launch") == launch_id)
        return held

    def _worker(self, queues: str, environment: dict[str, str], name: str) -> int:
        beat = ["-B", "--schedule", str(self.base_dir / f"{name}-beat-schedule")]
        return self._celery_worker(queues, environment, name, "8", beat)

    def _interactive_worker(self, host_name: str, environment: dict[str, str], name: str) -> int:
        """No host agent and no beat: the bulk worker runs those."""
        return self._celery_worker(f"host.{host_name}.interactive", {**environment, "FORKYARD_HOST_AGENT": "0"}, name, "4", [])

    def _celery_worker(self, queues: str, environment: dict[str, str], name: str, threads: str, extra: list[str]) -> int:
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
                threads,
                "-n",
                f"{name}-{self.tag}@%h",
                "-l",
                "info",
                *extra,
            ],
            environment,
            str(PROJECT_ROOT),
            str(log),
        )

    def start_web(self) -> None:
        """The HTTP server (uvicorn: the API and the console) and the board's websockets (Daphne), as scripts/up runs them."""
        self.port = self.port or _free_port()
        self.ws_port = self.ws_port or _free_port()
        self.board_pid = Reaper.get().spawn(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.ws_port), "console.asgi:websocket_application"],
            self.environment(),
            str(PROJECT_ROOT),
            str(self.base_dir / "board.log"),
        )
        self.web_pid = self._spawn_web(self.port, self.environment(), self.base_dir / "web.log")

    def restart_web(self, environment: dict[str, str] | None = None) -> None:
        """The HTTP server killed (SIGKILL) and started again on its port, with ``environment`` over the stack's own."""
        self.kill(self.web_pid)
        assert self.port is not None
        self.web_pid = self._spawn_web(self.port, {**self.environment(), **(environment or {})}, self.base_dir / "web.log")

    def start_view_only_web(self) -> str:
        """A second HTTP server on the same stack with the API's hot path off (``FORKYARD_HOT_PATH``): every
        request through its view, for tests that ask both the same thing.  Its URL; stopped with the stack."""
        port = _free_port()
        environment = {**self.environment(), "FORKYARD_HOT_PATH": "0"}
        self.extra_web_pids.append(self._spawn_web(port, environment, self.base_dir / f"web-{port}.log"))
        return f"http://127.0.0.1:{port}"

    @staticmethod
    def _spawn_web(port: int, environment: dict[str, str], log: Path) -> int:
        """uvicorn serving HTTP as scripts/up runs it; its pid, once it answers."""
        pid = Reaper.get().spawn(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "console.asgi:http_application",
                *("--host", "127.0.0.1", "--port", str(port)),
                *("--loop", "uvloop", "--http", "httptools", "--lifespan", "off", "--no-access-log"),
            ],
            environment,
            str(PROJECT_ROOT),
            str(log),
        )
        # A guard against a hang, not a measure: on a machine busy with other suites, importing Django
        # and the project took uvicorn over 30 s (it then started, and was left running by the failure).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/v1/me", timeout=2).status_code == 401:
                    return pid
            except httpx.HTTPError:
                time.sleep(0.1)
        try:
            os.kill(pid, signal.SIGKILL)  # not left behind: no one else knows its pid
        except ProcessLookupError:
            pass
        raise RuntimeError(f"the web server did not start:\n{log.read_text()[-3000:]}")

    def wait_for_host(self, timeout_s: float = 30, name: str | None = None, log: str = "worker") -> None:
        """Until the host (this stack's first, or ``name``) has registered and reported its templates."""
        name = name or self.host_name
        deadline = time.monotonic() + timeout_s
        with self.client() as client:
            while time.monotonic() < deadline:
                templates = client.get("/api/v1/templates").json().get("templates", [])
                if any(template["name"] == "base" and name in template["hosts"] for template in templates):
                    return
                time.sleep(0.1)
        raise RuntimeError(f"the host did not register:\n{(self.base_dir / f'{log}.log').read_text()[-3000:]}")

    def wait_for_worker(self, name: str, timeout_s: float = 60) -> None:
        """Until the Celery worker logging to ``<name>.log`` says it is ready (it consumes its queues then:
        on RabbitMQ a queue exists only once a consumer declared it)."""
        log = self.base_dir / f"{name}.log"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if log.exists() and " ready." in log.read_text(errors="replace"):
                return
            time.sleep(0.1)
        raise RuntimeError(
            f"the {name} worker is not ready:\n{log.read_text(errors='replace')[-3000:] if log.exists() else '(no log)'}"
        )

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
        for pid in self.extra_web_pids:
            self.kill(pid)
        self.kill(self.board_pid)
        self.kill(self.worker_pid)
        self.kill(self.interactive_worker_pid)
        for host in self.extra_hosts:
            self.kill(host.worker_pid)
            self.kill(host.interactive_worker_pid)
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


@contextmanager
def running_stack(stack: Stack) -> Iterator[Stack]:
    """The stack started, and stopped after (also when it fails to start)."""
    try:
        stack.start()
    except BaseException:
        stack.stop()
        raise
    try:
        yield stack
    finally:
        stack.stop()


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


def wait_for_sandboxes(
    client: httpx.Client,
    sandbox_ids: list[str],
    states: tuple[str, ...] = ("destroyed", "stopped", "failed"),
    timeout_s: float = 90,
) -> dict[str, str]:
    """Each sandbox's state once every one is in ``states`` (by default: ended), or as they are at the
    guard's end (a guard against a hang, not a measure: the caller asserts what it expects)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = {sandbox_id: client.get(f"/api/v1/sandboxes/{sandbox_id}").json()["state"] for sandbox_id in sandbox_ids}
        if all(state in states for state in found.values()) or time.monotonic() > deadline:
            return found
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
