"""Background processes: commands started without waiting, listed, read, signalled, waited; terminals.

Straight to the sandbox's engine, like exec (``data``): find the caller's
sandbox (another team's is not found), call the engine's ``processes.*``
operation (``sandboxes/engine/processes.py``), shape the answer. A
terminal's live input and output also go over a websocket (``api/pty.py``).
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from typing import Any, Literal

from django.http import HttpRequest
from ninja import Router
from ninja.params.functions import Query

from console.api_base import ERRORS

from ..engine.data_path import decode_output
from ..schemas import InputIn, InputWritten, ProcessIn, ProcessList, ProcessOut, ProcessSummary, ResizeIn, SignalIn, WaitIn
from .data import _engine_call

router = Router(tags=["processes"])
Encoding = Literal["text", "base64"]


def _when(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The API's ``ProcessSummary`` of an engine's process."""
    return {
        **{name: result.get(name) for name in ProcessSummary.model_fields if name in result},
        "started_at": _when(result["started_at"]),
        "ended_at": _when(result.get("ended_at")),
    }


def with_output(result: dict[str, Any], encoding: Encoding) -> dict[str, Any]:
    """The API's ``ProcessOut``: its summary and each stream's output, spelled as asked."""
    streams = {}
    for name in ("stdout", "stderr"):
        view = dict(result[name])
        view["data"] = decode_output(base64.b64decode(view.pop("data_b64")), encoding)
        streams[name] = view
    return {**summary(result), **streams, "encoding": encoding}


@router.post("/sandboxes/{sandbox_id}/processes", response={201: ProcessOut, **ERRORS}, summary="Start a command without waiting")
async def start_process(request: HttpRequest, sandbox_id: str, payload: ProcessIn) -> tuple[int, dict[str, Any]]:
    """Start a command in the background; the answer comes once it has started (or could not: an exited
    process with pid 0, exit code 127 or 126, the reason on its stderr; nothing is kept of it).

    Its output is kept in a buffer of 256 KiB per stream (the tail: what falls off the front is counted,
    never held). With `pty`, it runs on a terminal of that size: one stream (stdout), input and `resize`
    through the endpoints below or the websocket `.../processes/{pid}/pty`. At most 32 per sandbox
    (`too_many_processes`, 429; an exited one nobody waited for makes room). It ends on its own, when
    signalled, after `timeout_s`, or with its sandbox; its exit is kept until a `wait` sees it (then it
    is reaped) or for 10 minutes."""
    args = payload.model_dump(exclude={"output"}, exclude_none=True)
    result = await _engine_call(request, sandbox_id, "processes.start", **args)
    return 201, with_output(result, payload.output)


@router.get("/sandboxes/{sandbox_id}/processes", response={200: ProcessList, **ERRORS}, summary="List background processes")
async def list_processes(request: HttpRequest, sandbox_id: str) -> dict[str, Any]:
    """Running ones, and exited ones not yet reaped; oldest first. One page: at most 32."""
    result = await _engine_call(request, sandbox_id, "processes.list")
    return {"processes": [summary(item) for item in result["processes"]], "next_cursor": None}


@router.get("/sandboxes/{sandbox_id}/processes/{pid}", response={200: ProcessOut, **ERRORS}, summary="A process and its output")
async def get_process(
    request: HttpRequest,
    sandbox_id: str,
    pid: int,
    stdout_offset: int = Query(0, ge=0),
    stderr_offset: int = Query(0, ge=0),
    output: Encoding = "text",
) -> dict[str, Any]:
    """Its state and its output from the offsets (each stream's `next_offset` is where to ask next).
    Reading keeps the output (until the process is reaped); `missed_bytes` counts what fell off the
    buffer before it was read."""
    result = await _engine_call(
        request, sandbox_id, "processes.get", pid=pid, stdout_offset=stdout_offset, stderr_offset=stderr_offset
    )
    return with_output(result, output)


@router.post(
    "/sandboxes/{sandbox_id}/processes/{pid}/signal", response={200: ProcessSummary, **ERRORS}, summary="Signal a process"
)
async def signal_process(request: HttpRequest, sandbox_id: str, pid: int, payload: SignalIn) -> dict[str, Any]:
    """Send it a signal (`TERM` unless named); `group` for its whole process group. One that is no
    longer running is `process_not_running` (409)."""
    result = await _engine_call(request, sandbox_id, "processes.signal", pid=pid, signal=payload.signal, group=payload.group)
    return summary(result)


@router.post(
    "/sandboxes/{sandbox_id}/processes/{pid}/wait", response={200: ProcessOut, **ERRORS}, summary="Wait for a process to exit"
)
async def wait_process(request: HttpRequest, sandbox_id: str, pid: int, payload: WaitIn) -> dict[str, Any]:
    """Wait up to `timeout_s` for it to exit; answered with its state either way, and its output from
    the offsets. An exit seen here reaps it: its record and output are gone afterwards
    (`process_not_found`)."""
    args = payload.model_dump(exclude={"output"})
    result = await _engine_call(request, sandbox_id, "processes.wait", pid=pid, **args)
    return with_output(result, payload.output)


@router.post(
    "/sandboxes/{sandbox_id}/processes/{pid}/input", response={200: InputWritten, **ERRORS}, summary="Write to a process's input"
)
async def process_input(request: HttpRequest, sandbox_id: str, pid: int, payload: InputIn) -> dict[str, Any]:
    """Write `data` (text) or `data_b64` (bytes) to its stdin or terminal; `eof` then closes its stdin
    (a terminal gets ^D). A process that reads none of it for 10 s: `input_not_read` (409)."""
    data = base64.b64decode(payload.data_b64, validate=True) if payload.data_b64 else (payload.data or "").encode()
    result = await _engine_call(
        request, sandbox_id, "processes.input", pid=pid, data_b64=base64.b64encode(data).decode(), eof=payload.eof
    )
    return {**summary(result), "written": result["written"]}


@router.post(
    "/sandboxes/{sandbox_id}/processes/{pid}/resize", response={200: ProcessSummary, **ERRORS}, summary="Resize a terminal"
)
async def resize_process(request: HttpRequest, sandbox_id: str, pid: int, payload: ResizeIn) -> dict[str, Any]:
    """A process started with `pty`: its terminal's new size (it gets SIGWINCH)."""
    result = await _engine_call(request, sandbox_id, "processes.resize", pid=pid, rows=payload.rows, cols=payload.cols)
    return summary(result)
