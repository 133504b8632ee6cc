"""Test-based rewards: a check run in the rollout's sandbox, its reward read from the file it writes or its exit code.

``POST /api/v1/sandboxes/{id}/grade`` ``{cmd, reward_file?, timeout_s}``:

1. the check runs in the sandbox (``sandbox_calls.run``), as a command would;
2. with ``reward_file``, the file it wrote is read (64 KiB at most) and must
   be a JSON object with a finite number ``reward``; its other fields are
   returned as they are (``details``);
3. without one, the exit code is the reward: 0 gives 1.0, anything else 0.0.

What is not the rollout's doing is an error, never a zero: a sandbox not
running (or gone mid-check) is ``409``, a check that outlived ``timeout_s``
``504 grade_timeout``, one killed for memory ``409 check_oom_killed``, an
engine that does not answer ``503``, and a reward file missing or not a
reward ``409 reward_file_missing`` / ``reward_file_invalid`` (the exit code in
``details``, for the caller to judge).
"""

from __future__ import annotations

import json
import math
from typing import Any

from console.errors import Conflict, InvalidRequest, NotFound, UpstreamTimeout

from . import sandbox_calls
from .schemas import SandboxGradeIn

REWARD_FILE_BYTES = 64 * 1024


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


async def _reward_file(team_id: str, sandbox_id: str, path: str, exit_code: int) -> tuple[float, dict[str, Any]]:
    details = {"exit_code": exit_code, "reward_file": path}
    try:
        data, more = await sandbox_calls.read(team_id, sandbox_id, path, REWARD_FILE_BYTES)
    except Conflict as error:  # not a file (a directory)
        raise Conflict("reward_file_invalid", f"{path!r}: {error.message}", field="reward_file", details=details) from None
    except NotFound as error:
        if error.code == "sandbox_not_found":
            raise  # gone since the check ran
        raise Conflict("reward_file_missing", f"the check did not write {path!r}", field="reward_file", details=details) from None
    except InvalidRequest as error:  # a path the sandbox's tree refuses
        raise Conflict("reward_file_invalid", f"{path!r}: {error.message}", field="reward_file", details=details) from None
    if more:
        raise Conflict("reward_file_invalid", f"{path!r} is over {REWARD_FILE_BYTES} bytes", field="reward_file", details=details)
    try:
        document = json.loads(data)
    except ValueError:
        raise Conflict("reward_file_invalid", f"{path!r} is not JSON", field="reward_file", details=details) from None
    reward = document.get("reward") if isinstance(document, dict) else None
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise Conflict(
            "reward_file_invalid", f'{path!r} is not {{"reward": <number>, ...}}', field="reward_file", details=details
        )
    return float(reward), {name: value for name, value in document.items() if name != "reward"}


async def sandbox_grade(team_id: str, sandbox_id: str, payload: SandboxGradeIn) -> dict[str, Any]:
    result = await sandbox_calls.run(team_id, sandbox_id, payload.cmd, payload.timeout_s)
    if result.get("timed_out"):
        raise UpstreamTimeout(
            "grade_timeout", f"the check did not finish within {payload.timeout_s:g} s: no reward", details={"timeout_s": payload.timeout_s}
        )
    if result.get("oom_killed"):
        raise Conflict("check_oom_killed", "the check was killed for the sandbox's memory limit: no reward")
    exit_code = int(result.get("exit_code", -1))
    if payload.reward_file is not None:
        reward, details = await _reward_file(team_id, sandbox_id, payload.reward_file, exit_code)
        source = "file"
    else:
        reward, details, source = (1.0 if exit_code == 0 else 0.0), {}, "exit_code"
    return {
        "reward": reward,
        "source": source,
        "exit_code": exit_code,
        "duration_ms": float(result.get("duration_ms") or 0.0),
        "details": details,
        "stdout": _text(result["stdout"]),
        "stderr": _text(result["stderr"]),
    }
