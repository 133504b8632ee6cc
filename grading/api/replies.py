"""The gateway's answers, whatever carries them: a status, headers, and a JSON body or a stream of events.

Both transports use these (the fast path, ``fast.py``, and the django-ninja
views, ``inference.py``), so they answer alike; each sends the reply its own
way and then records it (``record``), after the caller has its answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from console.api_base import status_of
from console.db import db
from console.errors import Failed, Refused, Unavailable
from console.middleware import dependency_error

from .. import gateway, services
from ..gateway import Caller, Outcome

log = logging.getLogger("forkyard.inference")
# Refusals of our own limits are not recorded: a client over its rate would otherwise write a row a request.
UNRECORDED = {"inference_rate_limited", "token_rate_limited"}


@dataclass
class Reply:
    status: int
    body: dict[str, Any] | None = None
    events: AsyncIterator[bytes] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    outcome: Outcome | None = None


def refused(error: Refused, outcome: Outcome | None = None) -> Reply:
    status = getattr(error, "status", None) or status_of(error)
    headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s is not None else {}
    if outcome is not None:
        outcome.finish(status, error.code)
        if error.code in UNRECORDED:
            outcome = None
    return Reply(status, gateway.openai_error(error, status), headers=headers, outcome=outcome)


def failure(error: Exception) -> Reply:
    """An error nobody refused (a bug, a database down): a clear 5xx, logged by kind only (never the content)."""
    if dependency_error(error):
        return refused(Unavailable("dependency_unavailable", "a dependency (database or broker) is unavailable; try again shortly"))
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    where = f"{frame.tb_frame.f_code.co_filename}:{frame.tb_lineno}" if frame is not None else "?"
    log.error("inference call failed: %s at %s", type(error).__name__, where)
    return refused(Failed("internal_error", "an unexpected error occurred; it has been logged"))


async def models(caller: Caller) -> Reply:
    config = await gateway.config_for(caller.team_id)
    return Reply(200, gateway.model_list(config, caller.key_id))


async def chat(caller: Caller, body: bytes) -> Reply:
    """The reply to a chat completion: its refusal, its answer, or its stream (whose first chunk has come)."""
    try:
        request = gateway.parse(body)
    except Refused as error:
        return refused(error)
    call = gateway.Call(caller, request)
    try:
        await call.prepare()
        if not request.stream:
            answer = await call.answer()
            call.outcome.finish(200)
            return Reply(200, answer, outcome=call.outcome)
        chunks = call.events()
        first = await chunks.__anext__()
    except Refused as error:
        return refused(error, call.outcome)
    except StopAsyncIteration:
        first = None
        chunks = _nothing()
    return Reply(200, events=_events(first, chunks, call.outcome), headers={"Cache-Control": "no-cache"}, outcome=call.outcome)


async def _nothing() -> AsyncIterator[dict[str, Any]]:
    return
    yield {}  # pragma: no cover - makes this an async generator


async def _events(first: dict[str, Any] | None, chunks: AsyncIterator[dict[str, Any]], outcome: Outcome) -> AsyncIterator[bytes]:
    """The stream's events, then ``[DONE]``; a failure mid-way is an error event and no ``[DONE]``."""
    try:
        if first is not None:
            yield gateway.encode_event(first)
        async for chunk in chunks:
            yield gateway.encode_event(chunk)
    except Refused as error:
        status = getattr(error, "status", None) or status_of(error)
        outcome.finish(status, error.code)
        yield gateway.error_event(error, status)
        return
    outcome.finish(200)
    yield gateway.DONE


FLUSH_S = 0.2
_pending: list[Outcome] = []
_flusher: asyncio.Task[None] | None = None


async def record(reply: Reply) -> None:
    """Record the call's metadata after it was answered: calls answered within ``FLUSH_S`` of each other are
    written together, in one transaction, off the path of the next request (a write per call cost every
    call a thread hop and a transaction). A web server killed meanwhile loses that moment's records."""
    global _flusher
    if reply.outcome is None:
        return
    if not reply.outcome.latency_ms:
        reply.outcome.finish(499, "client_gone")  # the caller left before its answer ended
    _pending.append(reply.outcome)
    if _flusher is None or _flusher.done():
        _flusher = asyncio.ensure_future(_flush_soon())


async def _flush_soon() -> None:
    await asyncio.sleep(FLUSH_S)
    while _pending:
        batch = _pending[:500]
        del _pending[:500]
        try:
            await db(services.inference_calls_record)(outcomes=batch)
        except Exception as error:  # noqa: BLE001 - metering must not break answers already given
            log.error("could not record %d inference calls: %s", len(batch), type(error).__name__)


async def flush() -> None:
    """Write what is pending now (tests and a server's shutdown)."""
    if _flusher is not None and not _flusher.done():
        await _flusher
