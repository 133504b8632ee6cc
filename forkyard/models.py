"""What the API answers, as typed Python objects.

Plain values (an exec result, a template, a key) are frozen dataclasses built
with ``from_api``.  Sandboxes and launches are live objects bound to a client
(``forkyard.Sandbox``, ``forkyard.AsyncSandbox``, ...); the fields they share
live here, in ``SandboxFields`` and ``LaunchFields``.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from decimal import Decimal
from typing import Any, ClassVar, TypeVar


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
class ExecChunk:
    """Output of a streamed command as it came: ``stream`` is ``stdout`` or ``stderr``."""

    stream: str
    data: str
    encoding: str = "text"

    @property
    def bytes(self) -> bytes:
        return _as_bytes(self.data, self.encoding)


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
    name: str
    description: str = ""
    size_bytes: int = 0
    created_at: datetime | None = None
    hosts: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Snapshot(ApiValue):
    id: str
    name: str = ""
    state: str = ""
    template: str = ""
    parent: str | None = None
    size_bytes: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    created_at: datetime | None = None
    ready_at: datetime | None = None
    forks_alive: int = 0


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
    created_at: datetime | None = None
    updated_at: datetime | None = None


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
        return cls(start=parse_time(data.get("from")), end=parse_time(data.get("to")), group_by=str(data.get("group_by", "")),
                   currency=str(data.get("currency", "USD")), total=_decimal(data.get("total", "0")),
                   lines=_each(UsageLine)(data.get("lines")))


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
    ttl_s: int
    network_policy: str | None
    labels: dict[str, str]
    launch: str | None
    created_at: datetime | None
    ready_at: datetime | None
    expires_at: datetime | None
    ended_at: datetime | None
    error: ErrorInfo | None
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
        self.ttl_s = int(data.get("ttl_s", 0))
        self.network_policy = data.get("network_policy")
        self.labels = _strings(data.get("labels"))
        self.launch = data.get("launch")
        self.created_at = parse_time(data.get("created_at"))
        self.ready_at = parse_time(data.get("ready_at"))
        self.expires_at = parse_time(data.get("expires_at"))
        self.ended_at = parse_time(data.get("ended_at"))
        error = data.get("error")
        self.error = ErrorInfo.from_api(error) if error else None

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def starting(self) -> bool:
        """Queued or being created: not yet running, not yet failed."""
        return self.state in ("queued", "creating")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self.state} on {self.host}>"


class LaunchFields:
    """A launch's fields as the API last reported them (``refresh()`` reloads them)."""

    id: str
    state: str
    template: str
    snapshot_id: str | None
    size: str | None
    count: int
    ttl_s: int
    labels: dict[str, str]
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
        self.ttl_s = int(data.get("ttl_s", 0))
        self.labels = _strings(data.get("labels"))
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
