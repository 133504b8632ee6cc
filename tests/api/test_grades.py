"""Grades: a batch of 100 judged by a dedicated endpoint, material read from sandboxes by the server, and
test-based rewards from a reward file and from an exit code, with infrastructure failures as errors."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import jsonschema
import pytest

from tests.support.grading import judge_schema

pytestmark = pytest.mark.root

RUBRIC = [
    {"role": "system", "content": "You grade answers. Reply with JSON."},
    {"role": "user", "content": "Question: {question}\nAnswer: {answer}\nScore it {{0-3}}."},
]


def test_a_batch_of_100_grades_each_with_its_fields_and_score(api, judge):
    items = [{"id": f"r{index}", "values": {"question": f"What is {index}+1?", "answer": str(index + 1)}} for index in range(100)]
    answer = api.post(
        "/api/v1/grades",
        # Room for the longest answer the grammar allows (llama.cpp's spaces are at most 20 a place): an item can
        # then fail only if something is wrong, and none may.
        json={"model": judge["name"], "rubric": RUBRIC, "schema": judge_schema(), "items": items, "max_tokens": 256, "concurrency": 16},
        timeout=600,
    )
    assert answer.status_code == 200, answer.text
    grade = answer.json()
    assert grade["items"] == 100 and len(grade["results"]) == 100
    assert [result["id"] for result in grade["results"]] == [f"r{index}" for index in range(100)]
    assert (grade["succeeded"], grade["failed"]) == (100, 0), [r["error"] for r in grade["results"] if r["error"]]
    for result in grade["results"]:
        jsonschema.validate(result["fields"], judge_schema())
        assert result["score"] == result["fields"]["score"] and result["usage"]["output_tokens"] > 0
    assert grade["usage"]["output_tokens"] == sum(result["usage"]["output_tokens"] for result in grade["results"])
    # Without retention, a grade is metadata: its numbers, never its items' content.
    fetched = api.get(f"/api/v1/grades/{grade['id']}").json()
    assert fetched["results"] is None and fetched["retained"] is False
    assert (fetched["items"], fetched["succeeded"], fetched["usage"]) == (100, grade["succeeded"], grade["usage"])
    listed = api.get("/api/v1/grades", params={"limit": 5}).json()["grades"]
    assert grade["id"] in [row["id"] for row in listed]


def test_material_is_read_from_the_teams_sandboxes_by_the_server(api, judge, running):
    api.put(f"/api/v1/sandboxes/{running}/files", params={"path": "/work/answer.txt"}, content=b"forty-two\n")
    answer = api.post(
        "/api/v1/grades",
        json={
            "model": judge["name"],
            "rubric": RUBRIC,
            "schema": judge_schema(),
            "max_tokens": 64,
            "items": [
                {"values": {"question": "file", "answer": {"sandbox": running, "file": "/work/answer.txt"}}},
                {"values": {"question": "command", "answer": {"sandbox": running, "command": "echo from-a-command"}}},
                {"values": {"question": "missing", "answer": {"sandbox": running, "file": "/work/nope"}}},
                {"values": {"question": "nobody's", "answer": {"sandbox": "sb_0000000000000000", "file": "/x"}}},
            ],
        },
    )
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    assert results[0]["error"] is None and results[1]["error"] is None
    # The prompts' input tokens count what was read in: the file's words and the command's output.
    assert all(result["usage"]["input_tokens"] > 20 for result in results[:2])
    assert results[2]["error"]["code"] == "file_not_found" and results[2]["score"] is None
    assert results[3]["error"]["code"] == "sandbox_not_found" and results[3]["score"] is None


def test_a_grade_is_refused_whole_when_it_cannot_work(api, judge):
    base = {"model": judge["name"], "rubric": RUBRIC, "schema": judge_schema(), "items": [{"values": {"question": "q", "answer": "a"}}]}
    no_score = api.post("/api/v1/grades", json={**base, "score_field": "nope"})
    assert no_score.status_code == 400 and no_score.json()["error"]["code"] == "invalid_schema"
    missing = api.post("/api/v1/grades", json={**base, "items": [{"values": {"question": "q"}}]})
    assert missing.status_code == 400 and missing.json()["error"]["field"] == "items.0.values", missing.text
    unknown = api.post("/api/v1/grades", json={**base, "model": "no-such-model"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_a_reward_from_the_check_s_file_or_its_exit_code(api, running):
    check = "mkdir -p /work && printf '{\"reward\": 0.75, \"passed\": 3, \"failed\": 1}' > /work/reward.json"
    from_file = api.post(f"/api/v1/sandboxes/{running}/grade", json={"cmd": check, "reward_file": "/work/reward.json", "timeout_s": 30})
    assert from_file.status_code == 200, from_file.text
    assert from_file.json()["reward"] == 0.75 and from_file.json()["source"] == "file"
    assert from_file.json()["details"] == {"passed": 3, "failed": 1}
    passed = api.post(f"/api/v1/sandboxes/{running}/grade", json={"cmd": "test 1 -eq 1", "timeout_s": 30}).json()
    failed = api.post(f"/api/v1/sandboxes/{running}/grade", json={"cmd": "echo nope; exit 3", "timeout_s": 30}).json()
    assert (passed["reward"], passed["exit_code"], passed["source"]) == (1.0, 0, "exit_code")
    assert (failed["reward"], failed["exit_code"], failed["stdout"]) == (0.0, 3, "nope\n")
    bad = api.post(f"/api/v1/sandboxes/{running}/grade", json={"cmd": "echo '{\"score\": 1}' > /work/r2.json", "reward_file": "/work/r2.json"})
    assert bad.status_code == 409 and bad.json()["error"]["code"] == "reward_file_invalid", bad.text
    missing = api.post(f"/api/v1/sandboxes/{running}/grade", json={"cmd": "true", "reward_file": "/work/never.json"})
    assert missing.status_code == 409 and missing.json()["error"]["code"] == "reward_file_missing", missing.text


def test_an_infrastructure_failure_is_an_error_never_a_zero_reward(api):
    sandbox = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 300}).json()["id"]
    timed_out = api.post(f"/api/v1/sandboxes/{sandbox}/grade", json={"cmd": "sleep 30", "timeout_s": 1})
    assert timed_out.status_code == 504 and timed_out.json()["error"]["code"] == "grade_timeout", timed_out.text
    assert "reward" not in timed_out.json()
    # The sandbox destroyed while its check runs.
    answers: list[Any] = []
    check = threading.Thread(
        target=lambda: answers.append(api.post(f"/api/v1/sandboxes/{sandbox}/grade", json={"cmd": "sleep 60", "timeout_s": 120}))
    )
    check.start()
    time.sleep(1.0)
    assert api.delete(f"/api/v1/sandboxes/{sandbox}", params={"wait": "true"}).status_code == 200
    check.join(90)
    died = answers[0]
    assert died.status_code == 409 and "reward" not in died.json(), died.text
    assert died.json()["error"]["code"] in ("sandbox_not_running", "sandbox_not_found"), died.text
    gone = api.post(f"/api/v1/sandboxes/{sandbox}/grade", json={"cmd": "true"})
    assert gone.status_code == 409 and "reward" not in gone.json(), gone.text
    assert json.loads(gone.text)["error"]["code"] == "sandbox_not_running"
    # A check the kernel killed for the sandbox's memory limit (a tiny one's 128 MiB): no reward either.
    small = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 300}).json()["id"]
    killed = api.post(f"/api/v1/sandboxes/{small}/grade", json={"cmd": "dd if=/dev/zero of=/dev/null bs=400M count=1", "timeout_s": 60})
    assert killed.status_code == 409 and killed.json()["error"]["code"] == "check_oom_killed", killed.text
    assert "reward" not in killed.json()
    api.delete(f"/api/v1/sandboxes/{small}")
