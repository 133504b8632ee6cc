"""A command or a file in one of the team's sandboxes, straight from the web server to its host's engine.

What a grade reads of a rollout (a file, a command's output) and what a
test-based reward runs go through here: the sandbox found in the caller's
team (another team's is ``not found``), then its engine called on a pooled
connection, as the API's own commands and files are (``sandboxes/api/data.py``).
Nothing of the output is kept.
"""

from __future__ import annotations

import base64
from typing import Any

from console.db import db
from sandboxes import engine_link, selectors
from sandboxes.engine.errors import EngineError
from sandboxes.models import Sandbox

OUTPUT_BYTES = 64 * 1024


async def started(team_id: str, sandbox_id: str) -> tuple[Sandbox, str]:
    sandbox = await db(selectors.started_sandbox_for)(team_id, sandbox_id)
    assert sandbox.host is not None  # a started sandbox has a host
    return sandbox, sandbox.host.engine_socket


async def run(team_id: str, sandbox_id: str, cmd: str | list[str], timeout_s: float, max_output_bytes: int = OUTPUT_BYTES) -> dict[str, Any]:
    """The command's result (``exit_code``, ``stdout``, ``stderr`` as bytes, ``timed_out``, ...); an engine's
    refusal raised as the API's (``engine_link.refusal``)."""
    sandbox, address = await started(team_id, sandbox_id)
    try:
        async with engine_link.async_pool(address).client() as client:
            result: dict[str, Any] = await client.call(
                "exec", id=sandbox.engine_id, cmd=cmd, timeout_s=timeout_s, max_output_bytes=max_output_bytes
            )
    except EngineError as error:
        raise engine_link.refusal(error, sandbox) from None
    result["stdout"] = base64.b64decode(result.pop("stdout_b64", ""))
    result["stderr"] = base64.b64decode(result.pop("stderr_b64", ""))
    return result


async def read(team_id: str, sandbox_id: str, path: str, max_bytes: int) -> tuple[bytes, bool]:
    """The file's first ``max_bytes`` bytes, and whether there were more."""
    sandbox, address = await started(team_id, sandbox_id)
    chunks: list[bytes] = []
    size = 0
    stream = engine_link.stream_call(address, "files.read", {"id": sandbox.engine_id, "path": path})
    try:
        async for kind, data in stream:
            if kind != "data":
                continue
            chunks.append(data)
            size += len(data)
            if size > max_bytes:
                return b"".join(chunks)[:max_bytes], True
    except EngineError as error:
        raise engine_link.refusal(error, sandbox) from None
    finally:
        await stream.aclose()
    return b"".join(chunks), False
