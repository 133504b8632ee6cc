"""The interactive data path: commands and files, straight from the web server to the owning host's engine.

A Celery round trip per command would not meet the latency goal, so these
handlers find the sandbox (one query), then talk to its host's engine over a
pooled async connection.  Output and file contents pass through; nothing of
them is kept.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

from django.http import HttpRequest, StreamingHttpResponse
from ninja import Router
from ninja.params.functions import Query

from console.api_base import ERRORS, key_of, status_of
from console.db import db
from console.errors import Failed
from sandboxes.engine.errors import EngineError

from .. import engine_link, selectors
from ..engine.data_path import ExecIn, ExecOut, FileWritten, decode_output, exec_answer, exec_args
from ..engine_link import stream_call
from ..models import Sandbox
from ..schemas import DirectoryMade, DirectoryMake, FileEntry, FileList, FileRename, FileRenamed

router = Router(tags=["sandboxes"])
UPLOAD_CHUNK = 256 * 1024


async def _started(request: HttpRequest, sandbox_id: str) -> tuple[Sandbox, str]:
    """The caller's sandbox, running or paused, and its engine's address."""
    sandbox = await db(selectors.started_sandbox_for)(key_of(request).team_id, sandbox_id)
    assert sandbox.host is not None  # a started sandbox has a host
    return sandbox, sandbox.host.engine_socket


async def _engine_call(request: HttpRequest, sandbox_id: str, op: str, **args: Any) -> Any:
    sandbox, address = await _started(request, sandbox_id)
    try:
        async with engine_link.async_pool(address).client() as client:
            return await client.call(op, id=sandbox.engine_id, **args)
    except EngineError as error:
        raise engine_link.refusal(error, sandbox) from None


@router.post("/sandboxes/{sandbox_id}/exec", response={200: ExecOut, **ERRORS}, summary="Run a command")
async def exec_command(request: HttpRequest, sandbox_id: str, payload: ExecIn) -> dict[str, Any]:
    """Run a command and wait for it. A timeout is a result (`timed_out`), not an error.

    A caller that goes away (its connection closed) ends the command. With an
    `idempotency_key`, sending it again is safe: nothing runs twice.

    A well-formed call is answered by the hot path (``sandboxes.api.hot_path``)
    without Django's request machinery; this view answers the rest, and every
    refusal, so that both say the same."""
    return exec_answer(await _engine_call(request, sandbox_id, "exec", **exec_args(payload)), payload)


@router.post("/sandboxes/{sandbox_id}/exec/stream", response={200: None, **ERRORS}, summary="Run a command, streaming its output")
async def exec_stream(request: HttpRequest, sandbox_id: str, payload: ExecIn) -> StreamingHttpResponse:
    """Newline-delimited JSON: `{"type": "stdout"|"stderr", "data": ...}` as output comes,
    then `{"type": "exit", ...}` with the same fields as a plain exec."""
    sandbox, address = await _started(request, sandbox_id)
    args = {**exec_args(payload), "id": sandbox.engine_id, "stream": True}

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for kind, message in stream_call(address, "exec", args):
                if kind == "event":
                    data = base64.b64decode(message["data_b64"])
                    yield (json.dumps({"type": message["stream"], "data": decode_output(data, payload.output)}) + "\n").encode()
                elif kind == "result":
                    yield (json.dumps({"type": "exit", **message, "encoding": payload.output}) + "\n").encode()
        except EngineError as error:
            failure = engine_link.refusal(error, sandbox)
            yield (json.dumps({"type": "error", "status": status_of(failure), **failure.body()["error"]}) + "\n").encode()

    return StreamingHttpResponse(lines(), content_type="application/x-ndjson")


async def _download(request: HttpRequest, sandbox_id: str, op: str, path: str, content_type: str) -> StreamingHttpResponse:
    """Stream an engine's byte stream to the caller; errors surface before the first byte."""
    sandbox, address = await _started(request, sandbox_id)
    stream = stream_call(address, op, {"id": sandbox.engine_id, "path": path})
    try:
        await stream.__anext__()  # the header: not found, not a file, ... are raised here
    except EngineError as error:
        raise engine_link.refusal(error, sandbox) from None

    async def chunks() -> AsyncIterator[bytes]:
        async for kind, data in stream:
            if kind == "data":
                yield data

    return StreamingHttpResponse(chunks(), content_type=content_type)


async def body_chunks(request: HttpRequest) -> AsyncIterator[bytes]:
    """The request's body as it arrives from the client (``console.bodies.StreamedBody``), never held whole;
    or, from a server that read it already (Django's test client, a single Daphne), in chunks of what it holds."""
    streamed = getattr(request, "body_stream", None)
    if streamed is not None:
        async for chunk in streamed.chunks():
            yield chunk
        return
    while chunk := await db(request.read)(UPLOAD_CHUNK):
        yield chunk


async def _upload(request: HttpRequest, sandbox_id: str, op: str, **args: Any) -> Any:
    """Stream the request body to an engine operation that takes one."""
    sandbox, address = await _started(request, sandbox_id)
    try:
        async for kind, result in stream_call(address, op, {"id": sandbox.engine_id, **args}, body=body_chunks(request)):
            if kind == "result":
                return result
    except EngineError as error:
        raise engine_link.refusal(error, sandbox) from None
    raise Failed("internal_error", "the engine gave no answer")


@router.get("/sandboxes/{sandbox_id}/files", response={200: None, **ERRORS}, summary="Read a file")
async def read_file(request: HttpRequest, sandbox_id: str, path: str) -> StreamingHttpResponse:
    return await _download(request, sandbox_id, "files.read", path, "application/octet-stream")


@router.put("/sandboxes/{sandbox_id}/files", response={200: FileWritten, **ERRORS}, summary="Write a file")
async def write_file(
    request: HttpRequest, sandbox_id: str, path: str, mode: int = Query(0o644, ge=0, le=0o7777), make_parents: bool = True
) -> Any:
    """The request body is the file's content (any bytes). Parents are created unless make_parents is false."""
    return await _upload(request, sandbox_id, "files.write", path=path, mode=mode, make_parents=make_parents)


@router.get("/sandboxes/{sandbox_id}/files/list", response={200: FileList, **ERRORS}, summary="List a directory")
async def list_files(request: HttpRequest, sandbox_id: str, path: str = "/") -> Any:
    return await _engine_call(request, sandbox_id, "files.list", path=path)


@router.delete("/sandboxes/{sandbox_id}/files", response={200: dict, **ERRORS}, summary="Remove a file or directory")
async def remove_file(request: HttpRequest, sandbox_id: str, path: str, recursive: bool = False) -> Any:
    return await _engine_call(request, sandbox_id, "files.remove", path=path, recursive=recursive)


@router.get("/sandboxes/{sandbox_id}/archive", response={200: None, **ERRORS}, summary="Download a directory as tar")
async def download_archive(request: HttpRequest, sandbox_id: str, path: str = "/") -> StreamingHttpResponse:
    return await _download(request, sandbox_id, "files.download", path, "application/x-tar")


@router.put("/sandboxes/{sandbox_id}/archive", response={200: dict, **ERRORS}, summary="Upload a tar into a directory")
async def upload_archive(request: HttpRequest, sandbox_id: str, path: str = "/") -> Any:
    return await _upload(request, sandbox_id, "files.upload", path=path)


@router.get("/sandboxes/{sandbox_id}/files/stat", response={200: FileEntry, **ERRORS}, summary="Describe a file")
async def stat_file(request: HttpRequest, sandbox_id: str, path: str) -> Any:
    """The entry at `path` itself (a symlink is described, with its `link_target`, not followed).
    Nothing there is `404 file_not_found`: the SDK's `exists()` is this call."""
    return await _engine_call(request, sandbox_id, "files.stat", path=path)


@router.post("/sandboxes/{sandbox_id}/files/rename", response={200: FileRenamed, **ERRORS}, summary="Rename a file or directory")
async def rename_file(request: HttpRequest, sandbox_id: str, payload: FileRename) -> Any:
    """Within the sandbox, never across one of its mounts (`/proc`, `/dev`). Without `replace`, an
    existing `target` is `409 file_exists`; with it, a file cannot replace a directory (`409 not_a_file`)
    nor a directory a file (`409 not_a_directory`) or a directory that is not empty (`409 file_exists`)."""
    return await _engine_call(
        request, sandbox_id, "files.rename", path=payload.path, target=payload.target, replace=payload.replace
    )


@router.post("/sandboxes/{sandbox_id}/files/mkdir", response={200: DirectoryMade, **ERRORS}, summary="Make a directory")
async def make_directory(request: HttpRequest, sandbox_id: str, payload: DirectoryMake) -> Any:
    """With its parents, like `mkdir -p`; one that exists already is fine, a file in the way is
    `409 not_a_directory`."""
    return await _engine_call(request, sandbox_id, "files.mkdir", path=payload.path)


@router.get("/sandboxes/{sandbox_id}/files/watch", response={200: None, **ERRORS}, summary="Watch a directory")
async def watch_directory(
    request: HttpRequest,
    sandbox_id: str,
    path: str = "/",
    timeout_s: float | None = Query(None, gt=0, le=24 * 3600),
) -> StreamingHttpResponse:
    """Newline-delimited JSON, one line per change of the directory (not of its subdirectories):
    `{"type": "ready"}` once the watch is in place, then `created`, `modified`, `attributes`,
    `deleted`, `moved_from`, `moved_to` (paired by `cookie`), each with the entry's `name` and
    `is_dir`; `{"type": "overflow", "dropped": n}` when a reader too slow (or a sandbox too busy)
    made it drop events; last `{"type": "end", "reason": ...}`: `timeout`, `sandbox_ended`,
    `directory_deleted`, `directory_moved`, `directory_unmounted`. Hanging up ends it."""
    sandbox, address = await _started(request, sandbox_id)
    args: dict[str, Any] = {"id": sandbox.engine_id, "path": path}
    if timeout_s is not None:
        args["timeout_s"] = timeout_s
    stream = stream_call(address, "files.watch", args, pooled=False)
    try:
        kind, first = await stream.__anext__()  # the watch is in place (or refused: not found, not a directory)
    except EngineError as error:
        await stream.aclose()
        raise engine_link.refusal(error, sandbox) from None

    async def lines() -> AsyncIterator[bytes]:
        try:
            yield _watch_line(first) if kind == "event" else b""
            async for each_kind, message in stream:
                if each_kind == "event":
                    yield _watch_line(message)
                elif each_kind == "result":
                    yield (json.dumps({"type": "end", "reason": message.get("reason")}) + "\n").encode()
        except EngineError as error:
            failure = engine_link.refusal(error, sandbox)
            yield (json.dumps({"type": "error", "status": status_of(failure), **failure.body()["error"]}) + "\n").encode()
        finally:
            await stream.aclose()

    return StreamingHttpResponse(lines(), content_type="application/x-ndjson")


def _watch_line(message: dict[str, Any]) -> bytes:
    return (json.dumps({key: value for key, value in message.items() if key != "event"}) + "\n").encode()
