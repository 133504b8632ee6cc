"""Model-graded rewards: a rubric, a batch of rollouts, a judge's structured answer each, processed concurrently.

``POST /api/v1/grades``, in the order the code runs it:

1. The schema is checked (a JSON schema whose ``score_field`` is a required
   number), and every item gives a value for each ``{placeholder}`` of the
   rubric (``400`` naming the item otherwise); the model must be one the key
   may call (``404``/``403`` for the whole batch, before any work).
2. Items run ``concurrency`` at a time: each one's material is fetched by
   the server (text as given; a sandbox's file, or a command's output in a
   sandbox, through ``sandbox_calls``), the rubric filled in, and one call
   made through the gateway (``gateway.Call``: the same routing, limits,
   retention rules and structure checks as any call) with
   ``response_format`` ``json_schema`` strict.
3. Each item answers its fields and score, or its own error (a file not
   found, a limit, an answer that did not validate): an item that failed is
   never a score of zero.
4. The grade is recorded (``services.grade_record``): numbers always, the
   items' messages and answers only for a team that keeps content.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

from console.api_base import status_of
from console.db import db
from console.errors import InvalidRequest, Refused

from . import gateway, sandbox_calls, services, structured
from .gateway import Caller, Outcome
from .schemas import ChatCompletionRequest, CommandMaterial, FileMaterial, GradeCreate, GradeItem

PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]{0,63})\}")
NUMBER_TYPES = {"number", "integer"}


def placeholders(payload: GradeCreate) -> set[str]:
    return {match.group(1) for message in payload.rubric for match in PLACEHOLDER.finditer(message.content) if match.group(1)}


def fill(text: str, values: dict[str, str]) -> str:
    return PLACEHOLDER.sub(lambda match: values[match.group(1)] if match.group(1) else match.group(0)[0], text)


def check(payload: GradeCreate) -> None:
    """The schema names a required number ``score_field``; every item fills every placeholder."""
    structured.validator_for(payload.answer_schema, "schema")
    properties = payload.answer_schema.get("properties")
    field_schema = properties.get(payload.score_field) if isinstance(properties, dict) else None
    kinds = field_schema.get("type") if isinstance(field_schema, dict) else None
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    enum = field_schema.get("enum") if isinstance(field_schema, dict) else None
    numeric_enum = isinstance(enum, list) and enum and all(isinstance(v, int | float) and not isinstance(v, bool) for v in enum)
    if not (kinds and kinds <= NUMBER_TYPES) and not numeric_enum:
        raise InvalidRequest(
            "invalid_schema", f"schema: its property {payload.score_field!r} (score_field) must be a number or an integer", field="schema"
        )
    if payload.score_field not in (payload.answer_schema.get("required") or []):
        raise InvalidRequest("invalid_schema", f"schema: {payload.score_field!r} (score_field) must be required", field="schema")
    needed = placeholders(payload)
    for index, item in enumerate(payload.items):
        missing = sorted(needed - set(item.values))
        if missing:
            raise InvalidRequest(
                "invalid_request", f"items.{index}.values: no value for {{{missing[0]}}}", field=f"items.{index}.values"
            )


async def _material(team_id: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, FileMaterial):
        data, more = await sandbox_calls.read(team_id, value.sandbox, value.file, value.max_bytes)
        return data.decode("utf-8", "replace") + ("\n[...cut]" if more else "")
    assert isinstance(value, CommandMaterial)
    result = await sandbox_calls.run(team_id, value.sandbox, value.command, value.timeout_s)
    parts = {"stdout": [result["stdout"]], "stderr": [result["stderr"]], "both": [result["stdout"], result["stderr"]]}
    return b"".join(parts[value.output]).decode("utf-8", "replace")


class Batch:
    """One grade's items, graded concurrently through the gateway."""

    def __init__(self, caller: Caller, payload: GradeCreate) -> None:
        self.caller, self.payload = caller, payload
        self.outcomes: list[Outcome] = []
        self.retain_days = 0

    def _request(self, messages: list[dict[str, str]]) -> ChatCompletionRequest:
        body: dict[str, Any] = {
            "model": self.payload.model,
            "messages": messages,
            "response_format": {"type": "json_schema", "json_schema": {"name": "grade", "strict": True, "schema": self.payload.answer_schema}},
        }
        for name in ("max_tokens", "temperature", "seed"):
            if getattr(self.payload, name) is not None:
                body[name] = getattr(self.payload, name)
        return ChatCompletionRequest.model_validate_json(json.dumps(body))

    async def item(self, index: int, item: GradeItem) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(its answer for the caller, its content to keep if the team keeps content)."""
        started = time.monotonic()
        answer: dict[str, Any] = {"index": index, "id": item.id, "score": None, "fields": None, "error": None}
        outcome: Outcome | None = None
        messages: list[dict[str, str]] = []
        try:
            values = {name: await _material(self.caller.team_id, value) for name, value in item.values.items()}
            messages = [{"role": message.role, "content": fill(message.content, values)} for message in self.payload.rubric]
            call = gateway.Call(self.caller, self._request(messages))
            outcome = call.outcome
            await call.prepare()
            self.retain_days = call.outcome.retain_days
            completion = await call.answer()
            outcome.finish(200)
            fields = json.loads(completion["choices"][0]["message"]["content"])
            answer.update(fields=fields, score=float(fields[self.payload.score_field]))
        except Refused as error:
            answer["error"] = {"code": error.code, "message": error.message}
            if outcome is not None:
                outcome.finish(getattr(error, "status", None) or status_of(error), error.code)
        if outcome is not None:
            self.outcomes.append(outcome)
        usage = outcome or Outcome(team_id="", key_id="", model="", stream=False)
        answer["usage"] = {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}
        answer["latency_ms"] = round((time.monotonic() - started) * 1000, 3)
        return answer, {"messages": messages, "fields": answer["fields"], "score": answer["score"], "error": answer["error"]}

    async def run(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        slots = asyncio.Semaphore(self.payload.concurrency)

        async def one(index: int, item: GradeItem) -> tuple[dict[str, Any], dict[str, Any] | None]:
            async with slots:
                return await self.item(index, item)

        done = await asyncio.gather(*(one(index, item) for index, item in enumerate(self.payload.items)))
        return [answer for answer, _ in done], [content for _, content in done if content is not None]


async def grade(caller: Caller, payload: GradeCreate) -> dict[str, Any]:
    """Grade every item; the grade's numbers and each item's result."""
    check(payload)
    await gateway.routes_for(caller, payload.model)  # a model nobody serves for this key: refused for the whole batch
    started = time.monotonic()
    batch = Batch(caller, payload)
    results, content = await batch.run()
    latency = round((time.monotonic() - started) * 1000, 3)
    grade = await db(services.grade_record)(
        team_id=caller.team_id,
        key_id=caller.key_id,
        model=payload.model,
        score_field=payload.score_field,
        outcomes=batch.outcomes,
        scores=[result["score"] for result in results],
        latency_ms=latency,
        retain_days=batch.retain_days,
        content=content if batch.retain_days else None,
    )
    return {**grade_out(grade), "results": results}


def grade_out(grade: Any) -> dict[str, Any]:
    return {
        "id": grade.id,
        "model": grade.model,
        "score_field": grade.score_field,
        "items": grade.items,
        "succeeded": grade.succeeded,
        "failed": grade.failed,
        "mean_score": grade.mean_score,
        "usage": {"input_tokens": grade.input_tokens, "output_tokens": grade.output_tokens},
        "latency_ms": grade.latency_ms,
        "retained": grade.retained,
        "created_at": grade.created_at,
    }
