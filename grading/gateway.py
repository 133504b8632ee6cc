"""The inference gateway: a team's chat completion, routed, limited, passed through, checked, metered.

One function does a call (``chat``), whoever asked: the API's fast path
(``grading/api/fast.py``), its django-ninja view, or a grade's items. In
the order the code runs it:

1. The request was parsed by ``parse`` (the strict schema: an unknown field
   or a value of the wrong type is ``400``, OpenAI-shaped).
2. The team's configuration (``selectors.gateway_config``: its settings,
   its ready dedicated endpoints, the operator's upstreams) is read once
   and kept ``CONFIG_TTL_S`` in the process; a model it does not know is
   looked up again once before ``404 model_not_found``.
3. Zero retention: a team or key that requires it keeps only the routes
   that keep nothing (dedicated endpoints, upstreams marked so); none left
   is ``403 zero_retention_unavailable``: it fails closed.
4. Budgets (``spend.admit``): a call that could take a budget of its team
   or key past its limit, or comes when one is spent, is ``402`` with the
   budget's code, before anything is sent.
5. The team's limits (``limits.admit``): ``429`` with ``Retry-After``.
6. The call (``upstream``): on the first route, the next one only if the
   first could not be reached; the answer's ``model`` is the name the team
   used (an upstream's own name is the operator's business).
7. Structure: with ``response_format`` ``json_schema`` (or ``json_object``,
   or tools marked ``strict``), every choice is validated
   (``structured``); one that does not validate is asked for again, then
   ``502 invalid_structured_output``. A stream under a schema is read whole
   and validated before its first event is sent, so a client never sees a
   stream that ends in an invalid answer.
8. Metering: tokens counted against the team's per-minute limit, and the
   call's metadata (``Outcome``) recorded after the answer is sent
   (``services.inference_calls_record``): team, key, model, tokens,
   latency, status; its tokens go on billing's meter (``MeteredUsage``),
   which statements, budgets and the usage API read. The prompt and the output go nowhere, unless the team
   keeps content (``Team.retain_content_days``) and the request did not
   opt out (``X-Forkyard-Retention: off``): then they are stored sealed.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from console.db import db
from console.errors import Forbidden, InvalidRequest, Refused, UpstreamFailed, not_found

from . import limits, spend, structured, upstream
from .schemas import ChatCompletionRequest
from .selectors import GatewayConfig, Route, gateway_config

CONFIG_TTL_S = 2.0
_configs: dict[str, tuple[float, GatewayConfig]] = {}
RETENTION_HEADER = "x-forkyard-retention"
OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "insufficient_quota",  # a budget of the team's or the key's
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


@dataclass
class Caller:
    """Who calls, and whether its content may be kept."""

    team_id: str
    key_id: str
    opted_out: bool = False  # X-Forkyard-Retention: off


@dataclass
class Outcome:
    """A call's metadata (what is always recorded), and its content when it is to be kept."""

    team_id: str
    key_id: str
    model: str
    stream: bool
    started: float = field(default_factory=time.monotonic)
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    status: int = 200
    error_code: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    latency_ms: float = 0.0
    upstream_id: str | None = None
    endpoint_id: str | None = None
    retain_days: int = 0
    content: dict[str, Any] | None = None

    def finish(self, status: int = 200, error_code: str = "") -> Outcome:
        self.status, self.error_code = status, error_code
        self.latency_ms = round((time.monotonic() - self.started) * 1000, 3)
        return self


def forget_configs(*_: object, **__: object) -> None:
    """Read every team's configuration afresh (an upstream, endpoint or setting changed in this process)."""
    _configs.clear()


async def config_for(team_id: str, fresh: bool = False) -> GatewayConfig:
    now = time.monotonic()
    cached = _configs.get(team_id)
    if cached is not None and cached[0] > now and not fresh:
        return cached[1]
    config = await db(gateway_config)(team_id)
    if len(_configs) > 10_000:
        _configs.clear()
    _configs[team_id] = (now + CONFIG_TTL_S, config)
    return config


def parse(body: bytes) -> ChatCompletionRequest:
    """The request, or ``400`` naming the first field that is wrong."""
    try:
        return ChatCompletionRequest.model_validate_json(body or b"{}")
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()) if not _structural(part))
        message = first.get("msg", "invalid request")
        code = "invalid_request"  # as the API's views answer a body that does not validate
        if first.get("type") == "json_invalid":
            code, where = "invalid_json", ""
        every = [
            {"field": ".".join(str(part) for part in item.get("loc", ())), "message": item.get("msg")} for item in error.errors()[:20]
        ]
        raise InvalidRequest(
            code, f"{where}: {message}" if where else message, field=where or None, details={"errors": every}
        ) from None


def _structural(part: object) -> bool:
    text = str(part)
    return text in {"str", "int", "float", "bool", "list", "dict", "none"} or "[" in text or text.startswith("function-")


def openai_error(error: Refused, status: int) -> dict[str, Any]:
    """Our error body with OpenAI's fields beside ours (``type``, ``param``): the official client reads both."""
    body = error.body()
    body["error"]["type"] = OPENAI_TYPES.get(status, "api_error")
    body["error"]["param"] = error.field
    return body


async def routes_for(caller: Caller, model: str) -> tuple[GatewayConfig, tuple[Route, ...]]:
    config = await config_for(caller.team_id)
    routes = config.routes.get(model)
    if not routes:
        config = await config_for(caller.team_id, fresh=True)  # an endpoint that just became ready
        routes = config.routes.get(model)
    if not routes:
        raise not_found("model", model, field="model")
    if config.requires_zero_retention(caller.key_id):
        routes = tuple(route for route in routes if not route.keeps_prompts)
        if not routes:
            raise Forbidden(
                "zero_retention_unavailable",
                f"{model!r} is served only by providers that keep prompts, and this team or key requires zero retention",
                field="model",
            )
    return config, routes


def model_list(config: GatewayConfig, key_id: str) -> dict[str, Any]:
    """The models this key may call, in OpenAI's list shape."""
    zero = config.requires_zero_retention(key_id)
    names = sorted(
        name for name, routes in config.routes.items() if not zero or any(not route.keeps_prompts for route in routes)
    )
    owners = {name: "forkyard" if config.routes[name][0].dedicated else "upstream" for name in names}
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": owners[name]} for name in names]}


@dataclass
class Checks:
    """What every answer of this request must keep: its schema, its kind of format, its strict tools."""

    kind: str | None = None
    schema: Any = None
    tools: dict[str, Any] = field(default_factory=dict)

    @property
    def any(self) -> bool:
        return self.kind in ("json_schema", "json_object") or bool(self.tools)

    def problem(self, answer: dict[str, Any]) -> str | None:
        for choice in answer.get("choices") or []:
            found = structured.choice_problem(choice, self.schema, self.kind, self.tools)
            if found:
                return found
        return None


def checks_of(request: ChatCompletionRequest) -> Checks:
    checks = Checks()
    if request.response_format is not None:
        checks.kind = request.response_format.type
        if request.response_format.json_schema is not None:
            schema = request.response_format.json_schema.json_schema
            checks.schema = structured.validator_for(schema, "response_format.json_schema.schema")
    for tool in request.tools or []:
        if tool.function.strict and tool.function.parameters is not None:
            checks.tools[tool.function.name] = structured.validator_for(tool.function.parameters, "tools.function.parameters")
    return checks


def _usage_of(answer: dict[str, Any]) -> tuple[int, int]:
    usage = answer.get("usage") or {}
    try:
        return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    except (TypeError, ValueError):
        return 0, 0


async def _first_reachable(routes: tuple[Route, ...], call: Any) -> tuple[Route, Any]:
    """``call(route)`` on the first route that can be reached (an unreachable one is skipped, nothing was sent)."""
    last: Refused | None = None
    for route in routes:
        try:
            return route, await call(route)
        except UpstreamFailed as error:
            if error.code != "upstream_unreachable":
                raise
            last = error
            if route.dedicated:
                forget_configs()  # an endpoint gone since its route was read
    assert last is not None
    raise last


class Call:
    """One chat completion in progress: ``answer()`` for a JSON answer, ``events()`` for a stream."""

    def __init__(self, caller: Caller, request: ChatCompletionRequest) -> None:
        self.caller = caller
        self.request = request
        self.outcome = Outcome(team_id=caller.team_id, key_id=caller.key_id, model=request.model, stream=bool(request.stream))
        self.body = request.model_dump(exclude_none=True, by_alias=True)
        self.checks = Checks()
        self.routes: tuple[Route, ...] = ()
        self.config: GatewayConfig | None = None

    async def prepare(self) -> None:
        """Everything before the upstream: route, zero retention, checks, budgets, limits (raises a refusal)."""
        if self.request.store:
            raise InvalidRequest("invalid_request", "store: content is kept only under the team's retention setting", field="store")
        self.config, self.routes = await routes_for(self.caller, self.request.model)
        self.checks = checks_of(self.request)
        if self.config.budgets:
            tries = 1 + (structured.RETRIES if self.checks.any else 0)  # an answer off its schema is asked for again
            cost = spend.most_it_could_cost(self.config, self.routes, self.request, len(json.dumps(self.body))) * tries
            spend.admit(self.config, self.caller.key_id, cost)
        await limits.admit(self.caller.team_id, self.config.requests_per_minute, self.config.tokens_per_minute)
        zero = self.config.requires_zero_retention(self.caller.key_id)
        if self.config.retain_days and not self.caller.opted_out and not zero:
            self.outcome.retain_days = self.config.retain_days

    def _chose(self, route: Route) -> None:
        self.outcome.upstream_id, self.outcome.endpoint_id = route.upstream_id, route.endpoint_id

    def _spent(self, answer_tokens: tuple[int, int]) -> None:
        self.outcome.input_tokens += answer_tokens[0]
        self.outcome.output_tokens += answer_tokens[1]
        limits.spent_soon(self.caller.team_id, sum(answer_tokens))  # the answer does not wait for the count

    def _keep(self, response: Any) -> None:
        if self.outcome.retain_days:
            self.outcome.content = {"request": self.body, "response": response}

    async def answer(self) -> dict[str, Any]:
        """The completion as JSON, its structure checked; a refusal otherwise."""
        tries = 1 + (structured.RETRIES if self.checks.any else 0)
        problem = None
        for _ in range(tries):
            route, answer = await _first_reachable(self.routes, lambda route: upstream.complete(route, self.body))
            self._chose(route)
            self._spent(_usage_of(answer))
            problem = self.checks.problem(answer) if self.checks.any else None
            if problem is None:
                answer["model"] = self.request.model
                self._keep(answer)
                return dict(answer)
        raise _invalid_output(problem, tries)

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The stream's chunks (the usage chunk only if asked), its structure checked first when it has one.

        The first chunk is fetched before this returns its iterator's first
        item, so that a refusal (no route, an upstream down) comes before any
        byte of the answer."""
        wanted_usage = bool(self.request.stream_options and self.request.stream_options.include_usage)
        body = {**self.body, "stream": True, "stream_options": {"include_usage": True}}
        if self.checks.any:
            for chunk in await self._checked_stream(body):
                if wanted_usage or chunk.get("choices") or not chunk.get("usage"):
                    yield chunk
            return
        route, chunks = await _first_reachable(self.routes, lambda route: _started(upstream.stream(route, body)))
        self._chose(route)
        text: list[str] = []
        async for chunk in chunks:
            chunk["model"] = self.request.model
            if chunk.get("usage"):
                self._spent(_usage_of(chunk))
            if self.outcome.retain_days:
                text.extend(_delta_text(chunk))
            if chunk.get("usage") and not chunk.get("choices") and not wanted_usage:
                continue
            if chunk.get("usage") and not wanted_usage:
                chunk = {name: value for name, value in chunk.items() if name != "usage"}
            yield chunk
        self._keep({"content": "".join(text)})

    async def _checked_stream(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        tries = 1 + structured.RETRIES
        problem = None
        for _ in range(tries):
            route, collected = await _first_reachable(self.routes, lambda route: _collected(upstream.stream(route, body)))
            chunks: list[dict[str, Any]] = collected
            self._chose(route)
            for chunk in chunks:
                chunk["model"] = self.request.model
                if chunk.get("usage"):
                    self._spent(_usage_of(chunk))
            problem = self.checks.problem(_assembled(chunks))
            if problem is None:
                self._keep(_assembled(chunks))
                return chunks
        raise _invalid_output(problem, tries)


def _invalid_output(problem: str | None, tries: int) -> UpstreamFailed:
    return UpstreamFailed(
        "invalid_structured_output",
        f"the model's answer did not validate against the request's schema ({tries} tries): {problem}",
        details={"tries": tries},
    )


async def _started(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """The stream with its first chunk already fetched (a refusal is raised here, before any answer)."""
    first = await chunks.__anext__()

    async def rest() -> AsyncIterator[dict[str, Any]]:
        yield first
        async for chunk in chunks:
            yield chunk

    return rest()


async def _collected(chunks: AsyncIterator[dict[str, Any]]) -> list[dict[str, Any]]:
    return [chunk async for chunk in chunks]


def _delta_text(chunk: dict[str, Any]) -> list[str]:
    return [str((choice.get("delta") or {}).get("content") or "") for choice in chunk.get("choices") or []]


def _assembled(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream's chunks as the completion they spell (each choice's content and tool calls put together)."""
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            index = int(choice.get("index") or 0)
            message = choices.setdefault(index, {"index": index, "message": {"role": "assistant", "content": None}})["message"]
            delta = choice.get("delta") or {}
            if delta.get("content") is not None:
                message["content"] = (message["content"] or "") + str(delta["content"])
            for call in delta.get("tool_calls") or []:
                calls = message.setdefault("tool_calls", [])
                position = int(call.get("index") or 0)
                while len(calls) <= position:
                    calls.append({"type": "function", "function": {"name": "", "arguments": ""}})
                function = call.get("function") or {}
                calls[position]["function"]["name"] += str(function.get("name") or "")
                calls[position]["function"]["arguments"] += str(function.get("arguments") or "")
    return {"choices": [choices[index] for index in sorted(choices)]}


def encode_event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def error_event(error: Refused, status: int) -> bytes:
    """A failure after a stream began: an ``error`` event (the official client raises it), then the end."""
    return encode_event(openai_error(error, status))
