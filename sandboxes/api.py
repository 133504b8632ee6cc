"""The public API for sandboxes, launches, templates, snapshots and network policies.

Handlers parse, check the team, and call a service; exec and files go
straight to the owning host's engine (the interactive path), the rest through
the database and Celery.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

from django.conf import settings
from django.db.models import Q
from django.http import HttpRequest, StreamingHttpResponse
from ninja import Router
from ninja.params.functions import Query  # what ninja.Query(...) calls; ninja.Query itself is typed as Annotated[T, ...]

from console.api_base import key_of
from console.db import db
from console.errors import ApiError, from_engine, not_found
from sandboxes.engine.errors import EngineError

from . import lifecycle, selectors, services, snapshots
from .engine_link import async_pool, stream_call
from .models import Launch, NetworkPolicy, Sandbox, Snapshot, Template
from .notify import wait_until
from .schemas import (
    Deleted,
    ErrorOut,
    ExecIn,
    ExecOut,
    FileList,
    FileWritten,
    LaunchCreate,
    LaunchOut,
    NetworkPolicyIn,
    NetworkPolicyOut,
    SandboxCreate,
    SandboxList,
    SandboxOut,
    SnapshotCreate,
    SnapshotOut,
    TemplateOut,
)

router = Router(tags=["sandboxes"])
ERRORS: dict[int, Any] = {400: ErrorOut, 401: ErrorOut, 404: ErrorOut, 409: ErrorOut, 429: ErrorOut, 503: ErrorOut}
SETTLED = {Sandbox.State.RUNNING, Sandbox.State.FAILED, Sandbox.State.DESTROYED, Sandbox.State.STOPPED}
GONE = {Sandbox.State.DESTROYED, Sandbox.State.FAILED, Sandbox.State.STOPPED}
UPLOAD_CHUNK = 256 * 1024


def _spec(payload: SandboxCreate) -> services.CreateSpec:
    return services.CreateSpec(
        template=payload.template,
        snapshot=payload.snapshot,
        size=payload.size,
        cpu=payload.cpu,
        memory_mib=payload.memory_mib,
        ttl_s=payload.ttl_s,
        network_policy=payload.network_policy,
        env=payload.env,
        labels=payload.labels,
        idempotency_key=payload.idempotency_key,
    )


# --- sandboxes --------------------------------------------------------------------------


@router.post("/sandboxes", response={200: SandboxOut, 201: SandboxOut, 202: SandboxOut, **ERRORS}, summary="Create a sandbox")
async def create_sandbox(request: HttpRequest, payload: SandboxCreate) -> tuple[int, dict[str, Any]]:
    """Create one sandbox from a template or a snapshot.

    With `wait` (the default) the answer comes once it runs: 201, or 200 for a
    retry with the same `idempotency_key`. If it is still starting after a
    while, or `wait` is false: 202, and its state says where it is.
    """
    key = key_of(request)
    sandbox, created = await db(services.sandbox_create)(team=key.team, key=key, spec=_spec(payload), direct=payload.wait)
    if created and sandbox.state == Sandbox.State.CREATING:
        sandbox = await lifecycle.start_directly(sandbox)
    if payload.wait and sandbox.state not in SETTLED:
        sandbox = await wait_until(sandbox.id, SETTLED, settings.FORKYARD_CREATE_WAIT_S)
    if sandbox.state == Sandbox.State.FAILED and sandbox.error_code and not sandbox.ready_at:
        # The same answer for the first call and for a retry with its key.
        # The host could not start it (bad input was refused before this point).
        raise ApiError(
            sandbox.error_code or "create_failed",
            sandbox.error_message or "the sandbox failed to start",
            status=503,
            retry_after_s=5,
            details={"sandbox": sandbox.id},
        )
    status = 201 if created else 200
    if sandbox.state in (Sandbox.State.QUEUED, Sandbox.State.CREATING):
        status = 202
    return status, selectors.sandbox_out(sandbox)


def _check_state(state: str | None) -> None:
    if state is not None and state not in Sandbox.State.values:
        raise ApiError("invalid_request", f"state must be one of {', '.join(Sandbox.State.values)}", field="state")


@router.get("/sandboxes", response={200: SandboxList, **ERRORS}, summary="List sandboxes")
async def list_sandboxes(
    request: HttpRequest,
    state: str | None = None,
    label: str | None = Query(None, description="key=value or key"),
    limit: int = Query(100, ge=1, le=1000),
    cursor: str | None = None,
) -> dict[str, Any]:
    key = key_of(request)
    _check_state(state)
    page, next_cursor = await db(selectors.sandboxes_page)(key.team, state, label, limit, cursor)
    return {"sandboxes": [selectors.sandbox_out(sandbox) for sandbox in page], "next_cursor": next_cursor}


@router.get("/sandboxes/{sandbox_id}", response={200: SandboxOut, **ERRORS}, summary="Get a sandbox")
async def get_sandbox(request: HttpRequest, sandbox_id: str) -> dict[str, Any]:
    sandbox = await db(selectors.sandbox_for)(key_of(request).team, sandbox_id)
    return selectors.sandbox_out(sandbox)


@router.delete("/sandboxes/{sandbox_id}", response={200: SandboxOut, 202: SandboxOut, **ERRORS}, summary="Destroy a sandbox")
async def destroy_sandbox(request: HttpRequest, sandbox_id: str, wait: bool = True) -> tuple[int, dict[str, Any]]:
    team = key_of(request).team
    sandbox = await db(selectors.sandbox_for)(team, sandbox_id)
    sandbox = await db(services.sandbox_destroy)(sandbox=sandbox)
    if wait and sandbox.state not in GONE:
        sandbox = await wait_until(sandbox.id, GONE, settings.FORKYARD_CREATE_WAIT_S)
    return (200 if sandbox.state in GONE else 202), selectors.sandbox_out(sandbox)


def _running(team_id: str, sandbox_id: str) -> tuple[Sandbox, str]:
    sandbox = Sandbox.objects.select_related("host").filter(team_id=team_id, pk=sandbox_id).first()
    if sandbox is None:
        raise not_found("sandbox", sandbox_id)
    if sandbox.state not in (Sandbox.State.RUNNING, Sandbox.State.PAUSED) or not sandbox.engine_id or sandbox.host is None:
        raise ApiError(
            "sandbox_not_running", f"sandbox {sandbox_id} is {sandbox.state}", status=409, details={"state": sandbox.state}
        )
    return sandbox, sandbox.host.engine_socket


async def _engine_call(team_id: str, sandbox_id: str, op: str, **args: Any) -> tuple[Sandbox, Any]:
    sandbox, socket_path = await db(_running)(team_id, sandbox_id)
    try:
        async with async_pool(socket_path).client() as client:
            return sandbox, await client.call(op, id=sandbox.engine_id, **args)
    except EngineError as error:
        raise from_engine(error) from None


def _decode(data: bytes, encoding: str) -> str:
    return base64.b64encode(data).decode() if encoding == "base64" else data.decode("utf-8", "replace")


@router.post("/sandboxes/{sandbox_id}/exec", response={200: ExecOut, **ERRORS}, summary="Run a command")
async def exec_command(request: HttpRequest, sandbox_id: str, payload: ExecIn) -> dict[str, Any]:
    """Run a command and wait for it. A timeout is a result (`timed_out`), not an error."""
    key = key_of(request)
    args = payload.dict(exclude={"output"}, exclude_none=True)
    _, result = await _engine_call(key.team_id, sandbox_id, "exec", **args)
    stdout = base64.b64decode(result.pop("stdout_b64", ""))
    stderr = base64.b64decode(result.pop("stderr_b64", ""))
    return {
        **{name: result.get(name) for name in ExecOut.model_fields if name in result},
        "stdout": _decode(stdout, payload.output),
        "stderr": _decode(stderr, payload.output),
        "encoding": payload.output,
    }


@router.post("/sandboxes/{sandbox_id}/exec/stream", response={200: None, **ERRORS}, summary="Run a command, streaming its output")
async def exec_stream(request: HttpRequest, sandbox_id: str, payload: ExecIn) -> StreamingHttpResponse:
    """Newline-delimited JSON: `{"type": "stdout"|"stderr", "data": ...}` as output comes,
    then `{"type": "exit", ...}` with the same fields as a plain exec."""
    key = key_of(request)
    sandbox, socket_path = await db(_running)(key.team_id, sandbox_id)
    args = {**payload.dict(exclude={"output"}, exclude_none=True), "id": sandbox.engine_id, "stream": True}

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for kind, message in stream_call(socket_path, "exec", args):
                if kind == "event":
                    data = base64.b64decode(message["data_b64"])
                    yield (json.dumps({"type": message["stream"], "data": _decode(data, payload.output)}) + "\n").encode()
                elif kind == "result":
                    yield (json.dumps({"type": "exit", **message, "encoding": payload.output}) + "\n").encode()
        except EngineError as error:
            failure = from_engine(error)
            yield (json.dumps({"type": "error", "status": failure.status, **failure.body()["error"]}) + "\n").encode()

    return StreamingHttpResponse(lines(), content_type="application/x-ndjson")


async def _download(request: HttpRequest, sandbox_id: str, op: str, path: str, content_type: str) -> StreamingHttpResponse:
    """Stream an engine's byte stream to the caller; errors surface before the first byte."""
    sandbox, socket_path = await db(_running)(key_of(request).team_id, sandbox_id)
    stream = stream_call(socket_path, op, {"id": sandbox.engine_id, "path": path})
    try:
        await stream.__anext__()  # the header: not found, not a file, ... are raised here
    except EngineError as error:
        raise from_engine(error) from None

    async def chunks() -> AsyncIterator[bytes]:
        async for kind, data in stream:
            if kind == "data":
                yield data

    return StreamingHttpResponse(chunks(), content_type=content_type)


async def _body_chunks(request: HttpRequest) -> AsyncIterator[bytes]:
    while chunk := await db(request.read)(UPLOAD_CHUNK):
        yield chunk


async def _upload(request: HttpRequest, sandbox_id: str, op: str, **args: Any) -> Any:
    """Stream the request body to an engine operation that takes one."""
    sandbox, socket_path = await db(_running)(key_of(request).team_id, sandbox_id)
    try:
        async for kind, result in stream_call(socket_path, op, {"id": sandbox.engine_id, **args}, body=_body_chunks(request)):
            if kind == "result":
                return result
    except EngineError as error:
        raise from_engine(error) from None
    raise ApiError("internal_error", "the engine gave no answer", status=500)


@router.get("/sandboxes/{sandbox_id}/files", response={200: None, **ERRORS}, summary="Read a file")
async def read_file(request: HttpRequest, sandbox_id: str, path: str) -> StreamingHttpResponse:
    return await _download(request, sandbox_id, "files.read", path, "application/octet-stream")


@router.put("/sandboxes/{sandbox_id}/files", response={200: FileWritten, **ERRORS}, summary="Write a file")
async def write_file(request: HttpRequest, sandbox_id: str, path: str, mode: int = 0o644, make_parents: bool = True) -> Any:
    """The request body is the file's content (any bytes). Parents are created unless make_parents is false."""
    return await _upload(request, sandbox_id, "files.write", path=path, mode=mode, make_parents=make_parents)


@router.get("/sandboxes/{sandbox_id}/files/list", response={200: FileList, **ERRORS}, summary="List a directory")
async def list_files(request: HttpRequest, sandbox_id: str, path: str = "/") -> Any:
    _, result = await _engine_call(key_of(request).team_id, sandbox_id, "files.list", path=path)
    return result


@router.delete("/sandboxes/{sandbox_id}/files", response={200: dict, **ERRORS}, summary="Remove a file or directory")
async def remove_file(request: HttpRequest, sandbox_id: str, path: str, recursive: bool = False) -> Any:
    _, result = await _engine_call(key_of(request).team_id, sandbox_id, "files.remove", path=path, recursive=recursive)
    return result


@router.get("/sandboxes/{sandbox_id}/archive", response={200: None, **ERRORS}, summary="Download a directory as tar")
async def download_archive(request: HttpRequest, sandbox_id: str, path: str = "/") -> StreamingHttpResponse:
    return await _download(request, sandbox_id, "files.download", path, "application/x-tar")


@router.put("/sandboxes/{sandbox_id}/archive", response={200: dict, **ERRORS}, summary="Upload a tar into a directory")
async def upload_archive(request: HttpRequest, sandbox_id: str, path: str = "/") -> Any:
    return await _upload(request, sandbox_id, "files.upload", path=path)


@router.post("/sandboxes/{sandbox_id}/pause", response={200: SandboxOut, **ERRORS}, summary="Pause a sandbox")
async def pause(request: HttpRequest, sandbox_id: str) -> dict[str, Any]:
    """Freeze every process in it. Paused time is billed at the paused rate."""
    sandbox, _ = await _engine_call(key_of(request).team_id, sandbox_id, "pause")
    return selectors.sandbox_out(await db(services.sandbox_record_pause)(sandbox_id=sandbox.id, state=Sandbox.State.PAUSED))


@router.post("/sandboxes/{sandbox_id}/resume", response={200: SandboxOut, **ERRORS}, summary="Resume a paused sandbox")
async def resume(request: HttpRequest, sandbox_id: str) -> dict[str, Any]:
    sandbox, _ = await _engine_call(key_of(request).team_id, sandbox_id, "resume")
    return selectors.sandbox_out(await db(services.sandbox_record_pause)(sandbox_id=sandbox.id, state=Sandbox.State.RUNNING))


# --- launches -------------------------------------------------------------------------------


@router.post("/launches", response={200: LaunchOut, 201: LaunchOut, **ERRORS}, tags=["launches"], summary="Launch many sandboxes")
async def create_launch(request: HttpRequest, payload: LaunchCreate) -> tuple[int, dict[str, Any]]:
    """`count` sandboxes from one template or snapshot, spread over hosts in chunks.
    Follow progress at `GET /launches/{id}`; forking a snapshot N times is a launch."""
    key = key_of(request)
    launch, created = await db(services.launch_create)(team=key.team, key=key, spec=_spec(payload), count=payload.count)
    return (201 if created else 200), await db(selectors.launch_out)(launch)


@router.get("/launches", response={200: list[LaunchOut], **ERRORS}, tags=["launches"], summary="List launches")
async def list_launches(
    request: HttpRequest,
    limit: int = Query(50, ge=1, le=500),
    before: str | None = Query(None, description="a launch id: list older ones"),
) -> list[dict[str, Any]]:
    """Newest first; pass the last id you got as `before` for the next page."""

    def fetch() -> list[dict[str, Any]]:
        rows = Launch.objects.filter(team=key_of(request).team)
        if before:
            anchor = rows.filter(pk=before).values_list("created_at", flat=True).first()
            if anchor is None:
                raise not_found("launch", before)
            rows = rows.filter(Q(created_at__lt=anchor) | Q(created_at=anchor, id__lt=before))
        return [selectors.launch_out(launch) for launch in rows.order_by("-created_at", "-id")[:limit]]

    return await db(fetch)()


@router.get("/launches/{launch_id}", response={200: LaunchOut, **ERRORS}, tags=["launches"], summary="A launch and its progress")
async def get_launch(request: HttpRequest, launch_id: str) -> dict[str, Any]:
    def fetch() -> dict[str, Any]:
        return selectors.launch_out(selectors.launch_for(key_of(request).team, launch_id))

    return await db(fetch)()


@router.get(
    "/launches/{launch_id}/sandboxes", response={200: SandboxList, **ERRORS}, tags=["launches"], summary="A launch's sandboxes"
)
async def launch_sandboxes(
    request: HttpRequest,
    launch_id: str,
    state: str | None = None,
    limit: int = Query(1000, ge=1, le=5000),
    cursor: str | None = None,
) -> dict[str, Any]:
    _check_state(state)
    if cursor is not None and not (cursor.isdigit() and len(cursor) <= 9):
        raise ApiError("invalid_request", "cursor is not one this API gave out", field="cursor")

    def fetch() -> dict[str, Any]:
        launch = selectors.launch_for(key_of(request).team, launch_id)
        rows = Sandbox.objects.select_related("host").filter(launch=launch)
        if state:
            rows = rows.filter(state=state)
        if cursor:
            rows = rows.filter(launch_index__gt=int(cursor))
        page = list(rows.order_by("launch_index")[: limit + 1])
        more = len(page) > limit
        page = page[:limit]
        return {
            "sandboxes": [selectors.sandbox_out(row) for row in page],
            "next_cursor": str(page[-1].launch_index) if more else None,
        }

    return await db(fetch)()


@router.delete("/launches/{launch_id}", response={200: LaunchOut, **ERRORS}, tags=["launches"], summary="Tear a launch down")
async def destroy_launch(request: HttpRequest, launch_id: str) -> dict[str, Any]:
    def act() -> dict[str, Any]:
        launch = selectors.launch_for(key_of(request).team, launch_id)
        return selectors.launch_out(services.launch_destroy(launch=launch))

    return await db(act)()


# --- templates and snapshots -----------------------------------------------------------------


def _template_out(template: Template) -> dict[str, Any]:
    return {
        "name": template.name,
        "description": template.description,
        "size_bytes": template.size_bytes,
        "created_at": template.created_at,
        "hosts": [host.name for host in template.hosts.all()],
    }


@router.get("/templates", response={200: list[TemplateOut], **ERRORS}, tags=["templates"], summary="List templates")
async def list_templates(request: HttpRequest) -> list[dict[str, Any]]:
    team = key_of(request).team

    def fetch() -> list[dict[str, Any]]:
        rows = Template.objects.filter(Q(team__isnull=True) | Q(team=team)).prefetch_related("hosts").order_by("name")
        return [_template_out(template) for template in rows]

    return await db(fetch)()


@router.get("/templates/{name}", response={200: TemplateOut, **ERRORS}, tags=["templates"], summary="Get a template")
async def get_template(request: HttpRequest, name: str) -> dict[str, Any]:
    team = key_of(request).team

    def fetch() -> dict[str, Any]:
        template = Template.objects.filter(Q(team__isnull=True) | Q(team=team), name=name).first()
        if template is None:
            raise not_found("template", name)
        return _template_out(template)

    return await db(fetch)()


@router.post(
    "/sandboxes/{sandbox_id}/snapshot",
    response={200: SnapshotOut, 202: SnapshotOut, **ERRORS},
    tags=["snapshots"],
    summary="Snapshot a sandbox",
)
async def snapshot_sandbox(request: HttpRequest, sandbox_id: str, payload: SnapshotCreate) -> tuple[int, dict[str, Any]]:
    """Save a running or paused sandbox's filesystem as a snapshot to fork from.

    Answers 202 at once with the snapshot `creating`; follow it at
    `GET /snapshots/{id}` until `ready` (or `failed`, with its `error`). The
    sandbox keeps running (a paused one stays paused); `paused_ms` says how
    long it was frozen while its layer was taken. Process memory is not
    saved: list the `services` (a command and a readiness check each) that
    every fork starts, and a fork is running only once they all answer (a
    fork whose service is not ready in its `timeout_s` fails with
    `service_not_ready`). A retry with the same `idempotency_key` answers 200
    with the first snapshot. Saved state is billed per GiB-hour of the
    snapshot's own layer from ready to deleted.
    """
    key = key_of(request)

    def act() -> tuple[Snapshot, bool]:
        sandbox = selectors.sandbox_for(key.team, sandbox_id)
        return snapshots.snapshot_create(
            team=key.team,
            key=key,
            sandbox=sandbox,
            name=payload.name,
            labels=payload.labels,
            services=[service.model_dump(exclude_none=True) for service in payload.services],
            idempotency_key=payload.idempotency_key,
        )

    snapshot, created = await db(act)()
    return (202 if created else 200), await db(selectors.snapshot_out)(snapshot)


def _check_snapshot_state(state: str | None) -> None:
    if state is not None and state not in Snapshot.State.values:
        raise ApiError("invalid_request", f"state must be one of {', '.join(Snapshot.State.values)}", field="state")


@router.get("/snapshots", response={200: list[SnapshotOut], **ERRORS}, tags=["snapshots"], summary="List snapshots")
async def list_snapshots(
    request: HttpRequest,
    state: str | None = None,
    label: str | None = Query(None, description="key=value or key"),
    limit: int = Query(100, ge=1, le=1000),
    before: str | None = Query(None, description="a snapshot id: list older ones"),
) -> list[dict[str, Any]]:
    """The team's snapshots, newest first (deleted ones are not listed); pass the
    last id you got as `before` for the next page."""
    team = key_of(request).team
    _check_snapshot_state(state)

    def fetch() -> list[dict[str, Any]]:
        return [selectors.snapshot_out(snapshot) for snapshot in selectors.snapshots_page(team, state, label, limit, before)]

    return await db(fetch)()


@router.get("/snapshots/{snapshot_id}", response={200: SnapshotOut, **ERRORS}, tags=["snapshots"], summary="Get a snapshot")
async def get_snapshot(request: HttpRequest, snapshot_id: str) -> dict[str, Any]:
    def fetch() -> dict[str, Any]:
        return selectors.snapshot_out(selectors.snapshot_for(key_of(request).team, snapshot_id))

    return await db(fetch)()


@router.delete("/snapshots/{snapshot_id}", response={200: SnapshotOut, **ERRORS}, tags=["snapshots"], summary="Delete a snapshot")
async def delete_snapshot(request: HttpRequest, snapshot_id: str) -> dict[str, Any]:
    """Delete a snapshot nothing uses any more.

    Refused with 409 `snapshot_in_use` (details: `forks_alive`,
    `launches_starting`) while a live sandbox was forked from it or a launch
    from it is still starting: destroy them first. Otherwise it is deleted at
    once: its saved-state billing ends now, new forks are refused, and its
    hosts forget it. Snapshots taken from its forks stay usable (they keep
    the layers they share with it). Answers the snapshot, `deleted`.
    """

    def act() -> dict[str, Any]:
        snapshot = selectors.snapshot_for(key_of(request).team, snapshot_id)
        return selectors.snapshot_out(snapshots.snapshot_delete(snapshot=snapshot))

    return await db(act)()


# --- network policies -------------------------------------------------------------------------------

policies = Router(tags=["network policies"])


@policies.get("/network-policies", response={200: list[NetworkPolicyOut], **ERRORS}, summary="List network policies")
async def list_policies(request: HttpRequest) -> list[dict[str, Any]]:
    team = key_of(request).team
    return await db(lambda: [selectors.policy_out(p) for p in NetworkPolicy.objects.filter(team=team).order_by("name")])()


@policies.post("/network-policies", response={201: NetworkPolicyOut, **ERRORS}, summary="Create a network policy")
async def create_policy(request: HttpRequest, payload: NetworkPolicyIn) -> tuple[int, dict[str, Any]]:
    team = key_of(request).team

    def act() -> dict[str, Any]:
        from .policies import policy_save

        return selectors.policy_out(
            policy_save(
                team=team,
                policy=None,
                name=payload.name,
                description=payload.description,
                egress=[rule.dict() for rule in payload.egress],
            )
        )

    return 201, await db(act)()


@policies.get("/network-policies/{policy_id}", response={200: NetworkPolicyOut, **ERRORS}, summary="Get a network policy")
async def get_policy(request: HttpRequest, policy_id: str) -> dict[str, Any]:
    team = key_of(request).team
    return await db(lambda: selectors.policy_out(selectors.policy_for(team, policy_id)))()


@policies.put("/network-policies/{policy_id}", response={200: NetworkPolicyOut, **ERRORS}, summary="Replace a network policy")
async def update_policy(request: HttpRequest, policy_id: str, payload: NetworkPolicyIn) -> dict[str, Any]:
    team = key_of(request).team

    def act() -> dict[str, Any]:
        from .policies import policy_save

        policy = selectors.policy_for(team, policy_id)
        return selectors.policy_out(
            policy_save(
                team=team,
                policy=policy,
                name=payload.name,
                description=payload.description,
                egress=[rule.dict() for rule in payload.egress],
            )
        )

    return await db(act)()


@policies.delete("/network-policies/{policy_id}", response={200: Deleted, **ERRORS}, summary="Delete a network policy")
async def delete_policy(request: HttpRequest, policy_id: str) -> dict[str, Any]:
    team = key_of(request).team

    def act() -> dict[str, Any]:
        from .policies import policy_delete

        policy_delete(policy=selectors.policy_for(team, policy_id))
        return {"id": policy_id, "deleted": True}

    return await db(act)()
