"""Request and response shapes of the public API (they make the OpenAPI document)."""

from __future__ import annotations

import base64
import re
from datetime import datetime
from typing import Annotated, Any, Literal

from ninja import Schema
from pydantic import Field, field_validator, model_validator

from sandboxes.engine.data_path import (
    MAX_COMMAND,
    CommandIn,
    ExecIn,
    Input,
    SandboxUser,
    check_env,
    refuse,
)

LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-/]{0,62}$")
HOSTNAME = re.compile(
    r"^(?=.{1,253}$)([a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?\.)*[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?$"
)
# The engine's rules for services (sandboxes/engine/fork_services.py), checked here first so
# that a bad one is a 400 naming its field rather than a failed snapshot. A name
# names the service's log in the sandbox: /var/log/forkyard/<name>.log.
SERVICE_NAME = r"^[a-z0-9][a-z0-9_\-]{0,31}$"
MAX_SERVICES = 8


def _check_labels(labels: dict[str, str]) -> dict[str, str]:
    if len(labels) > 64:
        raise ValueError("at most 64 labels")
    for key, value in labels.items():
        if not LABEL_KEY.match(key):
            raise ValueError(f"label key {key[:64]!r}: 1-63 of A-Z a-z 0-9 _ . - /")
        if len(value) > 255:
            raise ValueError(f"label {key!r}: value longer than 255 characters")
        if "\x00" in value:  # PostgreSQL's jsonb cannot hold it
            raise ValueError(f"label {key!r}: a value holds no NUL character")
    return labels


class SandboxCreate(Input):
    template: str | None = Field(None, description="a template name (give this or snapshot)", max_length=64)
    snapshot: str | None = Field(None, description="a snapshot id to fork (give this or template)", max_length=32)
    size: str | None = Field(None, description="tiny, default, or another size on the rate card", max_length=32)
    cpu: float | None = Field(None, gt=0, le=64, description="explicit vCPUs (with memory_mib, instead of size)")
    memory_mib: int | None = Field(None, ge=16, le=1024 * 1024, description="explicit memory (with cpu)")
    disk_mib: int | None = Field(
        None,
        ge=16,
        le=256 * 1024,
        description="its disk (what its writable layer may hold), instead of its size's: tiny 1 GiB, default 10 GiB, "
        "an explicit shape twice its memory (1-64 GiB); disk beyond the size's is priced by the rate card's disk line",
    )
    ttl_s: int = Field(3600, ge=1, le=7 * 24 * 3600, description="destroyed this many seconds after it is ready")
    idle_timeout_s: int = Field(
        0, ge=0, le=7 * 24 * 3600, description="destroyed after this many seconds without an exec or a file call; 0: never"
    )
    network_policy: str | None = Field(None, max_length=32)
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    idempotency_key: str | None = Field(None, max_length=255, description="a retry with the same key creates nothing new")
    lease: str | None = Field(
        None, max_length=32, description="a lease id (POST /leases): the sandbox is destroyed once the lease's heartbeats stop"
    )
    wait: bool = Field(True, description="answer once the sandbox runs (or failed), not as soon as it is queued")

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_labels(value)

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return check_env(value)


class ErrorInfo(Schema):
    code: str
    message: str


class DataPathOut(Schema):
    url: str = Field(..., description="the sandbox's host's gateway: send the sandbox's exec and file calls there")
    token: str = Field(..., description="a data token for this sandbox: `Authorization: Bearer <token>` at that url")
    expires_at: datetime = Field(..., description="after it, a GET of the sandbox gives a new one")


class SandboxOut(Schema):
    id: str
    state: str
    host: str | None
    region: str
    template: str
    snapshot: str | None
    size: str | None
    cpu: float
    memory_mib: int
    disk_mib: int = Field(..., description="what its disk (its writable layer) may hold")
    ttl_s: int
    idle_timeout_s: int = Field(..., description="destroyed after this many seconds without an exec or a file call; 0: never")
    network_policy: str | None
    labels: dict[str, str]
    launch: str | None
    lease: str | None
    created_at: datetime
    ready_at: datetime | None
    expires_at: datetime | None
    ended_at: datetime | None
    error: ErrorInfo | None
    end_reason: ErrorInfo | None = Field(
        ...,
        description="why it ended on its own: `ttl_expired`, `idle_timeout` (no exec or file call for its idle_timeout_s), "
        "`exited` (its init died), `host_lost` (its host stopped answering; billed up to its last sign of life)",
    )
    data_path: DataPathOut | None = Field(
        None,
        description="while it runs or is paused: its host's gateway and a short-lived data token for it. "
        "`POST {url}/api/v1/sandboxes/{id}/exec` and `GET|PUT {url}/api/v1/sandboxes/{id}/files` there answer "
        "exactly as the API does, straight from the host (the SDK uses it by itself)",
    )


class SandboxList(Schema):
    sandboxes: list[SandboxOut]
    next_cursor: str | None = Field(..., description="pass it as `cursor` for the next page; null on the last")


class SandboxPatch(Input):
    labels: dict[str, str] | None = Field(
        None, description="the sandbox's labels, replaced whole (a launch's member keeps its `launch` label)"
    )
    ttl_s: int | None = Field(
        None, ge=1, le=7 * 24 * 3600, description="its new expiry, this many seconds from now (give this or expires_at)"
    )
    expires_at: datetime | None = Field(None, description="its new expiry, a time with its zone (give this or ttl_s)")
    idle_timeout_s: int | None = Field(
        None, ge=0, le=7 * 24 * 3600, description="destroyed after this many seconds without an exec or a file call; 0: never"
    )

    @model_validator(mode="after")
    def _one_expiry(self) -> SandboxPatch:
        if self.ttl_s is not None and self.expires_at is not None:
            raise ValueError("give ttl_s or expires_at, not both")
        if self.expires_at is not None and self.expires_at.tzinfo is None:
            raise ValueError("expires_at needs its time zone (e.g. 2026-01-01T12:00:00Z)")
        return self

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return None if value is None else _check_labels(value)


class SandboxesKilled(Schema):
    count: int = Field(..., description="how many live sandboxes were asked to stop")
    stopping: int = Field(..., description="of those, how many their hosts are destroying")
    destroyed: int = Field(..., description="of those, how many had not reached a host yet: gone at once")


class BatchExecIn(ExecIn):
    """One command in many sandboxes: name them by exactly one of ``sandbox_ids``, ``launch`` or ``label``."""

    sandbox_ids: list[Annotated[str, Field(min_length=1, max_length=64)]] | None = Field(
        None, min_length=1, description="these sandboxes (each answered, once, in the order they finish)"
    )
    launch: str | None = Field(None, max_length=32, description="every live sandbox of this launch")
    label: str | None = Field(None, max_length=320, description="every live sandbox with this label: key:value, key=value or key")

    @model_validator(mode="after")
    def _one_selection(self) -> BatchExecIn:
        given = [name for name in ("sandbox_ids", "launch", "label") if getattr(self, name) is not None]
        if len(given) != 1:
            raise refuse(
                type(self).__name__,
                (given or ["sandbox_ids"])[-1],
                "name the sandboxes by exactly one of sandbox_ids, launch or label",
                None,
            )
        return self


class FileEntry(Schema):
    name: str
    type: str
    size: int
    mode: int
    uid: int
    gid: int
    mtime: float
    link_target: str | None = None


class FileList(Schema):
    path: str
    entries: list[FileEntry]
    truncated: bool


class FileRename(Input):
    path: str = Field(..., min_length=1, max_length=4096, description="what to rename")
    target: str = Field(..., min_length=1, max_length=4096, description="its new path (parents must exist)")
    replace: bool = Field(
        False,
        description="replace what is at `target` (a file, or an empty directory when renaming a directory); "
        "without it, an existing target is `409 file_exists`",
    )


class FileRenamed(Schema):
    path: str
    target: str


class DirectoryMake(Input):
    path: str = Field(..., min_length=1, max_length=4096, description="made with its parents, like `mkdir -p`")


class DirectoryMade(Schema):
    path: str


class LaunchCreate(SandboxCreate):
    count: int = Field(..., ge=1, le=1_000_000)
    wait: bool = Field(False, description="launches answer at once; follow GET /launches/{id}")
    memory_group_size: int = Field(
        1,
        ge=1,
        le=4096,
        description="for launches of thousands: its sandboxes share one memory cgroup this many at a time on "
        "each host, with their limits' sum as the group's (each keeps its own CPU, pids and freezer). The "
        "kernel's memory per sandbox then stays flat as the count grows; the trade: inside a group one "
        "sandbox's memory can crowd out another's. 1 (the default): each its own",
    )
    memory_group_cpu: Literal["each", "group"] = Field(
        "each",
        description="with memory_group_size above 1, where the CPU quota is: each sandbox's own (the default), or "
        'one for the group, its members\' cores summed ("group"). Creates stay fast at tens of thousands on one '
        "host (each quota written makes the kernel walk every CPU cgroup); the trade: inside a group a busy "
        "sandbox may use the cores its idle mates leave, and the group never passes its quota",
    )

    @model_validator(mode="after")
    def _cpu_needs_groups(self) -> LaunchCreate:
        if self.memory_group_cpu == "group" and self.memory_group_size <= 1:
            raise ValueError('memory_group_cpu "group" needs memory_group_size above 1')
        return self


class LaunchProgressOut(Schema):
    requested: int
    queued: int
    creating: int
    running: int
    failed: int
    ended: int


class LaunchHostShare(Schema):
    """A launch's members on one host, by stage (as a launch's progress counts them)."""

    host: str
    queued: int
    creating: int
    running: int = Field(..., description="running or paused")
    failed: int
    ended: int = Field(..., description="stopping, stopped or destroyed")


class LaunchHosts(Schema):
    hosts: list[LaunchHostShare] = Field(
        ..., description="each host that holds or held members of the launch, by name; members not yet made are on none"
    )


class LaunchOut(Schema):
    id: str
    state: str
    memory_group_size: int = 1
    memory_group_cpu: str = "each"
    template: str
    snapshot: str | None
    size: str | None
    count: int
    ttl_s: int
    idle_timeout_s: int
    labels: dict[str, str]
    lease: str | None
    created_at: datetime
    ready_at: datetime | None
    ended_at: datetime | None
    progress: LaunchProgressOut
    elapsed_s: float
    rate_per_s: float


class DeniedAttempt(Schema):
    address: str | None = Field(
        ..., description="the address it tried; null for a name its resolver refused before any address"
    )
    name: str | None = Field(None, description="the name it asked for, where it was refused by name (DNS, TLS SNI, HTTP Host)")
    protocol: str = Field(..., description="`tcp`, `udp`, or `dns` (a name its resolver refused)")
    port: int
    rule: str = Field(..., description="why it was refused: no rule allows it, a private address no rule names, metadata")
    at: datetime = Field(..., description="its last attempt (to the second)")


class NetworkMetrics(Schema):
    """A sandbox's traffic under its network policy, as the host's end of its link counts it."""

    bytes_out: int = Field(..., description="bytes it sent (refused packets included)")
    bytes_in: int = Field(..., description="bytes it received")
    denied_packets: int = Field(..., description="packets its policy refused")
    denied: list[DeniedAttempt] = Field(..., description="the last 20 refused destinations, the latest first")


class SandboxMetrics(Schema):
    """What the kernel reports through the sandbox's cgroup (and its disk's filesystem), read now."""

    sandbox: str
    at: datetime
    cpu_s: float = Field(..., description="CPU time its processes used since it started, in seconds")
    cpu_limit: float = Field(..., description="its vCPUs")
    cpu_share: float = Field(
        ..., description="the part of its CPU allowance it used since it was ready: cpu_s / (age_s × cpu_limit)"
    )
    memory_bytes: int = Field(..., description="memory charged to it now (its files' page cache included)")
    memory_peak_bytes: int = Field(..., description="the most memory it has held (0 where the kernel keeps no peak)")
    memory_limit_bytes: int
    pids: int = Field(..., description="processes in it now, its init included")
    pids_max: int
    disk_used_bytes: int = Field(..., description="what its writable layer holds (what its disk limit bounds)")
    disk_files: int | None = Field(
        ..., description="files in its writable layer, where its disk counts them (a tmpfs); null on a quota that counts bytes"
    )
    disk_limit_bytes: int
    oom_kills: int = Field(..., description="processes the kernel's OOM killer ended in it")
    age_s: float = Field(..., description="seconds since it was ready")
    network: NetworkMetrics | None = Field(None, description="under a network policy; null for loopback only")


class LaunchMetrics(Schema):
    """The same, summed over the launch's running and paused members (each read from its host's engine)."""

    launch: str
    at: datetime
    sandboxes: int = Field(..., description="members measured")
    unreachable: int = Field(..., description="members whose host did not answer (not in the sums)")
    cpu_s: float
    cpu_limit: float
    memory_bytes: int
    memory_peak_bytes: int = Field(..., description="the sum of each member's own peak")
    memory_limit_bytes: int
    pids: int
    disk_used_bytes: int
    disk_files: int = Field(..., description="summed where counted (see a sandbox's metrics)")
    oom_kills: int


class LaunchList(Schema):
    launches: list[LaunchOut]
    next_cursor: str | None


class TemplateOut(Schema):
    name: str
    description: str
    size_bytes: int
    created_at: datetime
    hosts: list[str]
    public: bool = Field(..., description="provided by the operator to every team (else the team's own, built here)")
    state: Literal["building", "ready", "failed"] = Field(..., description="building until its first build is done")
    snapshot: str | None = Field(..., description="a team template: the snapshot its last good build ended with")
    build: str | None = Field(..., description="its last build's id: GET /templates/{name}/build")


class TemplateList(Schema):
    templates: list[TemplateOut]
    next_cursor: str | None


class HttpCheck(Input):
    port: int = Field(..., ge=1, le=65535)
    path: str = Field("/", min_length=1, max_length=1024, pattern=r"^/[^\s\x00]*$")


class ReadyCheck(Input):
    """Exactly one way to tell that a service answers."""

    tcp: int | None = Field(None, ge=1, le=65535, description="ready once this port accepts a connection")
    http: HttpCheck | None = Field(None, description="ready once GET http://127.0.0.1:<port><path> answers below 500")
    exec: str | None = Field(None, min_length=1, max_length=MAX_COMMAND, description="ready once this shell command exits 0")

    @model_validator(mode="after")
    def _exactly_one(self) -> ReadyCheck:
        given = [name for name in ("tcp", "http", "exec") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of tcp, http or exec")
        if self.exec is not None and ("\x00" in self.exec or not self.exec.strip()):
            raise ValueError("exec: a non-empty command without NUL characters")
        return self


class ServiceIn(Input):
    """A long-running process every fork of the snapshot starts, and how to tell it is ready."""

    name: str = Field(..., pattern=SERVICE_NAME, description="1-32 of a-z 0-9 _ -; its log is /var/log/forkyard/<name>.log")
    command: str = Field(..., min_length=1, max_length=MAX_COMMAND, description="runs under /bin/sh -c, detached")
    ready: ReadyCheck
    timeout_s: float = Field(30, gt=0, le=300, description="a fork fails (service_not_ready) if not ready by then")
    wait: bool = Field(
        True,
        description="false: a fork is handed over without waiting for this one to answer (started with the others; "
        "wait for its port yourself, POST /sandboxes/{id}/ports/{port}/wait)",
    )

    def as_engine(self) -> dict[str, Any]:
        """As the engine records it: ``wait`` only when off, so a spec that never named it keeps the
        content address (a build's cache key) it had before the field existed."""
        data = self.model_dump(mode="json", exclude_none=True)
        if data.get("wait") is True:
            del data["wait"]
        return data

    @field_validator("command")
    @classmethod
    def _command(cls, value: str) -> str:
        if "\x00" in value or not value.strip():
            raise ValueError("a non-empty command without NUL characters")
        return value


def _check_services(services: list[ServiceIn]) -> list[ServiceIn]:
    names = [service.name for service in services]
    duplicate = next((name for name in names if names.count(name) > 1), None)
    if duplicate is not None:
        raise ValueError(f"service {duplicate!r} is named twice")
    return services


class SnapshotCreate(Input):
    name: str = Field(..., min_length=1, max_length=100, description="for people; the snapshot's id is what forks name")
    labels: dict[str, str] = Field(default_factory=dict)
    services: list[ServiceIn] = Field(default_factory=list, max_length=MAX_SERVICES)
    idempotency_key: str | None = Field(None, max_length=255, description="a retry with the same key takes no second snapshot")

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_labels(value)

    @field_validator("services")
    @classmethod
    def _services(cls, value: list[ServiceIn]) -> list[ServiceIn]:
        return _check_services(value)


class SnapshotOut(Schema):
    id: str
    name: str
    state: str = Field(..., description="creating, ready, failed or deleted")
    template: str = Field(..., description="the root template under its layers")
    parent: str | None = Field(..., description="the snapshot its source sandbox was forked from, if any")
    layer_id: str = Field(..., description="content address of its own layer (empty until ready)")
    size_bytes: int = Field(..., description="bytes of its own layer: what saved state bills, per GiB-hour")
    total_bytes: int
    services: list[ServiceIn]
    labels: dict[str, str]
    source_sandbox: str | None
    host: str | None
    created_at: datetime
    ready_at: datetime | None
    deleted_at: datetime | None
    paused_ms: float | None = Field(..., description="how long the source sandbox was paused while it was taken")
    forks_alive: int = Field(..., description="live sandboxes forked from it (queued, creating, running, paused, stopping)")
    error: ErrorInfo | None


class SnapshotList(Schema):
    snapshots: list[SnapshotOut]
    next_cursor: str | None


class EgressRule(Input):
    cidr: str | None = Field(None, max_length=64, description="a network it may reach, such as 203.0.113.0/24")
    host: str | None = Field(
        None,
        max_length=253,
        description="a name it may reach through its resolver (`pypi.org`); `*.example.org` matches the subdomains, not the name itself",
    )
    ports: list[int] = Field(default_factory=list, description="empty: every port")
    protocol: Literal["tcp", "udp", "any"] = "tcp"

    @field_validator("ports")
    @classmethod
    def _ports(cls, ports: list[int]) -> list[int]:
        if len(ports) > 64 or any(not 1 <= port <= 65535 for port in ports):
            raise ValueError("ports are 1-65535, at most 64 of them")
        return ports


class NetworkPolicyIn(Input):
    name: str = Field(..., min_length=1, max_length=64)
    description: str = Field("", max_length=255)
    egress: list[EgressRule] = Field(default_factory=list, max_length=256)
    same_launch: bool = Field(False, description="sandboxes of the same launch under it may reach each other")


class NetworkPolicyOut(Schema):
    id: str
    name: str
    description: str
    egress: list[EgressRule]
    same_launch: bool
    created_at: datetime
    updated_at: datetime
    applied_to: int | None = Field(
        None, description="a PUT's answer: running and paused sandboxes under the policy whose hosts now enforce the new rules"
    )
    apply_failed: list[str] | None = Field(
        None, description="a PUT's answer: sandboxes whose host could not take the new rules (they keep the old ones)"
    )


class NetworkPolicyList(Schema):
    network_policies: list[NetworkPolicyOut]
    next_cursor: str | None


MAX_LEASE_GRACE_S = 3600


class LeaseIn(Input):
    grace_s: int = Field(
        60, ge=1, le=MAX_LEASE_GRACE_S, description="seconds without a heartbeat after which its sandboxes are destroyed"
    )


class LeaseOut(Schema):
    id: str
    state: str = Field(..., description="active; expired (its heartbeats stopped); ended (its client ended it)")
    grace_s: int
    created_at: datetime
    heartbeat_at: datetime = Field(..., description="its last heartbeat (or its creation)")
    expires_at: datetime = Field(..., description="when it expires unless a heartbeat comes first")
    ended_at: datetime | None
    sandboxes_alive: int = Field(..., description="live sandboxes named with it")


class LeaseList(Schema):
    leases: list[LeaseOut]
    next_cursor: str | None


class Deleted(Schema):
    id: str
    deleted: bool


# --- background processes (sandboxes/api/processes.py; the engine's processes.py) ------------


class PtyIn(Input):
    rows: int = Field(24, ge=1, le=1000)
    cols: int = Field(80, ge=1, le=1000)


class ProcessIn(CommandIn):
    cmd: str | list[str] = Field(..., description="a string runs under /bin/sh -c; a list is argv")
    cwd: str | None = Field(None, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)
    timeout_s: float | None = Field(
        None, gt=0, le=7 * 24 * 3600, description="seconds before it and everything it started are killed; none: no limit"
    )
    pty: PtyIn | None = Field(None, description="run it on a terminal of this size (one output stream, stdout)")
    user: SandboxUser = Field(
        None,
        description="run as this user of the sandbox's own /etc/passwd, as an exec does: a name or a uid; "
        "its template's default user (else root) if not given",
    )
    output: Literal["text", "base64"] = Field("text", description="how the answer spells output")


class ProcessOutput(Schema):
    """One stream's output from the offset asked for: what is still kept of it (its last 256 KiB)."""

    data: str
    offset: int = Field(description="the offset of data's first byte (bytes the stream wrote before it)")
    next_offset: int = Field(description="ask from here next time")
    missed_bytes: int = Field(description="bytes after the asked offset that are no longer kept (dropped from the front)")
    total_bytes: int = Field(description="bytes the stream has written in all")
    dropped_bytes: int = Field(description="bytes dropped from the front of the buffer")


class ProcessSummary(Schema):
    pid: int = Field(description="its pid inside the sandbox")
    cmd: list[str]
    cwd: str
    state: Literal["running", "exited"]
    exit_code: int | None
    signal: int | None
    timed_out: bool
    pty: PtyIn | None
    started_at: datetime
    ended_at: datetime | None
    stdout_bytes: int
    stderr_bytes: int


class ProcessOut(ProcessSummary):
    stdout: ProcessOutput
    stderr: ProcessOutput
    encoding: Literal["text", "base64"]


class ProcessList(Schema):
    processes: list[ProcessSummary]
    next_cursor: str | None = Field(None, description="always null: a sandbox holds at most 32 processes, one page")


class SignalIn(Input):
    signal: str | int = Field("TERM", description="a name (TERM, KILL, INT, HUP, ...) or a number from 1 to 64")
    group: bool = Field(False, description="signal its whole process group (it leads one)")

    @field_validator("signal")
    @classmethod
    def _signal(cls, value: str | int) -> str | int:
        if isinstance(value, str) and not re.fullmatch(r"(SIG)?[A-Za-z0-9+]{1,12}", value):
            raise ValueError("a signal name such as TERM, or a number")
        return value


class WaitIn(Input):
    timeout_s: float = Field(30, ge=0, le=300, description="how long to wait at most; its state is answered either way")
    stdout_offset: int = Field(0, ge=0, description="output from here on comes with the answer")
    stderr_offset: int = Field(0, ge=0)
    output: Literal["text", "base64"] = "text"


class InputIn(Input):
    data: str | None = Field(None, max_length=1 << 20, description="text for its stdin (or terminal)")
    data_b64: str | None = Field(None, max_length=(4 << 20) // 3 + 4, description="bytes for its stdin, base64")
    eof: bool = Field(False, description="then close its stdin (on a terminal: send ^D)")

    @field_validator("data_b64")
    @classmethod
    def _base64(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                base64.b64decode(value, validate=True)
            except ValueError:
                raise ValueError("not valid base64") from None
        return value

    @model_validator(mode="after")
    def _one(self) -> InputIn:
        if self.data is not None and self.data_b64 is not None:
            raise refuse(type(self).__name__, "data_b64", "give data or data_b64, not both", None)
        return self


class InputWritten(ProcessSummary):
    written: int


class ResizeIn(Input):
    rows: int = Field(..., ge=1, le=1000)
    cols: int = Field(..., ge=1, le=1000)


# --- exposed ports (sandboxes/api/ports.py, sandboxes/api/preview.py) ---------------------------


class PortIn(Input):
    port: int = Field(..., ge=1, le=65535, description="a TCP port something in the sandbox listens on (on any address)")
    auth: Literal["key", "token", "public"] = Field(
        "key",
        description="key: the team's API key in the X-Forkyard-Key header; token: a signed URL (`token_url`) that "
        "expires; public: nothing (anyone with the URL)",
    )
    token_ttl_s: int = Field(3600, ge=60, le=7 * 24 * 3600, description="with token: how long the signed URL works")


class PortOut(Schema):
    id: str
    sandbox_id: str
    port: int
    auth: Literal["key", "token", "public"]
    url: str = Field(..., description="http://{port}-{sandbox id, '_' as '-'}.{preview domain}/")
    token_url: str | None = Field(None, description="with token auth: the URL with a fresh signed token")
    token_expires_at: datetime | None = None
    created_at: datetime


class PortList(Schema):
    ports: list[PortOut]
    next_cursor: str | None


class PortWaitIn(Input):
    timeout_s: float = Field(30, ge=0, le=300, description="how long to wait at most; answered either way")


class PortWaited(Schema):
    port: int
    listening: bool = Field(..., description="something in the sandbox accepts connections on it")
    waited_s: float


TEMPLATE_NAME = r"^[a-z0-9_][a-z0-9_.\-]{0,63}$"  # the engine's rule for a template's name
APT_PACKAGE = r"^[a-z0-9][a-z0-9+.\-]{0,127}(=[A-Za-z0-9.+:~\-]{1,64})?$"
PIP_REQUIREMENT = r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}(\[[A-Za-z0-9._,\-]{1,128}\])?([<>=!~]=?[A-Za-z0-9.*+!\-]{1,64},?){0,4}$"
NPM_PACKAGE = r"^(@[a-z0-9][a-z0-9._\-]{0,63}/)?[a-z0-9][a-z0-9._\-]{0,127}(@[A-Za-z0-9.^~<>=*+\-]{1,64})?$"
STEP_KINDS = ("apt", "pip", "npm", "run", "file", "env", "workdir", "user")
MAX_BUILD_STEPS = 64
MAX_FILE_STEP_BYTES = 4 * 1024 * 1024


class FileStep(Input):
    path: str = Field(..., min_length=2, max_length=4096, pattern=r"^/[^\x00]*$", description="absolute, in the sandbox")
    content: str | None = Field(None, description="the file's text (give this or content_b64)")
    content_b64: str | None = Field(None, description="the file's bytes, base64")
    mode: int = Field(0o644, ge=0, le=0o7777)

    @model_validator(mode="after")
    def _one_content(self) -> FileStep:
        if (self.content is None) == (self.content_b64 is None):
            raise refuse("FileStep", "content", "give exactly one of content or content_b64", None)
        if len(self.data()) > MAX_FILE_STEP_BYTES:
            raise refuse("FileStep", "content", f"a file step holds at most {MAX_FILE_STEP_BYTES} bytes", None)
        return self

    def data(self) -> bytes:
        if self.content is not None:
            return self.content.encode()
        try:
            return base64.b64decode(self.content_b64 or "", validate=True)
        except ValueError:
            raise refuse("FileStep", "content_b64", "content_b64 is not base64", None) from None


class BuildStep(Input):
    """One step of a build: exactly one of its kinds. ``apt``, ``pip`` and ``npm`` install packages (under the
    build's network policy), ``run`` runs a command, ``file`` writes a file; ``env``, ``workdir`` and ``user``
    set what every later step and every sandbox of the template get by default."""

    apt: list[Annotated[str, Field(pattern=APT_PACKAGE)]] | None = Field(None, min_length=1, max_length=200)
    pip: list[Annotated[str, Field(pattern=PIP_REQUIREMENT)]] | None = Field(None, min_length=1, max_length=200)
    npm: list[Annotated[str, Field(pattern=NPM_PACKAGE)]] | None = Field(None, min_length=1, max_length=200)
    run: str | list[Annotated[str, Field(max_length=MAX_COMMAND)]] | None = Field(
        None, description="a shell command (string) or an argv list"
    )
    file: FileStep | None = None
    env: dict[str, str] | None = None
    workdir: str | None = Field(None, min_length=1, max_length=4096, pattern=r"^/[^\x00]*$")
    user: SandboxUser | None = None
    index_url: str | None = Field(
        None, max_length=2048, pattern=r"^https?://[^\s\x00]+$", description="pip: the package index to use instead of PyPI"
    )
    timeout_s: float = Field(900, gt=0, le=3600, description="the step fails (step_timed_out) if it runs longer")

    @model_validator(mode="after")
    def _one_kind(self) -> BuildStep:
        given = [kind for kind in STEP_KINDS if getattr(self, kind) is not None]
        if len(given) != 1:
            raise refuse(
                "BuildStep", "run", f"a step is exactly one of {', '.join(STEP_KINDS)}; this one has {given or 'none'}", None
            )
        if self.index_url is not None and given != ["pip"]:
            raise refuse("BuildStep", "index_url", "index_url goes with a pip step only", self.index_url)
        if isinstance(self.run, str) and (not self.run.strip() or "\x00" in self.run or len(self.run) > MAX_COMMAND):
            raise refuse("BuildStep", "run", "a non-empty command without NUL characters", None)
        if isinstance(self.run, list) and not self.run:
            raise refuse("BuildStep", "run", "an argv list holds at least the program", None)
        if self.env is not None:
            check_env(self.env)
        return self

    @property
    def kind(self) -> str:
        return next(kind for kind in STEP_KINDS if getattr(self, kind) is not None)


class TemplateBuildIn(Input):
    """A template built from a base by steps, in a sandbox: ``POST /templates``. A rebuild of the same spec
    reuses every step it shares with an earlier build of the team's (each step's result is a snapshot)."""

    name: str = Field(..., pattern=TEMPLATE_NAME, description="the template's name in the team (a rebuild replaces it)")
    description: str = Field("", max_length=255)
    base: str = Field(
        ...,
        min_length=1,
        max_length=64,
        description="a template's name (public or the team's), snapshot:<id>, or debian:bookworm (the public debian template)",
    )
    steps: list[BuildStep] = Field(default_factory=list, max_length=MAX_BUILD_STEPS)
    services: list[ServiceIn] = Field(
        default_factory=list, max_length=MAX_SERVICES, description="started, and checked ready, in every sandbox of it"
    )
    network_policy: str | None = Field(
        None,
        max_length=32,
        description="the policy the build runs under; by default none, or the team's package-indexes policy "
        "(Debian, PyPI, npm) when a step installs packages",
    )
    size: str = Field("default", max_length=32, description="the build sandbox's size")
    timeout_s: int = Field(3600, ge=10, le=6 * 3600, description="the whole build fails (build_timed_out) past it")

    @field_validator("services")
    @classmethod
    def _services(cls, value: list[ServiceIn]) -> list[ServiceIn]:
        return _check_services(value)


class BuildStepOut(Schema):
    name: str = Field(..., description="what the step does, as the log names it")
    kind: str
    state: Literal["pending", "cached", "running", "done", "failed"]
    seconds: float | None
    snapshot: str | None = Field(..., description="the snapshot it ended with")


class TemplateBuildOut(Schema):
    id: str
    template: str
    state: Literal["queued", "building", "ready", "failed"]
    steps: list[BuildStepOut]
    cached: bool = Field(..., description="every step was taken from an earlier build")
    failed_step: int | None = Field(..., description="the index of the step that failed")
    error: ErrorInfo | None
    error_output: str = Field(..., description="the failed step's output, its last 16 KiB")
    created_at: datetime
    ended_at: datetime | None


# The desktop (sandboxes/engine/desktop.py checks each action again, field by field).
class ScreenSize(Schema):
    width: int
    height: int


class CursorPosition(Schema):
    x: int
    y: int


class DesktopOut(Schema):
    screen: ScreenSize = Field(..., description="the desktop's screen, in pixels (what coordinates refer to)")
    cursor: CursorPosition


class ScreenshotIn(Input):
    scale: float | None = Field(None, ge=0.05, le=1, description="the image's size as a part of the screen's")
    max_width: int | None = Field(None, ge=16, le=8192, description="scaled down (keeping its shape) to fit this width")
    max_height: int | None = Field(None, ge=16, le=8192, description="scaled down (keeping its shape) to fit this height")
    format: Literal["png", "jpeg"] = "png"
    quality: int | None = Field(None, ge=10, le=95, description="jpeg only (80 unless given)")


class ScreenshotOut(Schema):
    width: int = Field(..., description="the image's width")
    height: int
    scale: float = Field(..., description="image pixels per screen pixel: divide an image coordinate by it for the screen's")
    format: Literal["png", "jpeg"]
    screen: ScreenSize
    image_b64: str = Field(..., description="the encoded image, base64")


class Point(Input):
    x: int = Field(..., ge=0, le=8191)
    y: int = Field(..., ge=0, le=8191)


class DesktopAction(Input):
    """One input action. ``type`` says which fields it takes (others are refused):

    * ``move`` x, y; ``click`` [x, y], button, count (1-3); ``double_click``, ``triple_click`` [x, y], button;
      ``mouse_down``, ``mouse_up`` [x, y], button; ``drag`` path (2-256 points), button;
    * ``scroll`` [x, y], dx, dy (wheel steps; positive dy is down, positive dx is right);
    * ``key`` keys (pressed together: ``["ctrl", "c"]`` or ``"ctrl+c"``), repeat; ``hold_key`` keys, seconds;
    * ``type`` text; ``wait`` seconds; ``cursor_position`` (every answer carries the cursor anyway).

    Without x and y, a click, press or scroll happens where the cursor is."""

    type: Literal[
        "move", "click", "double_click", "triple_click", "mouse_down", "mouse_up", "drag", "scroll",
        "key", "hold_key", "type", "wait", "cursor_position",
    ]  # fmt: skip
    x: int | None = Field(None, ge=0, le=8191)
    y: int | None = Field(None, ge=0, le=8191)
    button: Literal["left", "middle", "right", "back", "forward"] | None = None
    count: int | None = Field(None, ge=1, le=3)
    path: list[Point] | None = Field(None, min_length=2, max_length=256)
    dx: int | None = Field(None, ge=-100, le=100)
    dy: int | None = Field(None, ge=-100, le=100)
    keys: list[str] | str | None = Field(None, description="key names: enter, esc, ctrl, shift, alt, cmd, a, F5, Page_Up, ...")
    repeat: int | None = Field(None, ge=1, le=100)
    seconds: float | None = Field(None, ge=0, le=10)
    text: str | None = Field(None, min_length=1, max_length=10_000)


class DesktopActionsIn(Input):
    actions: list[DesktopAction] = Field(..., min_length=1, max_length=64, description="done in order; all checked first")


class DesktopActionsOut(DesktopOut):
    done: int = Field(..., description="how many actions were done (all of them: a refused one refuses the batch)")


class DesktopViewIn(Input):
    mode: Literal["view", "control"] = Field("view", description="view: watch only; control: mouse and keyboard too")
    token_ttl_s: int = Field(3600, ge=60, le=7 * 24 * 3600, description="how long the signed URL works")


class DesktopViewOut(Schema):
    mode: Literal["view", "control"]
    port: int = Field(..., description="the sandbox's noVNC port behind the URL (6081 view-only, 6080 control)")
    url: str = Field(..., description="the live view (noVNC in a browser), signed; it sets a cookie for its own requests")
    expires_at: datetime
