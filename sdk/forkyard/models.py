"""What the API answers, as typed Python objects.

Plain values (an exec result, a template, a key) are frozen dataclasses built
with ``from_api``.  Sandboxes, launches and snapshots are live objects bound to
a client (``forkyard.Sandbox``, ``forkyard.AsyncSandbox``, ...); the fields
they share live here, in ``SandboxFields``, ``LaunchFields`` and ``SnapshotFields``.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from decimal import Decimal
from typing import Any, ClassVar, TypeVar

from .errors import ForkyardError


def parse_time(value: Any) -> datetime | None:
    """An ISO 8601 time from the API (``...Z`` included), or None."""
    if not value:
        return None
    return datetime.fromisoformat(str(value))


def _strings(value: Any) -> dict[str, str]:
    return {str(key): str(item) for key, item in (value or {}).items()}


V = TypeVar("V", bound="ApiValue")


class ApiValue:
    """Base of the frozen dataclasses built from API answers.

    ``from_api`` takes each field of the same name from the answer: a field
    named ``*_at`` is parsed as a time, and ``CONVERT`` names the fields that
    need more (nested objects, exact decimals).  A field the answer lacks keeps
    its default.
    """

    CONVERT: ClassVar[Mapping[str, Callable[[Any], Any]]] = {}

    @classmethod
    def from_api(cls: type[V], data: Mapping[str, Any]) -> V:
        values: dict[str, Any] = {}
        for item in fields(cls):  # type: ignore[arg-type]
            if item.name not in data:
                continue
            value = data[item.name]
            if item.name in cls.CONVERT:
                value = cls.CONVERT[item.name](value)
            elif item.name.endswith("_at"):
                value = parse_time(value)
            values[item.name] = value
        return cls(**values)


def _each(kind: type[V]) -> Callable[[Any], list[V]]:
    return lambda rows: [kind.from_api(row) for row in rows or []]


def _decimal(value: Any) -> Decimal:
    return Decimal(str(value))


@dataclass(frozen=True)
class ErrorInfo(ApiValue):
    """Why a sandbox failed to start."""

    code: str
    message: str


@dataclass(frozen=True)
class DeniedAttempt(ApiValue):
    """A connection its network policy refused: where to, and why (``rule``). ``address`` is None and
    ``protocol`` is ``dns`` for a name its resolver refused; ``name`` is the name it asked for, where
    it was refused by name."""

    address: str | None
    protocol: str
    port: int
    rule: str
    at: datetime | None = None
    name: str | None = None


@dataclass(frozen=True)
class NetworkMetrics(ApiValue):
    """A sandbox's traffic under its network policy: ``bytes_out`` (refused packets included), ``bytes_in``,
    ``denied_packets``, and ``denied``: the last refused destinations, the latest first."""

    CONVERT = {"denied": _each(DeniedAttempt)}

    bytes_out: int = 0
    bytes_in: int = 0
    denied_packets: int = 0
    denied: list[DeniedAttempt] = field(default_factory=list)


@dataclass(frozen=True)
class Metrics(ApiValue):
    """What the kernel reports about a sandbox (``sandbox.metrics()``), or the same summed over a launch's running
    and paused members (``launch.metrics()``: ``sandboxes`` measured, ``unreachable`` hosts' members left out;
    the per-sandbox fields ``cpu_share``, ``age_s`` and the limits of one are 0 there).

    ``cpu_s``: CPU time used; ``cpu_share``: the part of its CPU allowance used since it was ready;
    ``memory_bytes`` now and ``memory_peak_bytes`` at most; ``pids``: processes now; ``disk_used_bytes``:
    what its writable layer holds; ``oom_kills``: processes the kernel's OOM killer ended."""

    at: datetime | None = None
    sandbox: str | None = None
    launch: str | None = None
    sandboxes: int = 1
    unreachable: int = 0
    cpu_s: float = 0.0
    cpu_limit: float = 0.0
    cpu_share: float = 0.0
    memory_bytes: int = 0
    memory_peak_bytes: int = 0
    memory_limit_bytes: int = 0
    pids: int = 0
    pids_max: int = 0
    disk_used_bytes: int = 0
    disk_files: int | None = 0  # None: its disk counts bytes only (a quota), not files
    disk_limit_bytes: int = 0
    oom_kills: int = 0
    age_s: float = 0.0
    network: NetworkMetrics | None = None  # under a network policy (a sandbox's metrics only)

    CONVERT = {"network": lambda value: NetworkMetrics.from_api(value) if value else None}


@dataclass(frozen=True)
class ExecResult(ApiValue):
    """The outcome of a command.  A timeout is a result (``timed_out``), not an error.

    ``stdout`` and ``stderr`` are text (UTF-8, invalid bytes replaced) or, with
    ``output="base64"``, base64 text: ``stdout_bytes`` gives the exact bytes
    either way.  From ``exec_stream`` they are empty: the output came as chunks.
    """

    exit_code: int
    stdout: str = ""
    stderr: str = ""
    duration_ms: float = 0.0
    timed_out: bool = False
    signal: int | None = None
    oom_killed: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    encoding: str = "text"
    replayed: bool = False  # the result of an earlier exec with the same idempotency key: nothing ran again

    @property
    def ok(self) -> bool:
        """True when the command exited 0 in time."""
        return self.exit_code == 0 and not self.timed_out

    @property
    def stdout_bytes(self) -> bytes:
        return _as_bytes(self.stdout, self.encoding)

    @property
    def stderr_bytes(self) -> bytes:
        return _as_bytes(self.stderr, self.encoding)


def _as_bytes(text: str, encoding: str) -> bytes:
    return base64.b64decode(text) if encoding == "base64" else text.encode()


@dataclass(frozen=True)
class BatchResult:
    """One sandbox's outcome in ``exec_many``: the command's ``result``, or the ``error`` that kept it
    from running there (``NotFound``, ``Conflict`` for a sandbox not running, ``Unavailable``...)."""

    sandbox_id: str
    result: ExecResult | None = None
    error: ForkyardError | None = None

    @property
    def ok(self) -> bool:
        """True when the command ran and exited 0 in time."""
        return self.result is not None and self.result.ok

    @property
    def exit_code(self) -> int | None:
        return self.result.exit_code if self.result is not None else None

    @property
    def stdout(self) -> str:
        return self.result.stdout if self.result is not None else ""

    @property
    def stderr(self) -> str:
        return self.result.stderr if self.result is not None else ""


@dataclass(frozen=True)
class BatchSummary(ApiValue):
    """The last line of ``exec_many``: how many sandboxes, and how it went in them."""

    sandboxes: int = 0
    succeeded: int = 0  # exited 0 in time
    failed: int = 0  # ran, and exited otherwise or timed out
    errors: int = 0  # could not run it
    duration_ms: float = 0.0


@dataclass(frozen=True)
class Killed(ApiValue):
    """What ``kill_all`` asked: ``count`` sandboxes, of which ``stopping`` are being destroyed by their
    hosts and ``destroyed`` were gone at once (they had not reached one)."""

    count: int = 0
    stopping: int = 0
    destroyed: int = 0


@dataclass(frozen=True)
class Lease(ApiValue):
    """A lease: sandboxes and launches named with it live while its heartbeats come (see ``Client(lease=...)``)."""

    id: str
    state: str = "active"  # active; expired (its heartbeats stopped); ended (its client ended it)
    grace_s: int = 60
    created_at: datetime | None = None
    heartbeat_at: datetime | None = None
    expires_at: datetime | None = None
    ended_at: datetime | None = None
    sandboxes_alive: int = 0

    @property
    def active(self) -> bool:
        return self.state == "active"


@dataclass(frozen=True)
class ExecChunk:
    """Output of a streamed command as it came: ``stream`` is ``stdout`` or ``stderr``."""

    stream: str
    data: str
    encoding: str = "text"

    @property
    def bytes(self) -> bytes:
        return _as_bytes(self.data, self.encoding)


@dataclass(frozen=True)
class ProcessStream(ApiValue):
    """One stream of a background process's output, from the offset that was asked for.

    ``data`` is text (UTF-8, invalid bytes replaced) or base64 (``bytes`` gives the exact
    bytes either way).  Offsets count every byte the stream wrote: ``next_offset`` is where
    to read from next.  The engine keeps the last 256 KiB of each stream: ``missed_bytes``
    is what fell off before it was read, ``dropped_bytes`` all that fell off so far.
    """

    data: str = ""
    offset: int = 0
    next_offset: int = 0
    missed_bytes: int = 0
    total_bytes: int = 0
    dropped_bytes: int = 0
    encoding: str = "text"

    @property
    def bytes(self) -> bytes:
        return _as_bytes(self.data, self.encoding)


@dataclass(frozen=True)
class ProcessOutput:
    """What a background process wrote since it was last read: ``stdout``, ``stderr`` (``ProcessStream``)."""

    stdout: ProcessStream
    stderr: ProcessStream

    @classmethod
    def from_api(cls, data: Mapping[str, Any]) -> ProcessOutput:
        encoding = str(data.get("encoding", "text"))
        return cls(*(ProcessStream.from_api({**(data.get(name) or {}), "encoding": encoding}) for name in ("stdout", "stderr")))

    @classmethod
    def empty(cls, stdout_offset: int = 0, stderr_offset: int = 0) -> ProcessOutput:
        return cls(
            ProcessStream(offset=stdout_offset, next_offset=stdout_offset),
            ProcessStream(offset=stderr_offset, next_offset=stderr_offset),
        )


def _joined(first: ProcessStream, then: ProcessStream) -> ProcessStream:
    """Two reads of one stream, the first not handed out yet, as one."""
    if first.encoding == "base64":
        data = base64.b64encode(first.bytes + then.bytes).decode()
    else:
        data = first.data + then.data
    return ProcessStream(
        data,
        first.offset,
        then.next_offset,
        first.missed_bytes + then.missed_bytes,
        then.total_bytes,
        then.dropped_bytes,
        then.encoding,
    )


class ProcessFields:
    """A background process's fields as the API last reported them.

    ``pid`` is its pid inside the sandbox; ``state`` ``running`` or ``exited``;
    ``exit_code``, ``exit_signal`` (the API's ``signal``: ``signal()`` is the method
    that sends one) and ``timed_out`` once it exited; ``pty`` its terminal's
    ``{"rows", "cols"}`` if it has one.  ``data`` is the answer as it came.
    """

    sandbox_id: str
    pid: int
    cmd: list[str]
    cwd: str
    state: str
    exit_code: int | None
    exit_signal: int | None
    timed_out: bool
    pty: dict[str, int] | None
    started_at: datetime | None
    ended_at: datetime | None
    stdout_bytes: int
    stderr_bytes: int
    data: dict[str, Any]

    _offsets: tuple[int, int] = (0, 0)  # where stdout and stderr are to be read from next
    _unread: ProcessOutput | None = None  # output that came with an answer and was not handed out yet
    _reaped = False  # a wait saw it exit: the API no longer has it
    _encoding = "text"

    def _apply(self, data: Mapping[str, Any]) -> None:
        self.data = dict(data)
        self.pid = int(data["pid"])
        self.cmd = [str(part) for part in data.get("cmd") or []]
        self.cwd = str(data.get("cwd", ""))
        self.state = str(data.get("state", ""))
        self.exit_code = data.get("exit_code")
        self.exit_signal = data.get("signal")
        self.timed_out = bool(data.get("timed_out", False))
        self.pty = dict(data["pty"]) if data.get("pty") else None
        self.started_at = parse_time(data.get("started_at"))
        self.ended_at = parse_time(data.get("ended_at"))
        self.stdout_bytes = int(data.get("stdout_bytes", 0))
        self.stderr_bytes = int(data.get("stderr_bytes", 0))

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def ok(self) -> bool:
        """True once it exited 0 in time."""
        return self.state == "exited" and self.exit_code == 0 and not self.timed_out

    def _answered(self, data: Mapping[str, Any]) -> None:
        """An answer with output: its fields applied, its output kept until ``output()`` hands it out."""
        self._apply(data)
        if self.pid == 0 and self.state == "exited":
            self._reaped = True  # it never started: the API holds nothing to ask about (its reason came with it)
        if "stdout" not in data:
            return
        self._encoding = str(data.get("encoding", self._encoding))
        new = ProcessOutput.from_api(data)
        self._offsets = (new.stdout.next_offset, new.stderr.next_offset)
        if self._unread is not None:
            new = ProcessOutput(_joined(self._unread.stdout, new.stdout), _joined(self._unread.stderr, new.stderr))
        self._unread = new

    def _take(self) -> ProcessOutput:
        unread, self._unread = self._unread, None
        return unread if unread is not None else ProcessOutput.empty(*self._offsets)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.pid} in {self.sandbox_id} {self.state}>"


@dataclass(frozen=True)
class FileEntry(ApiValue):
    name: str
    type: str
    size: int = 0
    mode: int = 0
    uid: int = 0
    gid: int = 0
    mtime: float = 0.0
    link_target: str | None = None


@dataclass(frozen=True)
class FileListing(ApiValue):
    """A directory's entries; ``truncated`` when there were more than the server lists."""

    CONVERT = {"entries": _each(FileEntry)}

    path: str
    entries: list[FileEntry] = field(default_factory=list)
    truncated: bool = False

    def __iter__(self) -> Iterator[FileEntry]:
        return iter(self.entries)


@dataclass(frozen=True)
class FileWritten(ApiValue):
    path: str
    bytes: int


@dataclass(frozen=True)
class FileRenamed(ApiValue):
    path: str
    target: str


@dataclass(frozen=True)
class WatchEvent(ApiValue):
    """A change of a watched directory: ``type`` is ``ready`` (the watch is in place), ``created``,
    ``modified``, ``attributes``, ``deleted``, ``moved_from``, ``moved_to`` (paired by ``cookie``),
    ``overflow`` (``dropped`` events were not kept) or ``end`` (its ``reason``: ``timeout``,
    ``sandbox_ended``, ``directory_deleted``, ``directory_moved``, ``directory_unmounted``)."""

    type: str
    name: str | None = None
    is_dir: bool = False
    cookie: int | None = None
    dropped: int = 0
    reason: str | None = None
    path: str | None = None


@dataclass(frozen=True)
class LaunchProgress(ApiValue):
    """How many of a launch's sandboxes are in each state."""

    requested: int = 0
    queued: int = 0
    creating: int = 0
    running: int = 0
    failed: int = 0
    ended: int = 0

    @property
    def pending(self) -> int:
        """Sandboxes not yet started or failed: queued or creating."""
        return self.queued + self.creating

    @property
    def settled(self) -> bool:
        return self.pending == 0


@dataclass(frozen=True)
class Template(ApiValue):
    """A template sandboxes start from: a public one (the operator's), or one the team built
    (``fy.templates.build``): then ``snapshot`` is its last good build's and ``build`` that build's id."""

    name: str
    description: str = ""
    size_bytes: int = 0
    created_at: datetime | None = None
    hosts: list[str] = field(default_factory=list)
    public: bool = True
    state: str = "ready"
    snapshot: str | None = None
    build: str | None = None


@dataclass(frozen=True)
class BuildStep(ApiValue):
    """One step of a template build: ``pending``, ``cached`` (an earlier build's snapshot of the same
    steps was reused), ``running``, ``done`` or ``failed``."""

    name: str
    kind: str
    state: str
    seconds: float | None = None
    snapshot: str | None = None


@dataclass(frozen=True)
class TemplateBuild(ApiValue):
    """A build of a team's template; once ``failed``, ``failed_step``, ``error`` and ``error_output`` (the
    failed step's output, its tail) say what went wrong."""

    CONVERT = {"steps": _each(BuildStep), "error": lambda value: ErrorInfo.from_api(value) if value else None}

    id: str
    template: str
    state: str
    steps: list[BuildStep] = field(default_factory=list)
    cached: bool = False
    failed_step: int | None = None
    error: ErrorInfo | None = None
    error_output: str = ""
    created_at: datetime | None = None
    ended_at: datetime | None = None

    @property
    def ended(self) -> bool:
        return self.state in ("ready", "failed")


@dataclass(frozen=True)
class Service(ApiValue):
    """A long-running process that every fork of a snapshot starts, and how to tell it is ready.

    The kernel cannot checkpoint process memory, so a snapshot saves files,
    not processes: its services are started again in each fork, which is
    running only once every one of them answers.  Make one with ``Service.tcp``,
    ``Service.http`` or ``Service.exec``; ``ready`` is the API's object
    (``{"tcp": port}``, ``{"http": {"port": p, "path": "/"}}`` or ``{"exec": "cmd"}``).
    Its output goes to ``/var/log/forkyard/<name>.log`` inside the sandbox.
    ``wait=False``: a fork is handed over without waiting for this one (it is started all the same;
    wait for its port with ``sandbox.ports.wait_for_port``).
    """

    CONVERT = {"ready": lambda ready: {kind: value for kind, value in (ready or {}).items() if value is not None}}

    name: str
    command: str
    ready: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 30.0
    wait: bool = True

    @classmethod
    def tcp(cls, name: str, command: str, port: int, *, timeout_s: float = 30.0, wait: bool = True) -> Service:
        """Ready once ``port`` accepts a connection on the sandbox's loopback."""
        return cls(name, command, {"tcp": port}, timeout_s, wait)

    @classmethod
    def http(
        cls, name: str, command: str, port: int, path: str = "/", *, timeout_s: float = 30.0, wait: bool = True
    ) -> Service:
        """Ready once ``GET http://127.0.0.1:<port><path>`` answers below 500."""
        return cls(name, command, {"http": {"port": port, "path": path}}, timeout_s, wait)

    @classmethod
    def exec(cls, name: str, command: str, check: str, *, timeout_s: float = 30.0, wait: bool = True) -> Service:
        """Ready once the shell command ``check`` exits 0."""
        return cls(name, command, {"exec": check}, timeout_s, wait)

    def to_api(self) -> dict[str, Any]:
        ready = {kind: value for kind, value in self.ready.items() if value is not None}
        body = {"name": self.name, "command": self.command, "ready": ready, "timeout_s": self.timeout_s}
        return body if self.wait else {**body, "wait": False}


@dataclass(frozen=True)
class EgressRule(ApiValue):
    """Where a sandbox may connect: a CIDR or a host name, some ports, a protocol."""

    cidr: str | None = None
    host: str | None = None
    ports: list[int] = field(default_factory=list)
    protocol: str = "tcp"

    def to_api(self) -> dict[str, Any]:
        return {"cidr": self.cidr, "host": self.host, "ports": list(self.ports), "protocol": self.protocol}


@dataclass(frozen=True)
class NetworkPolicy(ApiValue):
    CONVERT = {"egress": _each(EgressRule)}

    id: str
    name: str
    description: str = ""
    egress: list[EgressRule] = field(default_factory=list)
    same_launch: bool = False
    created_at: datetime | None = None
    updated_at: datetime | None = None
    # After an update: running and paused sandboxes now under the new rules, and those that keep the old ones.
    applied_to: int | None = None
    apply_failed: list[str] | None = None


@dataclass(frozen=True)
class ApiKey(ApiValue):
    id: str
    name: str
    prefix: str = ""
    role: str = ""
    created_at: datetime | None = None
    last_used_at: datetime | None = None
    expires_at: datetime | None = None
    revoked_at: datetime | None = None


@dataclass(frozen=True)
class CreatedKey:
    """A new API key and its secret: the only time the secret is shown."""

    key: ApiKey
    secret: str

    @classmethod
    def from_api(cls, data: Mapping[str, Any]) -> CreatedKey:
        return cls(key=ApiKey.from_api(data), secret=str(data["secret"]))


@dataclass(frozen=True)
class UsageLine(ApiValue):
    CONVERT = {"amount": _decimal}

    group: str
    seconds: float = 0.0
    amount: Decimal = Decimal(0)
    periods: int = 0


@dataclass(frozen=True)
class Usage:
    """Sandbox-seconds and cost in [start, end), grouped; amounts are exact decimals."""

    start: datetime | None
    end: datetime | None
    group_by: str
    currency: str
    total: Decimal
    lines: list[UsageLine]

    @classmethod
    def from_api(cls, data: Mapping[str, Any]) -> Usage:
        return cls(
            start=parse_time(data.get("start", data.get("from"))),  # the API says start and end
            end=parse_time(data.get("end", data.get("to"))),
            group_by=str(data.get("group_by", "")),
            currency=str(data.get("currency", "USD")),
            total=_decimal(data.get("total", "0")),
            lines=_each(UsageLine)(data.get("lines")),
        )


@dataclass(frozen=True)
class Limits(ApiValue):
    requests_per_second: int = 0
    max_sandboxes: int = 0
    max_launch_count: int = 0
    max_ttl_s: int = 0


@dataclass(frozen=True)
class WhoAmI(ApiValue):
    """The calling key, its team and the team's limits."""

    CONVERT = {"limits": Limits.from_api}

    team: str
    team_name: str = ""
    key: str = ""
    key_name: str = ""
    role: str = ""
    limits: Limits = field(default_factory=Limits)


class SandboxFields:
    """A sandbox's fields as the API last reported them (``refresh()`` reloads them).

    The API's ``snapshot`` (what it was forked from) is ``snapshot_id`` here: ``snapshot()``
    is the method that takes one.  ``data`` is the answer as it came.
    """

    id: str
    state: str
    host: str | None
    region: str
    template: str
    snapshot_id: str | None
    size: str | None
    cpu: float
    memory_mib: int
    disk_mib: int
    ttl_s: int
    idle_timeout_s: int
    network_policy: str | None
    labels: dict[str, str]
    launch: str | None
    lease: str | None
    created_at: datetime | None
    ready_at: datetime | None
    expires_at: datetime | None
    ended_at: datetime | None
    error: ErrorInfo | None
    end_reason: ErrorInfo | None  # why it ended on its own: ttl_expired, idle_timeout, exited
    data: dict[str, Any]

    def _apply(self, data: Mapping[str, Any]) -> None:
        self.data = dict(data)
        self.id = str(data["id"])
        self.state = str(data.get("state", ""))
        self.host = data.get("host")
        self.region = str(data.get("region", ""))
        self.template = str(data.get("template", ""))
        self.snapshot_id = data.get("snapshot")
        self.size = data.get("size")
        self.cpu = float(data.get("cpu", 0))
        self.memory_mib = int(data.get("memory_mib", 0))
        self.disk_mib = int(data.get("disk_mib") or 0)
        self.ttl_s = int(data.get("ttl_s", 0))
        self.idle_timeout_s = int(data.get("idle_timeout_s") or 0)
        self.network_policy = data.get("network_policy")
        self.labels = _strings(data.get("labels"))
        self.launch = data.get("launch")
        self.lease = data.get("lease")
        self.created_at = parse_time(data.get("created_at"))
        self.ready_at = parse_time(data.get("ready_at"))
        self.expires_at = parse_time(data.get("expires_at"))
        self.ended_at = parse_time(data.get("ended_at"))
        error = data.get("error")
        self.error = ErrorInfo.from_api(error) if error else None
        end_reason = data.get("end_reason")
        self.end_reason = ErrorInfo.from_api(end_reason) if end_reason else None

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def starting(self) -> bool:
        """Queued or being created: not yet running, not yet failed."""
        return self.state in ("queued", "creating")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self.state} on {self.host}>"


class SnapshotFields:
    """A snapshot's fields as the API last reported them (``refresh()`` reloads them).

    ``size_bytes`` is its own layer (what saved state bills per GiB-hour),
    ``total_bytes`` with the layers under it; ``parent`` the snapshot its source
    sandbox was forked from; ``forks_alive`` its live sandboxes; ``error`` why it
    failed.  ``data`` is the answer as it came.
    """

    id: str
    name: str
    state: str
    template: str
    parent: str | None
    layer_id: str
    size_bytes: int
    total_bytes: int
    services: list[Service]
    labels: dict[str, str]
    source_sandbox: str | None
    host: str | None
    created_at: datetime | None
    ready_at: datetime | None
    deleted_at: datetime | None
    paused_ms: float | None
    forks_alive: int
    error: ErrorInfo | None
    data: dict[str, Any]

    def _apply(self, data: Mapping[str, Any]) -> None:
        self.data = dict(data)
        self.id = str(data["id"])
        self.name = str(data.get("name", ""))
        self.state = str(data.get("state", ""))
        self.template = str(data.get("template", ""))
        self.parent = data.get("parent")
        self.layer_id = str(data.get("layer_id") or "")
        self.size_bytes = int(data.get("size_bytes") or 0)
        self.total_bytes = int(data.get("total_bytes") or 0)
        self.services = _each(Service)(data.get("services"))
        self.labels = _strings(data.get("labels"))
        self.source_sandbox = data.get("source_sandbox")
        self.host = data.get("host")
        self.created_at = parse_time(data.get("created_at"))
        self.ready_at = parse_time(data.get("ready_at"))
        self.deleted_at = parse_time(data.get("deleted_at"))
        paused_ms = data.get("paused_ms")
        self.paused_ms = float(paused_ms) if paused_ms is not None else None
        self.forks_alive = int(data.get("forks_alive") or 0)
        error = data.get("error")
        self.error = ErrorInfo.from_api(error) if error else None

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def creating(self) -> bool:
        return self.state == "creating"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self.name!r} {self.state}, {self.size_bytes} bytes, {self.forks_alive} forks alive>"


class LaunchFields:
    """A launch's fields as the API last reported them (``refresh()`` reloads them)."""

    id: str
    state: str
    template: str
    snapshot_id: str | None
    size: str | None
    count: int
    memory_group_size: int  # its sandboxes share a memory cgroup this many at a time on each host
    memory_group_cpu: str  # "each": a CPU quota each; "group": one a memory group
    ttl_s: int
    labels: dict[str, str]
    lease: str | None
    created_at: datetime | None
    ready_at: datetime | None
    ended_at: datetime | None
    progress: LaunchProgress
    elapsed_s: float
    rate_per_s: float
    data: dict[str, Any]

    def _apply(self, data: Mapping[str, Any]) -> None:
        self.data = dict(data)
        self.id = str(data["id"])
        self.state = str(data.get("state", ""))
        self.template = str(data.get("template", ""))
        self.snapshot_id = data.get("snapshot")
        self.size = data.get("size")
        self.count = int(data.get("count", 0))
        self.memory_group_size = int(data.get("memory_group_size") or 1)
        self.memory_group_cpu = str(data.get("memory_group_cpu") or "each")
        self.ttl_s = int(data.get("ttl_s", 0))
        self.idle_timeout_s = int(data.get("idle_timeout_s") or 0)
        self.labels = _strings(data.get("labels"))
        self.lease = data.get("lease")
        self.created_at = parse_time(data.get("created_at"))
        self.ready_at = parse_time(data.get("ready_at"))
        self.ended_at = parse_time(data.get("ended_at"))
        self.progress = LaunchProgress.from_api(data.get("progress", {}))
        self.elapsed_s = float(data.get("elapsed_s", 0.0))
        self.rate_per_s = float(data.get("rate_per_s", 0.0))

    @property
    def settled(self) -> bool:
        """No sandbox of the launch is still queued or creating (or the launch is over)."""
        return self.progress.settled or self.state in ("stopping", "stopped", "failed")

    def __repr__(self) -> str:
        progress = self.progress
        return f"<{type(self).__name__} {self.id} {self.state} {progress.running}/{progress.requested} running, {progress.failed} failed>"


@dataclass(frozen=True)
class ExposedPort(ApiValue):
    """A sandbox's port at its preview URL (``sandbox.ports.expose``).

    ``url`` is where it answers; with ``auth="token"``, ``token_url`` is that URL signed (until
    ``token_expires_at``); with ``auth="key"``, send the team's API key in ``X-Forkyard-Key``."""

    id: str
    sandbox_id: str
    port: int
    auth: str
    url: str
    token_url: str | None = None
    token_expires_at: datetime | None = None
    created_at: datetime | None = None


@dataclass(frozen=True)
class DesktopState(ApiValue):
    """A desktop's screen size (what coordinates refer to) and cursor; ``done`` after ``act``."""

    screen_width: int
    screen_height: int
    cursor_x: int
    cursor_y: int
    done: int = 0

    @classmethod
    def from_answer(cls, data: Mapping[str, Any]) -> DesktopState:
        screen, cursor = data["screen"], data["cursor"]
        return cls(screen["width"], screen["height"], cursor["x"], cursor["y"], int(data.get("done", 0)))


@dataclass(frozen=True)
class Screenshot(ApiValue):
    """A desktop's screen as an image: ``image`` holds its bytes (PNG or JPEG).  ``scale`` maps it back
    to the screen: screen x = image x / scale."""

    image: bytes
    width: int
    height: int
    scale: float
    format: str
    screen_width: int
    screen_height: int

    @classmethod
    def from_answer(cls, data: Mapping[str, Any]) -> Screenshot:
        return cls(
            image=base64.b64decode(data["image_b64"]),
            width=data["width"],
            height=data["height"],
            scale=data["scale"],
            format=data["format"],
            screen_width=data["screen"]["width"],
            screen_height=data["screen"]["height"],
        )

    def save(self, path: str) -> None:
        with open(path, "wb") as out:
            out.write(self.image)


@dataclass(frozen=True)
class LiveView(ApiValue):
    """A signed URL of a desktop in a browser (noVNC): ``view`` only watches, ``control`` takes input."""

    mode: str
    port: int
    url: str
    expires_at: datetime | None = None
