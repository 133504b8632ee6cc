"""Grading from the SDK: ``fy.inference`` (the official OpenAI client, pointed at forkyard), ``fy.grades``,
``fy.endpoints``, and the values they answer with (``sb.grade`` is on the sandboxes).

``fy.inference`` needs the ``openai`` package (``pip install 'forkyard[openai]'``): a ready ``openai.OpenAI``
for ``Client``, ``openai.AsyncOpenAI`` for ``AsyncClient``, with ``base_url`` ``<forkyard>/api/v1/inference``
and the forkyard key. A judge that takes an ``AsyncOpenAI`` client takes this one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ._http import API_PREFIX, AsyncSender, Call, Sender, Settings
from ._pages import Page
from ._resources import Endpoint as Method
from ._resources import Resource, S, _page
from .errors import ConfigurationError, ForkyardError, WaitTimeout
from .models import ApiValue, _each, parse_time

# --- values -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ItemError(ApiValue):
    code: str
    message: str


@dataclass(frozen=True)
class GradedItem(ApiValue):
    """One item of a grade: the judge's answer (``fields``) and its ``score``, or its ``error`` (never a 0)."""

    CONVERT = {"error": lambda value: ItemError.from_api(value) if value else None}

    index: int
    id: str | None = None
    score: float | None = None
    fields: dict[str, Any] | None = None
    usage: dict[str, int] = field(default_factory=dict)
    latency_ms: float = 0.0
    error: ItemError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.score is not None


@dataclass(frozen=True)
class Grade(ApiValue):
    """A grade: its numbers, and its items' results (``results``: from the create, or under retention)."""

    CONVERT = {"results": lambda rows: [GradedItem.from_api(row) if "index" in row and "usage" in row else row for row in rows] if rows else None}

    id: str
    model: str
    score_field: str
    items: int
    succeeded: int
    failed: int
    mean_score: float | None = None
    usage: dict[str, int] = field(default_factory=dict)
    latency_ms: float = 0.0
    retained: bool = False
    created_at: datetime | None = None
    results: list[Any] | None = None

    @property
    def scores(self) -> list[float | None]:
        """Each item's score in order (None for an item that failed)."""
        return [item.score if isinstance(item, GradedItem) else item.get("score") for item in self.results or []]


@dataclass(frozen=True)
class Reward(ApiValue):
    """A test-based reward: from the check's reward file (``details`` its other fields) or its exit code."""

    reward: float
    source: str
    exit_code: int
    duration_ms: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)
    stdout: str = ""
    stderr: str = ""


@dataclass(frozen=True)
class DedicatedEndpoint(ApiValue):
    """A dedicated endpoint: call it through ``fy.inference`` with ``model=endpoint.name`` once ``ready``."""

    CONVERT = {"error": lambda value: ItemError.from_api(value) if value else None}

    id: str
    name: str
    model: str
    state: str
    server: str = ""
    host: str | None = None
    restarts: int = 0
    error: ItemError | None = None
    created_at: datetime | None = None
    started_at: datetime | None = None
    ready_at: datetime | None = None
    ended_at: datetime | None = None


# --- requests ----------------------------------------------------------------------------


def _material(value: Any) -> Any:
    return value


def create_grade(
    *,
    model: str,
    rubric: Sequence[Mapping[str, str]],
    items: Sequence[Mapping[str, Any]],
    schema: Mapping[str, Any],
    score_field: str = "score",
    max_tokens: int | None = None,
    temperature: float | None = None,
    seed: int | None = None,
    concurrency: int = 32,
    retain: bool = True,
) -> Call:
    """Grade ``items`` with ``model``: the ``rubric``'s messages with each ``{placeholder}`` filled from an
    item's ``values`` (text; ``{"sandbox": id, "file": path}``; ``{"sandbox": id, "command": cmd}``), the
    judge answering under ``schema`` whose ``score_field`` is the score. ``retain=False`` keeps nothing of
    this call even if the team keeps content."""
    body: dict[str, Any] = {
        "model": model,
        "rubric": [dict(message) for message in rubric],
        "schema": dict(schema),
        "score_field": score_field,
        "items": [dict(item) for item in items],
        "concurrency": concurrency,
    }
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("seed", seed)):
        if value is not None:
            body[name] = value
    headers = {} if retain else {"X-Forkyard-Retention": "off"}
    return Call("POST", "/grades", json=body, read_timeout_s=3600, headers=headers)


def get_grade(grade_id: str) -> Call:
    """A grade's numbers; its items' content only while the team keeps content."""
    return Call("GET", f"/grades/{grade_id}")


def list_grades(*, limit: int = 100, cursor: str | None = None) -> Call:
    """The team's grades, newest first (metadata)."""
    return Call("GET", "/grades", params={"limit": limit, "cursor": cursor})


def create_endpoint(model: str, *, name: str | None = None) -> Call:
    """Deploy a dedicated endpoint of an open model (``list_models()`` names them); ``wait_ready`` for it."""
    return Call("POST", "/endpoints", json={"model": model, **({"name": name} if name else {})})


def get_endpoint(endpoint_id: str) -> Call:
    return Call("GET", f"/endpoints/{endpoint_id}")


def list_endpoints(*, limit: int = 100, cursor: str | None = None) -> Call:
    return Call("GET", "/endpoints", params={"limit": limit, "cursor": cursor})


def delete_endpoint(endpoint_id: str) -> Call:
    """Stop it: its billing ends, its model leaves ``/models``."""
    return Call("DELETE", f"/endpoints/{endpoint_id}")


def list_models() -> Call:
    """The open models an operator offers for dedicated endpoints."""
    return Call("GET", "/endpoint-models")


def grade_sandbox(sandbox_id: str, cmd: str | list[str], *, reward_file: str | None = None, timeout_s: float = 600) -> Call:
    body: dict[str, Any] = {"cmd": cmd, "timeout_s": timeout_s}
    if reward_file is not None:
        body["reward_file"] = reward_file
    return Call("POST", f"/sandboxes/{sandbox_id}/grade", json=body, read_timeout_s=timeout_s + 60)


# --- resources ---------------------------------------------------------------------------


class Grades(Resource[S]):
    """``fy.grades``: model-graded rewards, many items a call."""

    create = Method(create_grade, Grade.from_api)
    get = Method(get_grade, Grade.from_api)
    list = Method(list_grades, _page("grades", Grade.from_api))


READY, ENDED = "ready", ("failed", "deleted")


class Endpoints(Resource[S]):
    """``fy.endpoints``: dedicated open-model endpoints of the team's."""

    create = Method(create_endpoint, DedicatedEndpoint.from_api)
    get = Method(get_endpoint, DedicatedEndpoint.from_api)
    list = Method(list_endpoints, _page("endpoints", DedicatedEndpoint.from_api))
    delete = Method(delete_endpoint, DedicatedEndpoint.from_api)
    models = Method(list_models, lambda data: list(data["models"]))


def _ready_or_raise(endpoint: DedicatedEndpoint) -> bool:
    if endpoint.state == READY:
        return True
    if endpoint.state in ENDED:
        reason = endpoint.error.message if endpoint.error else endpoint.state
        raise ForkyardError("endpoint_failed", f"endpoint {endpoint.id} is {endpoint.state}: {reason}")
    return False


def wait_ready(sender: Sender, endpoint_id: str, timeout_s: float = 600.0, poll_s: float = 0.5) -> DedicatedEndpoint:
    deadline = time.monotonic() + timeout_s
    while True:
        endpoint = DedicatedEndpoint.from_api(sender.json(get_endpoint(endpoint_id)))
        if _ready_or_raise(endpoint):
            return endpoint
        if time.monotonic() > deadline:
            raise WaitTimeout("wait_timeout", f"endpoint {endpoint_id} is still {endpoint.state} after {timeout_s:g} s")
        time.sleep(poll_s)


async def wait_ready_async(sender: AsyncSender, endpoint_id: str, timeout_s: float = 600.0, poll_s: float = 0.5) -> DedicatedEndpoint:
    deadline = time.monotonic() + timeout_s
    while True:
        endpoint = DedicatedEndpoint.from_api(await sender.json(get_endpoint(endpoint_id)))
        if _ready_or_raise(endpoint):
            return endpoint
        if time.monotonic() > deadline:
            raise WaitTimeout("wait_timeout", f"endpoint {endpoint_id} is still {endpoint.state} after {timeout_s:g} s")
        await asyncio.sleep(poll_s)


def inference_client(settings: Settings, asynchronous: bool) -> Any:
    """The official OpenAI client (sync or async) pointed at this forkyard's gateway, with its key."""
    try:
        import openai  # noqa: PLC0415 - an optional extra: only a caller of fy.inference needs it
    except ImportError:
        raise ConfigurationError(
            "missing_dependency", "fy.inference needs the openai package: pip install 'forkyard[openai]'"
        ) from None
    kind = openai.AsyncOpenAI if asynchronous else openai.OpenAI
    return kind(base_url=f"{settings.url.rstrip('/')}{API_PREFIX}/inference", api_key=settings.api_key, timeout=settings.timeout_s)


__all__ = ["DedicatedEndpoint", "Grade", "GradedItem", "Grades", "Endpoints", "ItemError", "Page", "Reward", "parse_time", "_each"]
