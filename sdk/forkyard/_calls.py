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
from typing import IO, Any, Literal, TypedDict, cast
from urllib.parse import quote

from ._http import Call
from .errors import UnknownOption, error_from_body
from .models import BatchResult, BatchSummary, EgressRule, ExecChunk, ExecResult, Service, WatchEvent

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
    ``disk_mib``: its disk (what it may write) instead of its size's (tiny 1 GiB, default 10 GiB).
    ``ttl_s``: destroyed this many seconds after it is ready.
    ``idle_timeout_s``: destroyed after this many seconds without an exec or a file call (0: never).
    ``idempotency_key``: a retry with the same key creates nothing new (the SDK
    makes one up when none is given, so that its own retries are safe).
    ``wait`` (sandboxes only): answer once it runs rather than once it is queued.
    ``lease``: a lease id (``fy.leases.create()``): destroyed once the lease's
    heartbeats stop (a client made with ``lease=True`` names its own).
    """

    template: str
    snapshot: str
    size: str
    cpu: float
    memory_mib: int
    disk_mib: int
    ttl_s: int
    idle_timeout_s: int
    network_policy: str
    env: Mapping[str, str]
    labels: Mapping[str, str]
    idempotency_key: str
    lease: str
    wait: bool


class ExecOptions(TypedDict, total=False):
    """How to run a command.

    ``cwd`` and ``env`` inside the sandbox; ``stdin`` as text or bytes;
    ``timeout_s`` after which it is killed (a result with ``timed_out``, not an
    error); ``max_output_bytes`` kept of each of stdout and stderr;
    ``output="base64"`` for exact bytes instead of UTF-8 text;
    ``user`` (a name or a uid of the sandbox's own ``/etc/passwd``) to run
    as, instead of root (a name it does not hold is ``user_not_found``);
    ``idempotency_key`` makes the command safe to send again (the SDK then
    retries it after a lost connection): a second exec with the same key runs
    nothing, and gets the first one's result (its exit status and timings,
    ``replayed`` true; its output only if it is still running, since output
    is never kept once delivered).  ``timeout`` and ``workdir`` are accepted
    as other names for ``timeout_s`` and ``cwd`` (not both names at once).
    """

    idempotency_key: str
    cwd: str
    env: Mapping[str, str]
    stdin: str | bytes
    timeout_s: float
    max_output_bytes: int
    output: Literal["text", "base64"]
    user: str | int
    timeout: float  # another name for timeout_s
    workdir: str  # another name for cwd


EXEC_ALIASES = {"timeout": "timeout_s", "workdir": "cwd"}


def checked(options: Mapping[str, Any], allowed: Any, where: str, aliases: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``options`` with every alias under its own name; an option ``allowed`` (a TypedDict) does not name,
    or one given under both its names, raises ``UnknownOption`` before anything is sent."""
    known = set(allowed.__annotations__)
    unknown = sorted(name for name in options if name not in known)
    if unknown:
        takes = ", ".join(sorted(known - set(aliases or {})))
        raise UnknownOption(
            "unknown_option", f"{where}() got an unknown option {unknown[0]!r}; it takes {takes}", field=unknown[0]
        )
    result = dict(options)
    for alias, name in (aliases or {}).items():
        if alias in result:
            if name in result:
                raise UnknownOption("invalid_request", f"{alias} is another name for {name}: give one of them", field=alias)
            result[name] = result.pop(alias)
    return result


def exec_options(options: Mapping[str, Any], where: str = "exec") -> ExecOptions:
    """An exec's options, checked (``checked``), each under its own name."""
    return cast(ExecOptions, checked(options, ExecOptions, where, EXEC_ALIASES))  # checked against it just now


def sandbox_options(options: Mapping[str, Any], where: str) -> SandboxOptions:
    """A create's or a launch's options, checked (``checked``)."""
    return cast(SandboxOptions, checked(options, SandboxOptions, where))  # checked against it just now


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
    return Call("POST", "/sandboxes", json=_body(sandbox_options(options, "sandboxes.create"), key_prefix="sdk-sandbox"))


def get_sandbox(sandbox_id: str) -> Call:
    return Call("GET", _sandbox(sandbox_id))


def list_sandboxes(state: str | None, label: str | None, limit: int, cursor: str | None) -> Call:
    return Call("GET", "/sandboxes", params={"state": state, "label": label, "limit": limit, "cursor": cursor})


def destroy_sandbox(sandbox_id: str, wait: bool) -> Call:
    return Call("DELETE", _sandbox(sandbox_id), params={"wait": str(wait).lower()})


def destroy_sandboxes(label: str | None, launch: str | None) -> Call:
    """Every live sandbox with a label (``key:value``), or of a launch; the API refuses neither."""
    return Call("DELETE", "/sandboxes", params={"label": label, "launch": launch})


def update_sandbox(
    sandbox_id: str,
    labels: Mapping[str, str] | None = None,
    ttl_s: int | None = None,
    expires_at: datetime | None = None,
    idle_timeout_s: int | None = None,
) -> Call:
    body: dict[str, Any] = {}
    if labels is not None:
        body["labels"] = dict(labels)
    if ttl_s is not None:
        body["ttl_s"] = ttl_s
    if expires_at is not None:
        body["expires_at"] = expires_at.isoformat()
    if idle_timeout_s is not None:
        body["idle_timeout_s"] = idle_timeout_s
    return Call("PATCH", _sandbox(sandbox_id), json=body)


def sandbox_metrics(sandbox_id: str) -> Call:
    return Call("GET", _sandbox(sandbox_id, "/metrics"))


def sandbox_action(sandbox_id: str, action: Literal["pause", "resume"]) -> Call:
    return Call("POST", _sandbox(sandbox_id, f"/{action}"))


def snapshot_sandbox(
    sandbox_id: str, name: str, labels: Mapping[str, str] | None, services: Services, idempotency_key: str | None
) -> Call:
    body = {
        "name": name,
        "labels": dict(labels or {}),
        "services": [_service(service) for service in services],
        "idempotency_key": idempotency_key,
    }
    return Call("POST", _sandbox(sandbox_id, "/snapshot"), json=_body(body, key_prefix="sdk-snapshot"))


def _service(service: Service | Mapping[str, Any]) -> dict[str, Any]:
    return service.to_api() if isinstance(service, Service) else dict(service)


def _exec_body(cmd: str | list[str], options: ExecOptions) -> dict[str, Any]:
    body: dict[str, Any] = {"cmd": cmd if isinstance(cmd, str) else [str(part) for part in cmd]}
    for name, value in options.items():
        if name == "stdin" and isinstance(value, bytes):
            body["stdin_b64"] = base64.b64encode(value).decode()
        elif name == "env":
            body["env"] = dict(value)  # type: ignore[call-overload]
        elif value is not None:
            body[name] = value
    return body


def _read_timeout(options: ExecOptions) -> float:
    return float(options.get("timeout_s") or 60.0) + EXEC_MARGIN_S


def run(sandbox_id: str, cmd: str | list[str], options: Mapping[str, Any], *, stream: bool = False) -> Call:
    """An exec (or its streaming variant): a POST that is never retried once sent."""
    checked_options = exec_options(options, "exec_stream" if stream else "exec")
    return Call(
        "POST",
        _sandbox(sandbox_id, "/exec/stream" if stream else "/exec"),
        json=_exec_body(cmd, checked_options),
        read_timeout_s=_read_timeout(checked_options),
        sandbox=None if stream else sandbox_id,
    )


def _id_of(item: Any) -> str:
    return str(getattr(item, "id", item))


def run_many(
    cmd: str | list[str], *, sandbox_ids: Iterable[Any] | None, launch: Any, label: str | None, options: Mapping[str, Any]
) -> Call:
    """A command in many sandboxes (``POST /exec``): answered line by line, as each finishes.  Each line
    comes within the command's own timeout of the one before, so that is the read timeout."""
    checked_options = exec_options(options, "exec_many")
    body = _exec_body(cmd, checked_options)
    if sandbox_ids is not None:
        body["sandbox_ids"] = [_id_of(item) for item in sandbox_ids]
    if launch is not None:
        body["launch"] = _id_of(launch)
    if label is not None:
        body["label"] = label
    return Call("POST", "/exec", json=body, read_timeout_s=_read_timeout(checked_options))


def batch_line(line: str | bytes) -> BatchResult | BatchSummary | None:
    """One line of ``POST /exec`` (newline-delimited JSON); None for a blank line."""
    if not line.strip():
        return None
    event = json.loads(line)
    kind = event.get("type")
    if kind == "summary":
        return BatchSummary.from_api(event)
    sandbox_id = str(event.get("sandbox_id", ""))
    if kind == "error":
        return BatchResult(sandbox_id, error=error_from_body(int(event.get("status") or 500), event.get("error") or {}))
    return BatchResult(sandbox_id, result=ExecResult.from_api(event))


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


# --- background processes --------------------------------------------------------------


class ProcessOptions(TypedDict, total=False):
    """How to start a background process (``sandbox.processes.start``).

    ``cwd`` and ``env`` inside the sandbox; ``timeout_s`` after which it and
    everything it started are killed (none: no limit); ``pty`` to run it on
    a terminal, ``{"rows": 24, "cols": 80}`` (its output is then one stream,
    stdout); ``user``, a name or uid of the sandbox's ``/etc/passwd``, as
    for an exec; ``output="base64"`` for exact bytes instead of UTF-8 text.
    ``timeout`` and ``workdir`` are other names for ``timeout_s`` and ``cwd``.
    """

    cwd: str
    env: Mapping[str, str]
    timeout_s: float
    pty: Mapping[str, int]
    user: str | int
    output: Literal["text", "base64"]
    timeout: float  # another name for timeout_s
    workdir: str  # another name for cwd


WAIT_MARGIN_S = 30.0
MAX_WAIT_S = 300.0
"""The longest one wait request may take (the API's limit); longer waits are several."""


def _process(sandbox_id: str, pid: int, suffix: str = "") -> str:
    return _sandbox(sandbox_id, f"/processes/{int(pid)}{suffix}")


def start_process(sandbox_id: str, cmd: str | list[str], options: Mapping[str, Any]) -> Call:
    """A POST never retried once sent: a retry could start it twice."""
    body: dict[str, Any] = {"cmd": cmd if isinstance(cmd, str) else [str(part) for part in cmd]}
    for name, value in checked(options, ProcessOptions, "processes.start", EXEC_ALIASES).items():
        if value is not None:
            body[name] = dict(value) if isinstance(value, Mapping) else value
    return Call("POST", _sandbox(sandbox_id, "/processes"), json=body)


def list_processes(sandbox_id: str) -> Call:
    return Call("GET", _sandbox(sandbox_id, "/processes"))


def get_process(sandbox_id: str, pid: int, stdout_offset: int, stderr_offset: int, output: str) -> Call:
    params = {"stdout_offset": stdout_offset, "stderr_offset": stderr_offset, "output": output}
    return Call("GET", _process(sandbox_id, pid), params=params)


def signal_process(sandbox_id: str, pid: int, signal: str | int, group: bool) -> Call:
    return Call("POST", _process(sandbox_id, pid, "/signal"), json={"signal": signal, "group": group})


def wait_process(sandbox_id: str, pid: int, timeout_s: float, stdout_offset: int, stderr_offset: int, output: str) -> Call:
    body = {"timeout_s": timeout_s, "stdout_offset": stdout_offset, "stderr_offset": stderr_offset, "output": output}
    return Call("POST", _process(sandbox_id, pid, "/wait"), json=body, read_timeout_s=timeout_s + WAIT_MARGIN_S)


def process_input(sandbox_id: str, pid: int, data: str | bytes, eof: bool) -> Call:
    body: dict[str, Any] = {"eof": eof}
    if isinstance(data, bytes):
        body["data_b64"] = base64.b64encode(data).decode()
    else:
        body["data"] = data
    return Call("POST", _process(sandbox_id, pid, "/input"), json=body)


def resize_process(sandbox_id: str, pid: int, rows: int, cols: int) -> Call:
    return Call("POST", _process(sandbox_id, pid, "/resize"), json={"rows": rows, "cols": cols})


# --- ports -----------------------------------------------------------------------------

PortAuth = Literal["key", "token", "public"]


def expose_port(sandbox_id: str, port: int, auth: str, token_ttl_s: int | None) -> Call:
    body: dict[str, Any] = {"port": port, "auth": auth}
    if token_ttl_s is not None:
        body["token_ttl_s"] = token_ttl_s
    return Call("POST", _sandbox(sandbox_id, "/ports"), json=body)


def list_ports(sandbox_id: str) -> Call:
    return Call("GET", _sandbox(sandbox_id, "/ports"))


def close_port(sandbox_id: str, port: int) -> Call:
    return Call("DELETE", _sandbox(sandbox_id, f"/ports/{int(port)}"))


def wait_port(sandbox_id: str, port: int, timeout_s: float) -> Call:
    return Call(
        "POST",
        _sandbox(sandbox_id, f"/ports/{int(port)}/wait"),
        json={"timeout_s": timeout_s},
        read_timeout_s=timeout_s + WAIT_MARGIN_S,
    )


# --- desktop ---------------------------------------------------------------------------


def desktop_info(sandbox_id: str) -> Call:
    return Call("GET", _sandbox(sandbox_id, "/desktop"))


def desktop_screenshot(sandbox_id: str, body: dict[str, Any]) -> Call:
    return Call("POST", _sandbox(sandbox_id, "/desktop/screenshot"), json=body)


def desktop_actions(sandbox_id: str, actions: Iterable[Mapping[str, Any]]) -> Call:
    items = [dict(action) for action in actions]
    seconds = sum(float(item.get("seconds") or 0) for item in items)
    return Call("POST", _sandbox(sandbox_id, "/desktop/actions"), json={"actions": items}, read_timeout_s=60 + seconds)


def desktop_view(sandbox_id: str, mode: str, token_ttl_s: int | None) -> Call:
    body: dict[str, Any] = {"mode": mode}
    if token_ttl_s is not None:
        body["token_ttl_s"] = token_ttl_s
    return Call("POST", _sandbox(sandbox_id, "/desktop/view"), json=body)


# --- files -----------------------------------------------------------------------------


def read_file(sandbox_id: str, path: str) -> Call:
    return Call("GET", _sandbox(sandbox_id, "/files"), params={"path": path}, read_timeout_s=300, sandbox=sandbox_id)


def write_file(sandbox_id: str, path: str, data: Body, mode: int, make_parents: bool) -> Call:
    return Call(
        "PUT",
        _sandbox(sandbox_id, "/files"),
        params={"path": path, "mode": mode, "make_parents": str(make_parents).lower()},
        content=data.encode() if isinstance(data, str) else data,
        headers={"Content-Type": "application/octet-stream"},
        read_timeout_s=300,
        sandbox=sandbox_id,
    )


def list_files(sandbox_id: str, path: str) -> Call:
    return Call("GET", _sandbox(sandbox_id, "/files/list"), params={"path": path})


def remove_file(sandbox_id: str, path: str, recursive: bool) -> Call:
    return Call("DELETE", _sandbox(sandbox_id, "/files"), params={"path": path, "recursive": str(recursive).lower()})


def stat_file(sandbox_id: str, path: str) -> Call:
    return Call("GET", _sandbox(sandbox_id, "/files/stat"), params={"path": path})


def rename_file(sandbox_id: str, path: str, target: str, replace: bool) -> Call:
    return Call("POST", _sandbox(sandbox_id, "/files/rename"), json={"path": path, "target": target, "replace": replace})


def make_directory(sandbox_id: str, path: str) -> Call:
    return Call("POST", _sandbox(sandbox_id, "/files/mkdir"), json={"path": path})


WATCH_FOREVER_S = 24 * 3600.0


def watch(sandbox_id: str, path: str, timeout_s: float | None) -> Call:
    """A watch's lines come when the directory changes, so the read waits as long as the watch may last."""
    params: dict[str, Any] = {"path": path}
    if timeout_s is not None:
        params["timeout_s"] = timeout_s
    return Call(
        "GET",
        _sandbox(sandbox_id, "/files/watch"),
        params=params,
        read_timeout_s=(WATCH_FOREVER_S if timeout_s is None else timeout_s) + EXEC_MARGIN_S,
    )


def watch_line(line: str | bytes) -> WatchEvent | None:
    """One line of ``GET .../files/watch``; an ``error`` line is raised as its typed error."""
    if not line.strip():
        return None
    event = json.loads(line)
    if event.get("type") == "error":
        raise error_from_body(int(event.get("status") or 500), event)
    return WatchEvent.from_api(event)


def download(sandbox_id: str, path: str) -> Call:
    return Call("GET", _sandbox(sandbox_id, "/archive"), params={"path": path}, read_timeout_s=300)


def upload(sandbox_id: str, path: str, tar: Body) -> Call:
    return Call(
        "PUT",
        _sandbox(sandbox_id, "/archive"),
        params={"path": path},
        content=tar,
        headers={"Content-Type": "application/x-tar"},
        read_timeout_s=300,
    )


# --- launches --------------------------------------------------------------------------


def create_launch(count: int, options: SandboxOptions, memory_group_size: int = 1, memory_group_cpu: str = "each") -> Call:
    body = {**_body(sandbox_options(options, "launches.create"), key_prefix="sdk-launch"), "count": count}
    if memory_group_size != 1:
        body["memory_group_size"] = memory_group_size
    if memory_group_cpu != "each":
        body["memory_group_cpu"] = memory_group_cpu
    return Call("POST", "/launches", json=body)


def get_launch(launch_id: str) -> Call:
    return Call("GET", f"/launches/{_segment(launch_id)}")


def launch_metrics(launch_id: str) -> Call:
    return Call("GET", f"/launches/{_segment(launch_id)}/metrics")


def list_launches(limit: int, cursor: str | None) -> Call:
    return Call("GET", "/launches", params={"limit": limit, "cursor": cursor})


def launch_sandboxes(launch_id: str, state: str | None, limit: int, cursor: str | None) -> Call:
    params = {"state": state, "limit": limit, "cursor": cursor}
    return Call("GET", f"/launches/{_segment(launch_id)}/sandboxes", params=params)


def launch_arrivals(launch_id: str) -> Call:
    return Call("GET", f"/launches/{_segment(launch_id)}/arrivals")


def destroy_launch(launch_id: str) -> Call:
    return Call("DELETE", f"/launches/{_segment(launch_id)}")


# --- templates, snapshots, network policies ----------------------------------------------
# These builders are also the signatures and docstrings of the methods made from them (``_resources``).

Rules = Iterable[EgressRule | Mapping[str, Any]]


def list_templates(*, limit: int = 100, cursor: str | None = None) -> Call:
    """The templates the team can start sandboxes from (shared ones and its own), by name, a page at a time."""
    return Call("GET", "/templates", params={"limit": limit, "cursor": cursor})


def get_template(name: str) -> Call:
    """One template by name; ``NotFound`` if the team cannot use it."""
    return Call("GET", f"/templates/{_segment(name)}")


def start_template_build(spec: Mapping[str, Any]) -> Call:
    """Start a build of one of the team's templates from a spec (``TemplateSpec.to_api`` makes one); the build,
    at once. ``fy.templates.build`` starts one and waits for it."""
    return Call("POST", "/templates", json=dict(spec))


def get_template_build(name: str) -> Call:
    """The last build of one of the team's templates: its steps, state and, once failed, its error."""
    return Call("GET", f"/templates/{_segment(name)}/build")


def follow_template_build(name: str) -> Call:
    """The build's log as it comes, newline-delimited JSON, until it ends."""
    return Call("GET", f"/templates/{_segment(name)}/build/logs", read_timeout_s=60)


def delete_template(name: str) -> Call:
    """Delete one of the team's templates; ``Conflict`` (``template_in_use``) while sandboxes of it live."""
    return Call("DELETE", f"/templates/{_segment(name)}")


def list_snapshots(state: str | None, label: str | None, limit: int, cursor: str | None, before: str | None = None) -> Call:
    params = {"state": state, "label": label, "limit": limit, "cursor": cursor, "before": before}
    return Call("GET", "/snapshots", params=params)


def get_snapshot(snapshot_id: str) -> Call:
    return Call("GET", f"/snapshots/{_segment(snapshot_id)}")


def delete_snapshot(snapshot_id: str) -> Call:
    return Call("DELETE", f"/snapshots/{_segment(snapshot_id)}")


ImageKind = Literal["auto", "oci", "tar"]


def import_image(archive: Body, name: str, kind: ImageKind, user: str | None) -> Call:
    params: dict[str, Any] = {"name": name, "kind": kind}
    if user is not None:
        params["user"] = user
    return Call(
        "POST",
        "/snapshots/import",
        params=params,
        content=archive,
        headers={"Content-Type": "application/x-tar"},
        read_timeout_s=1800,
    )


def _policy(name: str, egress: Rules, description: str, same_launch: bool) -> dict[str, Any]:
    rules = [rule.to_api() if isinstance(rule, EgressRule) else dict(rule) for rule in egress]
    return {"name": name, "description": description, "egress": rules, "same_launch": same_launch}


def list_policies(*, limit: int = 100, cursor: str | None = None) -> Call:
    """The team's network policies, by name, a page at a time."""
    return Call("GET", "/network-policies", params={"limit": limit, "cursor": cursor})


def create_policy(*, name: str, egress: Rules = (), description: str = "", same_launch: bool = False) -> Call:
    """A policy allowing only ``egress``: ``EgressRule``s, or dicts with ``cidr`` or ``host``
    (``*.example.org``: its subdomains), ``ports``, ``protocol``; ``same_launch``: a launch's sandboxes under it
    may reach each other."""
    return Call("POST", "/network-policies", json=_policy(name, egress, description, same_launch))


def get_policy(policy_id: str) -> Call:
    """One network policy by id."""
    return Call("GET", f"/network-policies/{_segment(policy_id)}")


def update_policy(policy_id: str, *, name: str, egress: Rules = (), description: str = "", same_launch: bool = False) -> Call:
    """Replace a policy's name, description, rules and ``same_launch``; its running sandboxes take the new rules
    before this returns (``applied_to``, ``apply_failed``)."""
    return Call("PUT", f"/network-policies/{_segment(policy_id)}", json=_policy(name, egress, description, same_launch))


def delete_policy(policy_id: str) -> Call:
    """Delete a network policy."""
    return Call("DELETE", f"/network-policies/{_segment(policy_id)}")


# --- leases ----------------------------------------------------------------------------


def create_lease(*, grace_s: int = 60) -> Call:
    """A lease: sandboxes and launches that name it (``lease=``) are destroyed once no heartbeat has
    come for ``grace_s`` seconds, or once it is ended.  (``Client(lease=True)`` takes and heartbeats one.)"""
    return Call("POST", "/leases", json={"grace_s": grace_s})


def get_lease(lease_id: str) -> Call:
    """One lease: its ``state`` (active, expired, ended), ``expires_at``, ``sandboxes_alive``."""
    return Call("GET", f"/leases/{_segment(lease_id)}")


def list_leases(*, state: str | None = None, limit: int = 100, cursor: str | None = None) -> Call:
    """The team's leases, newest first, a page at a time."""
    return Call("GET", "/leases", params={"state": state, "limit": limit, "cursor": cursor})


def heartbeat_lease(lease_id: str) -> Call:
    """Keep a lease alive for another ``grace_s``; ``Conflict`` (``lease_expired``, ``lease_ended``) once it is over."""
    return Call("POST", f"/leases/{_segment(lease_id)}/heartbeat")


def end_lease(lease_id: str) -> Call:
    """End a lease: every sandbox and launch named with it is destroyed now."""
    return Call("DELETE", f"/leases/{_segment(lease_id)}")


# --- account ---------------------------------------------------------------------------


def list_keys(*, limit: int = 100, cursor: str | None = None) -> Call:
    """The team's API keys (without their secrets), newest first, a page at a time."""
    return Call("GET", "/keys", params={"limit": limit, "cursor": cursor})


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
    return Call(
        "GET",
        "/usage",
        params={"start": start.isoformat() if start else None, "end": end.isoformat() if end else None, "group_by": group_by},
    )


def me() -> Call:
    """The calling key, its team and the team's limits."""
    return Call("GET", "/me")
