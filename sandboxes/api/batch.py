"""``POST /exec``: one command in many sandboxes, each answered as it finishes (newline-delimited JSON).

The sandboxes are named by ids, a launch or a label (``selectors.batch_targets``:
the team's only, at most ``batch_limit``, refused whole before anything runs).
Each runs on its host's engine exactly as ``POST /sandboxes/{id}/exec`` runs
it, at most ``PER_HOST`` at a time on one host, so a batch of thousands never
takes every connection to an engine.  A line is written as each finishes:

* ``{"type": "result", "sandbox_id", "exit_code", "stdout", "stderr", ...}``
  (the fields of a single exec's answer), or
* ``{"type": "error", "sandbox_id", "status", "error": {"code", "message"}}``
  for a sandbox that could not run it (not found, as another team's is; not
  running; its host not answering);

then one ``{"type": "summary", ...}``.  Results wait for a slow reader (a
bounded queue), so the web server holds a few of them at most.  A caller
that hangs up ends the commands still running, as a single exec's does.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from django.http import HttpRequest, StreamingHttpResponse
from ninja import Router

from console.api_base import ERRORS, key_of, status_of
from console.db import db
from console.errors import Failed, Refused, not_found
from sandboxes.engine.errors import EngineError

from .. import engine_link, selectors
from ..engine.data_path import ExecIn, exec_answer, exec_args
from ..models import Sandbox
from ..schemas import BatchExecIn

log = logging.getLogger("forkyard.api")
router = Router(tags=["sandboxes"])
PER_HOST = 16  # commands of one batch in flight on one host at once
WAITING = 64  # finished results held for a slow reader before the commands wait


def _line(message: dict[str, Any]) -> bytes:
    return (json.dumps(message) + "\n").encode()


def _error(sandbox_id: str, refusal: Refused) -> dict[str, Any]:
    return {"type": "error", "sandbox_id": sandbox_id, "status": status_of(refusal), "error": refusal.body()["error"]}


def _engine_key(batch_key: str, sandbox_id: str) -> str:
    """Each sandbox's idempotency key for the engine, from the batch's (of any length: the engine takes 255)."""
    return f"batch-{hashlib.sha256(batch_key.encode()).hexdigest()[:32]}-{sandbox_id}"


class Batch:
    """The commands of one batch: run per host, ``PER_HOST`` at a time, their lines queued as they finish."""

    def __init__(self, payload: BatchExecIn, targets: list[tuple[str, Sandbox | None]]) -> None:
        self.payload, self.targets = payload, targets
        self.args = exec_args(ExecIn.model_validate(payload.model_dump(include=set(ExecIn.model_fields))))
        self.lines: asyncio.Queue[dict[str, Any]] = asyncio.Queue(WAITING)
        self.gates: dict[str, asyncio.Semaphore] = {}
        self.counts = {"sandboxes": len(targets), "succeeded": 0, "failed": 0, "errors": 0}

    async def run(self, sandbox_id: str, sandbox: Sandbox | None) -> None:
        """Exactly one line for this sandbox, whatever happens to its command."""
        if sandbox is None:
            await self.lines.put(_error(sandbox_id, not_found("sandbox", sandbox_id)))
            return
        try:
            selectors.require_started(sandbox, doing="run a command")
        except Refused as refusal:
            await self.lines.put(_error(sandbox_id, refusal))
            return
        assert sandbox.host is not None  # a started sandbox has a host
        address = sandbox.host.engine_socket
        args = dict(self.args)
        if self.payload.idempotency_key:
            args["key"] = _engine_key(self.payload.idempotency_key, sandbox_id)
        async with self.gates.setdefault(address, asyncio.Semaphore(PER_HOST)):
            try:
                async with engine_link.async_pool(address).client() as client:
                    result = await client.call("exec", id=sandbox.engine_id, **args)
                line = {"type": "result", "sandbox_id": sandbox_id, **exec_answer(result, self.payload)}
            except EngineError as error:
                line = _error(sandbox_id, engine_link.refusal(error))
            except Exception:  # noqa: BLE001 - one sandbox's failure is its own line, never the batch's end
                log.exception("batch exec in %s", sandbox_id)
                line = _error(sandbox_id, Failed("internal_error", "an unexpected error occurred; it has been logged"))
            await self.lines.put(line)  # inside the gate: a slow reader slows the commands, not memory

    def count(self, line: dict[str, Any]) -> None:
        if line["type"] == "error":
            self.counts["errors"] += 1
        elif line["exit_code"] == 0 and not line["timed_out"]:
            self.counts["succeeded"] += 1
        else:
            self.counts["failed"] += 1

    async def stream(self) -> AsyncIterator[bytes]:
        started = time.monotonic()
        tasks = [asyncio.ensure_future(self.run(sandbox_id, sandbox)) for sandbox_id, sandbox in self.targets]
        try:
            for _ in tasks:
                line = await self.lines.get()
                self.count(line)
                yield _line(line)
            summary = {"type": "summary", **self.counts, "duration_ms": round((time.monotonic() - started) * 1000, 3)}
            yield _line(summary)
        finally:
            for task in tasks:
                task.cancel()  # the caller left: its commands end with it (an engine's exec ends with its caller)
            await asyncio.gather(*tasks, return_exceptions=True)


@router.post("/exec", response={200: None, **ERRORS}, summary="Run a command in many sandboxes")
async def exec_batch(request: HttpRequest, payload: BatchExecIn) -> StreamingHttpResponse:
    """Run one command in many sandboxes, named by exactly one of `sandbox_ids`, `launch` (its live
    sandboxes) or `label` (`key:value`: the team's live sandboxes with it); the other fields are a
    single exec's (`POST /sandboxes/{id}/exec`). At most 10,000 sandboxes (or the team's largest
    launch, if larger): more is refused whole (400 `batch_too_large`), before anything runs.

    The answer is newline-delimited JSON, a line per sandbox as each finishes:
    `{"type": "result", "sandbox_id", "exit_code", "stdout", "stderr", ...}` or, for one that
    could not run it, `{"type": "error", "sandbox_id", "status", "error": {"code", "message"}}`
    (a sandbox of another team is `sandbox_not_found`, and nothing runs in it); then
    `{"type": "summary", "sandboxes", "succeeded", "failed", "errors", "duration_ms"}`.
    With an `idempotency_key`, the batch sent again runs nothing twice in any sandbox.
    A caller that hangs up ends the commands still running."""
    key = key_of(request)
    targets = await db(selectors.batch_targets)(
        key.team, sandbox_ids=payload.sandbox_ids, launch=payload.launch, label=payload.label, labels=key.label_limit
    )
    return StreamingHttpResponse(Batch(payload, targets).stream(), content_type="application/x-ndjson")
