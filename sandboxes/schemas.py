"""Request and response shapes of the public API (they make the OpenAPI document)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal

from ninja import Schema
from pydantic import Field, field_validator, model_validator

LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-/]{0,62}$")
# The engine's rules for services (sandboxes/engine/services.py), checked here first so
# that a bad one is a 400 naming its field rather than a failed snapshot. A name
# names the service's log in the sandbox: /var/log/forkyard/<name>.log.
SERVICE_NAME = r"^[a-z0-9][a-z0-9_\-]{0,31}$"
MAX_SERVICES = 8
MAX_COMMAND = 4096


def _check_labels(labels: dict[str, str]) -> dict[str, str]:
    if len(labels) > 64:
        raise ValueError("at most 64 labels")
    for key, value in labels.items():
        if not LABEL_KEY.match(key):
            raise ValueError(f"label key {key[:64]!r}: 1-63 of A-Z a-z 0-9 _ . - /")
        if len(value) > 255:
            raise ValueError(f"label {key!r}: value longer than 255 characters")
    return labels


def _check_env(env: dict[str, str]) -> dict[str, str]:
    if len(env) > 256:
        raise ValueError("at most 256 variables")
    for key, value in env.items():
        if not key or "=" in key or "\0" in key or "\0" in value or len(key) > 255 or len(value) > 32768:
            raise ValueError(f"invalid variable {key[:64]!r}")
    return env


class ErrorDetail(Schema):
    code: str
    message: str
    field: str | None = None
    details: dict[str, Any] | None = None


class ErrorOut(Schema):
    error: ErrorDetail


class SandboxCreate(Schema):
    template: str | None = Field(None, description="a template name (give this or snapshot)", max_length=64)
    snapshot: str | None = Field(None, description="a snapshot id to fork (give this or template)", max_length=32)
    size: str | None = Field(None, description="tiny, default, or another size on the rate card", max_length=32)
    cpu: float | None = Field(None, gt=0, le=64, description="explicit vCPUs (with memory_mib, instead of size)")
    memory_mib: int | None = Field(None, ge=16, le=1024 * 1024, description="explicit memory (with cpu)")
    ttl_s: int = Field(3600, ge=1, le=7 * 24 * 3600, description="destroyed this many seconds after it is ready")
    network_policy: str | None = Field(None, max_length=32)
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    idempotency_key: str | None = Field(None, max_length=255, description="a retry with the same key creates nothing new")
    wait: bool = Field(True, description="answer once the sandbox runs (or failed), not as soon as it is queued")

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_labels(value)

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_env(value)


class ErrorInfo(Schema):
    code: str
    message: str


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
    ttl_s: int
    network_policy: str | None
    labels: dict[str, str]
    launch: str | None
    created_at: datetime
    ready_at: datetime | None
    expires_at: datetime | None
    ended_at: datetime | None
    error: ErrorInfo | None


class SandboxList(Schema):
    sandboxes: list[SandboxOut]
    next_cursor: str | None


class ExecIn(Schema):
    cmd: str | list[str] = Field(..., description="a string runs under /bin/sh -c; a list is argv")
    cwd: str | None = Field(None, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)
    stdin: str | None = Field(None, description="text given on standard input")
    stdin_b64: str | None = Field(None, description="bytes given on standard input, base64")
    timeout_s: float = Field(60, gt=0, le=24 * 3600)
    max_output_bytes: int = Field(1 << 20, ge=0, le=64 << 20)
    output: Literal["text", "base64"] = Field("text", description="text: UTF-8 (invalid bytes replaced); base64: exact bytes")

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_env(value)


class ExecOut(Schema):
    exit_code: int
    stdout: str
    stderr: str
    encoding: str
    duration_ms: float
    timed_out: bool
    signal: int | None
    oom_killed: bool
    stdout_truncated: bool
    stderr_truncated: bool


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


class FileWritten(Schema):
    path: str
    bytes: int


class LaunchCreate(SandboxCreate):
    count: int = Field(..., ge=1, le=1_000_000)
    wait: bool = Field(False, description="launches answer at once; follow GET /launches/{id}")


class LaunchProgress(Schema):
    requested: int
    queued: int
    creating: int
    running: int
    failed: int
    ended: int


class LaunchOut(Schema):
    id: str
    state: str
    template: str
    snapshot: str | None
    size: str | None
    count: int
    ttl_s: int
    labels: dict[str, str]
    created_at: datetime
    ready_at: datetime | None
    ended_at: datetime | None
    progress: LaunchProgress
    elapsed_s: float
    rate_per_s: float


class TemplateOut(Schema):
    name: str
    description: str
    size_bytes: int
    created_at: datetime
    hosts: list[str]


class HttpCheck(Schema):
    port: int = Field(..., ge=1, le=65535)
    path: str = Field("/", min_length=1, max_length=1024, pattern=r"^/[^\s\x00]*$")


class ReadyCheck(Schema):
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


class ServiceIn(Schema):
    """A long-running process every fork of the snapshot starts, and how to tell it is ready."""

    name: str = Field(..., pattern=SERVICE_NAME, description="1-32 of a-z 0-9 _ -; its log is /var/log/forkyard/<name>.log")
    command: str = Field(..., min_length=1, max_length=MAX_COMMAND, description="runs under /bin/sh -c, detached")
    ready: ReadyCheck
    timeout_s: float = Field(30, gt=0, le=300, description="a fork fails (service_not_ready) if not ready by then")

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


class SnapshotCreate(Schema):
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


class EgressRule(Schema):
    cidr: str | None = Field(None, max_length=64)
    host: str | None = Field(None, max_length=253)
    ports: list[int] = Field(default_factory=list)
    protocol: Literal["tcp", "udp", "any"] = "tcp"

    @field_validator("ports")
    @classmethod
    def _ports(cls, ports: list[int]) -> list[int]:
        if len(ports) > 64 or any(not 1 <= port <= 65535 for port in ports):
            raise ValueError("ports are 1-65535, at most 64 of them")
        return ports


class NetworkPolicyIn(Schema):
    name: str = Field(..., min_length=1, max_length=64)
    description: str = Field("", max_length=255)
    egress: list[EgressRule] = Field(default_factory=list, max_length=256)


class NetworkPolicyOut(Schema):
    id: str
    name: str
    description: str
    egress: list[EgressRule]
    created_at: datetime
    updated_at: datetime


class Deleted(Schema):
    id: str
    deleted: bool
