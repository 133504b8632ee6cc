"""Every request the SDK makes, built in one place for the sync and the async client.

Each function returns a ``Call`` (method, path, query, body); the clients send
it and turn the answer into objects.  Nothing here does I/O.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import AsyncIterable, Iterable, Mapping
from datetime import datetime
from typing import IO, Any, Literal, TypedDict
from urllib.parse import quote

from ._http import Call
from .errors import error_from_body
from .models import EgressRule, ExecChunk, ExecResult, Service

EXEC_MARGIN_S = 30.0
"""How much longer than a command's own timeout to wait for the server's answer."""

Body = bytes | str | IO[bytes] | Iterable[bytes] | AsyncIterable[bytes]
"""A request body: bytes or text in memory, an open binary file, or an iterator of chunks
(an async iterator with ``AsyncClient``).  Only bytes and text are sent again on a retry."""

Services = Iterable[Service | Mapping[str, Any]]
"""A snapshot's services: ``Service``s, or dicts with ``name``, ``command``, ``ready`` and ``timeout_s``."""


class SandboxOptions(TypedDict, total=False):
    """How to make a sandbox (``sandboxes.create``) or each sandbox of a launch (``launches.create``).

    Give ``template`` or ``snapshot``.  ``size`` is ``tiny``, ``default`` or
    another size on the rate card; or give ``cpu`` and ``memory_mib``.
    ``ttl_s``: destroyed this many seconds after it is ready.
    ``idempotency_key``: a retry with the same key creates nothing new (the SDK
    makes one up when none is given, so that its own retries are safe).
    ``wait`` (sandboxes only): answer once it runs rather than once it is queued.
    """

    template: str
    snapshot: str
    size: str
    cpu: float
    memory_mib: int
    ttl_s: int
    network_policy: str
    env: Mapping[str, str]
    labels: Mapping[str, str]
    idempotency_key: str
    wait: bool


class ExecOptions(TypedDict, total=False):
    """How to run a command.

    ``cwd`` and ``env`` inside the sandbox; ``stdin`` as text or bytes;
    ``timeout_s`` after which it is killed (a result with ``timed_out``, not an
    error); ``max_output_bytes`` kept of each of stdout and stderr;
    ``output="base64"`` for exact bytes instead of UTF-8 text.
    """

    cwd: str
    env: Mapping[str, str]
    stdin: str | bytes
    timeout_s: float
    max_output_bytes: int
    output: Literal["text", "base64"]


def _segment(value: str) -> str:
    return quote(str(value), safe="")


def _sandbox(sandbox_id: str, suffix: str = "") -> str:
    return f"/sandboxes/{_segment(sandbox_id)}{suffix}"


def _body(options: Mapping[str, Any], *, key_prefix: str) -> dict[str, Any]:
    body = {name: (dict(value) if isinstance(value, Mapping) else value) for name, value in options.items() if value is not None}
    body.setdefault("idempotency_key", f"{key_prefix}-{uuid.uuid4().hex}")
    return body


# --- sandboxes -------------------------------------------------------------------------


def create_sandbox(options: SandboxOptions) -> Call:
    return Call("POST", "/sandboxes", json=_body(options, key_prefix="sdk-sandbox"))


def get_sandbox(sandbox_id: str) -> Call:
    return Call("GET", _sandbox(sandbox_id))


def list_sandboxes(state: str | None, label: str | None, limit: int, cursor: str | None) -> Call:
    return Call("GET", "/sandboxes", params={"state": state, "label": label, "limit": limit, "cursor": cursor})


def destroy_sandbox(sandbox_id: str, wait: bool) -> Call:
    return Call("DELETE", _sandbox(sandbox_id), params={"wait": str(wait).lower()})


def sandbox_action(sandbox_id: str, action: Literal["pause", "resume"]) -> Call:
    return Call("POST", _sandbox(sandbox_id, f"/{action}"))


def snapshot_sandbox(sandbox_id: str, name: str, labels: Mapping[str, str] | None, services: Services,
                     idempotency_key: str | None) -> Call:
    body = {"name": name, "labels": dict(labels or {}), "services": [_service(service) for service in services],
            "idempotency_key": idempotency_key}
    return Call("POST", _sandbox(sandbox_id, "/snapshot"), json=_body(body, key_prefix="sdk-snapshot"))


def _service(service: Service | Mapping[str, Any]) -> dict[str, Any]:
    return service.to_api() if isinstance(service, Service) else dict(service)


def run(sandbox_id: str, cmd: str | list[str], options: ExecOptions, *, stream: bool = False) -> Call:
    """An exec (or its streaming variant): a POST that is never retried once sent."""
    body: dict[str, Any] = {"cmd": cmd if isinstance(cmd, str) else [str(part) for part in cmd]}
    for name, value in options.items():
        if name == "stdin" and isinstance(value, bytes):
            body["stdin_b64"] = base64.b64encode(value).decode()
        elif name == "env":
            body["env"] = dict(value)  # type: ignore[call-overload]
        elif value is not None:
            body[name] = value
    timeout_s = float(options.get("timeout_s") or 60.0)
    return Call("POST", _sandbox(sandbox_id, "/exec/stream" if stream else "/exec"), json=body, read_timeout_s=timeout_s + EXEC_MARGIN_S)


def stream_event(line: str | bytes, encoding: str) -> ExecChunk | ExecResult | None:
    """One line of ``POST .../exec/stream`` (newline-delimited JSON); None for a blank line.

    Output lines do not name their encoding: it is the ``output`` the request asked for.
    An ``error`` line (the engine failed mid-command) is raised as its typed error.
    """
    if not line.strip():
        return None
    event = json.loads(line)
    kind = event.get("type")
    if kind == "exit":
        return ExecResult.from_api({**event, "stdout": "", "stderr": ""})
    if kind == "error":
        raise error_from_body(int(event.get("status") or 500), event)
    return ExecChunk(stream=str(kind), data=str(event.get("data", "")), encoding=encoding)


# --- files -----------------------------------------------------------------------------


def read_file(sandbox_id: str, path: str) -> Call:
    return Call("GET", _sandbox(sandbox_id, "/files"), params={"path": path}, read_timeout_s=300)


def write_file(sandbox_id: str, path: str, data: Body, mode: int, make_parents: bool) -> Call:
    return Call("PUT", _sandbox(sandbox_id, "/files"), params={"path": path, "mode": mode, "make_parents": str(make_parents).lower()},
                content=data.encode() if isinstance(data, str) else data, headers={"Content-Type": "application/octet-stream"},
                read_timeout_s=300)


def list_files(sandbox_id: str, path: str) -> Call:
    return Call("GET", _sandbox(sandbox_id, "/files/list"), params={"path": path})


def remove_file(sandbox_id: str, path: str, recursive: bool) -> Call:
    return Call("DELETE", _sandbox(sandbox_id, "/files"), params={"path": path, "recursive": str(recursive).lower()})


def download(sandbox_id: str, path: str) -> Call:
    return Call("GET", _sandbox(sandbox_id, "/archive"), params={"path": path}, read_timeout_s=300)


def upload(sandbox_id: str, path: str, tar: Body) -> Call:
    return Call("PUT", _sandbox(sandbox_id, "/archive"), params={"path": path}, content=tar,
                headers={"Content-Type": "application/x-tar"}, read_timeout_s=300)


# --- launches --------------------------------------------------------------------------


def create_launch(count: int, options: SandboxOptions) -> Call:
    return Call("POST", "/launches", json={**_body(options, key_prefix="sdk-launch"), "count": count})


def get_launch(launch_id: str) -> Call:
    return Call("GET", f"/launches/{_segment(launch_id)}")


def list_launches(limit: int) -> Call:
    return Call("GET", "/launches", params={"limit": limit})


def launch_sandboxes(launch_id: str, state: str | None, limit: int, cursor: str | None) -> Call:
    return Call("GET", f"/launches/{_segment(launch_id)}/sandboxes", params={"state": state, "limit": limit, "cursor": cursor})


def destroy_launch(launch_id: str) -> Call:
    return Call("DELETE", f"/launches/{_segment(launch_id)}")


# --- templates, snapshots, network policies ----------------------------------------------
# These builders are also the signatures and docstrings of the methods made from them (``_resources``).

Rules = Iterable[EgressRule | Mapping[str, Any]]


def list_templates() -> Call:
    """The templates the team can start sandboxes from (shared ones and its own)."""
    return Call("GET", "/templates")


def get_template(name: str) -> Call:
    """One template by name; ``NotFound`` if the team cannot use it."""
    return Call("GET", f"/templates/{_segment(name)}")


def list_snapshots(state: str | None, label: str | None, limit: int, before: str | None) -> Call:
    return Call("GET", "/snapshots", params={"state": state, "label": label, "limit": limit, "before": before})


def get_snapshot(snapshot_id: str) -> Call:
    return Call("GET", f"/snapshots/{_segment(snapshot_id)}")


def delete_snapshot(snapshot_id: str) -> Call:
    return Call("DELETE", f"/snapshots/{_segment(snapshot_id)}")


def _policy(name: str, egress: Rules, description: str) -> dict[str, Any]:
    rules = [rule.to_api() if isinstance(rule, EgressRule) else dict(rule) for rule in egress]
    return {"name": name, "description": description, "egress": rules}


def list_policies() -> Call:
    """The team's network policies, by name."""
    return Call("GET", "/network-policies")


def create_policy(*, name: str, egress: Rules = (), description: str = "") -> Call:
    """A policy allowing only ``egress``: ``EgressRule``s, or dicts with ``cidr`` or ``host``, ``ports``, ``protocol``."""
    return Call("POST", "/network-policies", json=_policy(name, egress, description))


def get_policy(policy_id: str) -> Call:
    """One network policy by id."""
    return Call("GET", f"/network-policies/{_segment(policy_id)}")


def update_policy(policy_id: str, *, name: str, egress: Rules = (), description: str = "") -> Call:
    """Replace a policy's name, description and rules."""
    return Call("PUT", f"/network-policies/{_segment(policy_id)}", json=_policy(name, egress, description))


def delete_policy(policy_id: str) -> Call:
    """Delete a network policy."""
    return Call("DELETE", f"/network-policies/{_segment(policy_id)}")


# --- account ---------------------------------------------------------------------------


def list_keys() -> Call:
    """The team's API keys (without their secrets)."""
    return Call("GET", "/keys")


def create_key(name: str, *, role: Literal["member", "admin"] = "member", expires_at: datetime | None = None) -> Call:
    """A new API key: ``member`` keys manage sandboxes, ``admin`` keys also manage keys.
    Its ``secret`` is in the answer this once: store it now.  Needs an admin key."""
    return Call("POST", "/keys", json={"name": name, "role": role, "expires_at": expires_at.isoformat() if expires_at else None})


def revoke_key(key_id: str) -> Call:
    """Revoke an API key at once.  Needs an admin key."""
    return Call("DELETE", f"/keys/{_segment(key_id)}")


def usage(start: datetime | None = None, end: datetime | None = None, group_by: str = "size") -> Call:
    """Sandbox-seconds and cost in [start, end) (default: the last 24 hours), grouped by
    ``size``, ``key``, ``day``, ``all`` or ``label:<key>``."""
    return Call("GET", "/usage", params={"start": start.isoformat() if start else None, "end": end.isoformat() if end else None,
                                         "group_by": group_by})


def me() -> Call:
    """The calling key, its team and the team's limits."""
    return Call("GET", "/me")
