"""The SDK's grading: ``fy.inference`` (the official OpenAI client, sync and async), ``fy.grades``,
``fy.endpoints`` and ``sb.grade``, against the real stack and a dedicated endpoint of the tiny model."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import openai
import pytest

from forkyard import AsyncClient, ForkyardError, Grade, Reward
from tests.support.grading import TINY, judge_schema

pytestmark = pytest.mark.root


async def judge_rubric(judge_client: Any, judge_model: str, answer: str) -> float:
    """What an RL library's judge does with the ``AsyncOpenAI`` client it is given (verifiers' JudgeRubric
    before 0.4, and its 0.4 judges with the client they build from an endpoint's config: a plain
    ``chat.completions.create``), here with a structured answer."""
    response = await judge_client.chat.completions.create(
        model=judge_model,
        messages=[{"role": "user", "content": f"Grade: {answer}"}],
        max_completion_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "grade", "strict": True, "schema": judge_schema()}},
    )
    return float(json.loads(response.choices[0].message.content)["score"])


def test_fy_inference_is_the_official_client_pointed_at_forkyard(fy, judge):
    assert isinstance(fy.inference, openai.OpenAI)
    assert str(fy.inference.base_url).rstrip("/").endswith("/api/v1/inference")
    answer = fy.inference.chat.completions.create(model=judge["name"], messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert answer.usage.completion_tokens > 0


def test_an_rl_librarys_judge_takes_the_async_client(stack, judge):
    async def run() -> list[float]:
        async with AsyncClient(stack.url, stack.teams[0].key) as fy:
            assert isinstance(fy.inference, openai.AsyncOpenAI)
            return await asyncio.gather(*(judge_rubric(fy.inference, judge["name"], f"answer {n}") for n in range(8)))

    scores = asyncio.run(run())
    assert len(scores) == 8 and all(score in (0.0, 1.0, 2.0, 3.0) for score in scores)


def test_grades_and_rewards_from_the_sdk(fy, judge, sb):
    grade = fy.grades.create(
        model=judge["name"],
        rubric=[{"role": "user", "content": "Grade {answer}"}],
        schema=judge_schema(),
        items=[{"id": "a", "values": {"answer": "one"}}, {"id": "b", "values": {"answer": {"sandbox": sb.id, "command": "echo two"}}}],
        max_tokens=64,
    )
    assert isinstance(grade, Grade) and grade.items == 2 and len(grade.scores) == 2
    for item in grade.results or []:
        assert item.ok and item.id in ("a", "b")
        jsonschema.validate(item.fields, judge_schema())
    assert fy.grades.get(grade.id).results is None, "content only under retention"
    sb.exec("mkdir -p /work && echo '{\"reward\": 0.5, \"note\": \"half\"}' > /work/r.json")
    reward = sb.grade("true", reward_file="/work/r.json", timeout_s=30)
    assert isinstance(reward, Reward) and (reward.reward, reward.source, reward.details) == (0.5, "file", {"note": "half"})
    assert sb.grade("exit 1").reward == 0.0
    with pytest.raises(ForkyardError) as timed_out:
        sb.grade("sleep 10", timeout_s=0.5)
    assert timed_out.value.code == "grade_timeout"


def test_endpoints_from_the_sdk(fy, judge):
    assert TINY in [model["name"] for model in fy.endpoints.models()]
    mine = fy.endpoints.get(judge["id"])
    assert mine.state == "ready" and fy.endpoints.wait_ready(mine).id == judge["id"]
    assert judge["id"] in [endpoint.id for endpoint in fy.endpoints.list().items]
