"""``/grades`` (model-graded rewards, many items a call) and ``/sandboxes/{id}/grade`` (test-based rewards)."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja import Router
from ninja.params.functions import Query

from console.api_base import BUDGETED, ERRORS, UPSTREAM_ERRORS, key_of
from console.authorize import authorize_sandboxes
from console.db import db

from .. import grader, rewards, selectors
from ..gateway import RETENTION_HEADER
from ..schemas import CommandMaterial, FileMaterial, GradeCreate, GradeDetail, GradeList, GradeResult, RewardOut, SandboxGradeIn
from .fast import caller_of

router = Router(tags=["grades"])


def _detail(team: Any, grade_id: str) -> dict[str, Any]:
    grade = selectors.grade_for(team, grade_id)
    content = selectors.retained_for_grade(grade) if grade.retained else None
    return {**grader.grade_out(grade), "results": content["items"] if content else None}


def _page(team: Any, cursor: str | None, limit: int) -> dict[str, Any]:
    page = selectors.grades_page(team, cursor=cursor, limit=limit)
    return {"grades": [grader.grade_out(grade) for grade in page.rows], "next_cursor": page.next_cursor}


def _sandboxes_named(payload: GradeCreate) -> tuple[set[str], set[str]]:
    """The sandboxes the items read files of, and those they run commands in."""
    values = [value for item in payload.items for value in item.values.values()]
    return (
        {value.sandbox for value in values if isinstance(value, FileMaterial)},
        {value.sandbox for value in values if isinstance(value, CommandMaterial)},
    )


@router.post("/grades", response={200: GradeResult, **BUDGETED, **UPSTREAM_ERRORS}, summary="Grade rollouts with a model")
async def create_grade(request: HttpRequest, payload: GradeCreate) -> dict[str, Any]:
    """A judge's structured answer for each item: the `rubric`'s messages with each `{placeholder}` filled
    from the item's `values` (text, a sandbox's `file`, or a `command`'s output in a sandbox, fetched by the
    server), answered under `schema` (JSON schema, strict) through the model, `concurrency` items at a time.
    Each result has the answer's fields and its `score_field` as `score`, or its own `error` (never a score
    of zero for a failure). Prompts and answers are kept only if the team keeps content (`GET` then shows
    them); `X-Forkyard-Retention: off` keeps nothing of this one. Items that read a sandbox's file or run
    a command in one need the key's sandboxes scope (`403 out_of_scope` otherwise, for the whole batch);
    an item that would take a budget past its limit fails with the budget's code."""
    key = key_of(request)
    read, run = _sandboxes_named(payload)
    refused = await authorize_sandboxes(key, read=read, run=run)
    if refused is not None:
        raise refused
    caller = caller_of(key.team_id, key.id, request.headers.get(RETENTION_HEADER, ""))
    return await grader.grade(caller, payload)


@router.get("/grades", response={200: GradeList, **ERRORS}, summary="List grades")
async def list_grades(request: HttpRequest, limit: int = Query(100, ge=1, le=1000), cursor: str | None = None) -> dict[str, Any]:
    """Newest first, metadata only; pass `next_cursor` as `cursor` for the next page."""
    return await db(_page)(key_of(request).team, cursor, limit)


@router.get("/grades/{grade_id}", response={200: GradeDetail, **ERRORS}, summary="Get a grade")
async def get_grade(request: HttpRequest, grade_id: str) -> dict[str, Any]:
    """Its numbers; its items' messages, answers and scores (`results`) only while the team keeps content."""
    return await db(_detail)(key_of(request).team, grade_id)


@router.post("/sandboxes/{sandbox_id}/grade", response={200: RewardOut, **UPSTREAM_ERRORS}, summary="A test-based reward")
async def grade_sandbox(request: HttpRequest, sandbox_id: str, payload: SandboxGradeIn) -> dict[str, Any]:
    """Runs the check `cmd` in the sandbox. With `reward_file`, the reward is the `reward` of the JSON object
    the check wrote there (its other fields come back in `details`); without, its exit code: 0 is 1.0,
    anything else 0.0. A failure of the infrastructure is an error, never a zero: a sandbox not running
    `409`, a check over `timeout_s` `504 grade_timeout`, a missing or malformed reward file `409`."""
    return await rewards.sandbox_grade(key_of(request).team_id, sandbox_id, payload)
