"""Batches through the real API: one command in many sandboxes (streamed as each finishes), and kills by label or launch."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.stack import launch_members, wait_for_launch, wait_for_sandboxes

pytestmark = pytest.mark.root


def batch(api: httpx.Client, **body: Any) -> list[dict[str, Any]]:
    """Every line of a batch's answer; the answer must be a stream of JSON lines ending with its summary."""
    with api.stream("POST", "/api/v1/exec", json=body) as response:
        assert response.status_code == 200, response.read().decode()
        assert response.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in response.iter_lines() if line.strip()]
    assert lines and lines[-1]["type"] == "summary", lines[-3:]
    return lines


def create(api: httpx.Client, **labels: str) -> dict[str, Any]:
    created = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 300, "labels": labels})
    assert created.status_code == 201, created.text
    return created.json()


def state_of(api: httpx.Client, sandbox_id: str) -> str:
    return str(api.get(f"/api/v1/sandboxes/{sandbox_id}").json()["state"])


@pytest.fixture
def tag() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture
def three(api: httpx.Client, tag: str) -> Iterator[list[dict[str, Any]]]:
    made = [create(api, batch=tag, index=str(index)) for index in range(3)]
    yield made
    for sandbox in made:
        api.delete(f"/api/v1/sandboxes/{sandbox['id']}", params={"wait": "false"})


@pytest.mark.slow
def test_a_command_in_each_of_a_launch_of_200_then_killed_by_launch(api: httpx.Client, stack: Any, tag: str) -> None:
    created = api.post(
        "/api/v1/launches", json={"template": "base", "size": "tiny", "count": 200, "ttl_s": 600, "labels": {"batch": tag}}
    )
    assert created.status_code == 201, created.text
    launch = wait_for_launch(api, created.json()["id"], {"ready", "failed"})
    assert launch["progress"]["running"] == 200, launch
    members = {member["id"] for member in launch_members(api, launch["id"])}

    lines = batch(api, launch=launch["id"], cmd="hostname; echo err >&2", timeout_s=30)
    results = lines[:-1]
    assert sorted(line["sandbox_id"] for line in results) == sorted(members), "each sandbox answered once"
    assert all(line["type"] == "result" and line["exit_code"] == 0 and line["stderr"] == "err\n" for line in results)
    assert len({line["stdout"] for line in results}) == 200, "each its own machine"
    assert {key: lines[-1][key] for key in ("sandboxes", "succeeded", "failed", "errors")} == {
        "sandboxes": 200,
        "succeeded": 200,
        "failed": 0,
        "errors": 0,
    }
    by_label = batch(api, label=f"batch:{tag}", cmd=["sh", "-c", "exit 3"])
    assert lines_summary(by_label) == (200, 0, 200, 0) and {line["exit_code"] for line in by_label[:-1]} == {3}

    killed = api.delete("/api/v1/sandboxes", params={"launch": launch["id"]})
    assert killed.status_code == 200, killed.text
    assert killed.json() == {"count": 200, "stopping": 200, "destroyed": 0}
    assert wait_for_launch(api, launch["id"], {"stopped"})["progress"]["ended"] == 200
    with stack.engine.client() as engine:
        assert [record for record in engine.list() if record.get("key") in members] == []
    again = batch(api, launch=launch["id"], cmd="true")
    assert lines_summary(again) == (0, 0, 0, 0), "a launch's ended sandboxes are not named"


def lines_summary(lines: list[dict[str, Any]]) -> tuple[int, int, int, int]:
    summary = lines[-1]
    return summary["sandboxes"], summary["succeeded"], summary["failed"], summary["errors"]


def test_each_sandbox_is_answered_as_it_finishes(api: httpx.Client, three: list[dict[str, Any]]) -> None:
    """The slow sandbox's command waits for a file the test writes only once the two others have been
    answered: a batch held back until every command ended would never get there."""
    slow = three[0]["id"]
    assert api.put(f"/api/v1/sandboxes/{slow}/files", params={"path": "/tmp/slow"}, content=b"").status_code == 200
    command = (
        "i=0; while [ -e /tmp/slow ] && [ ! -e /tmp/go ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; "
        "if [ -e /tmp/slow ] && [ ! -e /tmp/go ]; then echo never released; else echo done; fi"
    )
    seen: list[dict[str, Any]] = []
    with api.stream("POST", "/api/v1/exec", json={"sandbox_ids": [sandbox["id"] for sandbox in three], "cmd": command}) as answer:
        assert answer.status_code == 200
        for text in answer.iter_lines():
            seen.append(json.loads(text))
            if len(seen) == 2:
                assert {line["sandbox_id"] for line in seen} == {three[1]["id"], three[2]["id"]}, seen
                written = api.put(f"/api/v1/sandboxes/{slow}/files", params={"path": "/tmp/go"}, content=b"")
                assert written.status_code == 200, written.text
    assert [line["sandbox_id"] for line in seen[:3]][-1] == slow
    assert [line["stdout"] for line in seen[:3]] == ["done\n"] * 3, seen
    assert seen[-1]["type"] == "summary" and seen[-1]["succeeded"] == 3


def test_sandboxes_that_cannot_run_it_are_lines_of_their_own(api: httpx.Client, stack: Any, team_b: Any, tag: str) -> None:
    """Another team's sandbox is not found (and runs nothing), an ended one is not running, each id is answered once."""
    mine = create(api, batch=tag)
    ended = create(api, batch=tag)
    api.delete(f"/api/v1/sandboxes/{ended['id']}")
    with stack.client(team_b) as intruder:
        theirs = create(intruder, batch=tag)
        try:
            ids = [mine["id"], theirs["id"], ended["id"], "sb_0000000000000000", mine["id"]]
            lines = batch(api, sandbox_ids=ids, cmd="touch /tmp/ran; echo ran")
            by_id = {line["sandbox_id"]: line for line in lines[:-1]}
            assert len(lines) == 5 and set(by_id) == set(ids), lines
            assert by_id[mine["id"]]["stdout"] == "ran\n"
            for other in (theirs["id"], "sb_0000000000000000"):
                assert by_id[other]["type"] == "error" and by_id[other]["status"] == 404, by_id[other]
                assert by_id[other]["error"]["code"] == "sandbox_not_found"
            assert by_id[ended["id"]]["error"]["code"] == "sandbox_not_running"
            assert lines_summary(lines) == (4, 1, 0, 3)
            nobody = by_id["sb_0000000000000000"]["error"]["message"].replace("sb_0000000000000000", theirs["id"])
            assert by_id[theirs["id"]]["error"]["message"] == nobody, "another team's sandbox answers as nobody's"
            kept = intruder.get(f"/api/v1/sandboxes/{theirs['id']}/files", params={"path": "/tmp/ran"})
            assert kept.status_code == 404, "team B's sandbox ran team A's command"
            by_label = batch(api, label=f"batch={tag}", cmd="true")
            assert [line["sandbox_id"] for line in by_label[:-1]] == [mine["id"]], "a label names the team's own only"
        finally:
            intruder.delete(f"/api/v1/sandboxes/{theirs['id']}")
            api.delete(f"/api/v1/sandboxes/{mine['id']}")


def test_a_batch_sent_again_with_its_key_runs_nothing_twice(api: httpx.Client, three: list[dict[str, Any]]) -> None:
    body = {"sandbox_ids": [sandbox["id"] for sandbox in three], "cmd": "echo x >> /tmp/count", "idempotency_key": "k" * 255}
    first, second = batch(api, **body), batch(api, **body)
    assert {line["replayed"] for line in first[:-1]} == {False}
    assert {line["replayed"] for line in second[:-1]} == {True}
    counted = batch(api, sandbox_ids=body["sandbox_ids"], cmd="wc -l < /tmp/count")
    assert {line["stdout"].strip() for line in counted[:-1]} == {"1"}


def test_exec_aliases_work_in_a_batch_and_alone(api: httpx.Client, three: list[dict[str, Any]]) -> None:
    ids = [sandbox["id"] for sandbox in three]
    lines = batch(api, sandbox_ids=ids, cmd="pwd; sleep 5", workdir="/tmp", timeout=0.5)
    assert all(line["timed_out"] and line["stdout"] == "/tmp\n" for line in lines[:-1]), lines
    assert lines_summary(lines) == (3, 0, 3, 0)
    alone = api.post(f"/api/v1/sandboxes/{ids[0]}/exec", json={"cmd": "pwd", "workdir": "/tmp", "timeout": 5})
    assert alone.status_code == 200 and alone.json()["stdout"] == "/tmp\n", alone.text
    for both in ({"timeout": 1, "timeout_s": 1}, {"workdir": "/", "cwd": "/"}):
        name = next(iter(both))
        for url, selection in ((f"/api/v1/sandboxes/{ids[0]}/exec", {}), ("/api/v1/exec", {"sandbox_ids": ids})):
            refused = api.post(url, json={"cmd": "true", **selection, **both})
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["field"] == name and "give one of them" in refused.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"cmd": "true"}, "sandbox_ids"),
        ({"cmd": "true", "launch": "launch_0", "label": "a:b"}, "label"),
        ({"cmd": "true", "sandbox_ids": []}, "sandbox_ids"),
        ({"cmd": "", "label": "a:b"}, "cmd"),
        ({"cmd": "true", "label": "a:b", "timeout_ms": 5}, "timeout_ms"),
    ],
    ids=["none", "two", "empty-ids", "empty-command", "unknown-field"],
)
def test_a_batch_that_cannot_be_run_is_a_400_naming_the_field(api: httpx.Client, body: dict[str, Any], field: str) -> None:
    answer = api.post("/api/v1/exec", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["field"] == field, answer.text


def test_a_batch_over_the_limit_is_refused_before_anything_runs(api: httpx.Client) -> None:
    limit = max(10_000, api.get("/api/v1/me").json()["limits"]["max_launch_count"])
    answer = api.post("/api/v1/exec", json={"cmd": "true", "sandbox_ids": [f"sb_{index:016x}" for index in range(limit + 1)]})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["field"], error["details"]["limit"]) == ("batch_too_large", "sandbox_ids", limit)
    missing = api.post("/api/v1/exec", json={"cmd": "true", "launch": "launch_0000000000000000"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "launch_not_found"
    nothing = batch(api, label=f"nobody-has:{uuid.uuid4().hex}", cmd="true")
    assert nothing == [{**nothing[0], "type": "summary", "sandboxes": 0, "succeeded": 0, "failed": 0, "errors": 0}]


def test_kill_by_label_kills_the_teams_own_and_nothing_else(
    api: httpx.Client, stack: Any, team_b: Any, three: list[dict[str, Any]], tag: str
) -> None:
    other = create(api, batch=f"{tag}-other")
    with stack.client(team_b) as intruder:
        theirs = create(intruder, batch=tag)
        try:
            for params in ({}, {"label": ""}):
                refused = api.delete("/api/v1/sandboxes", params=params)
                assert refused.status_code == 400, refused.text
                assert refused.json()["error"]["code"] == ("filter_required" if not params else "invalid_request")
            both = api.delete("/api/v1/sandboxes", params={"label": f"batch:{tag}", "launch": "launch_0"})
            assert both.status_code == 400 and both.json()["error"]["field"] == "launch"
            assert all(state_of(api, sandbox["id"]) == "running" for sandbox in three), "a refused kill killed"
            missing = api.delete("/api/v1/sandboxes", params={"launch": "launch_0000000000000000"})
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "launch_not_found"

            killed = api.delete("/api/v1/sandboxes", params={"label": f"batch:{tag}"})
            assert killed.status_code == 200 and killed.json() == {"count": 3, "stopping": 3, "destroyed": 0}, killed.text
            assert set(wait_for_sandboxes(api, [sandbox["id"] for sandbox in three]).values()) == {"destroyed"}
            assert state_of(api, other["id"]) == "running"
            assert state_of(intruder, theirs["id"]) == "running", "team B's sandbox with the same label was killed"
            again = api.delete("/api/v1/sandboxes", params={"label": f"batch={tag}"})
            assert again.json()["count"] == 0, "what is gone is not asked twice"
        finally:
            intruder.delete(f"/api/v1/sandboxes/{theirs['id']}")
            api.delete(f"/api/v1/sandboxes/{other['id']}")


def test_a_kill_by_label_ends_queued_sandboxes_at_once(api: httpx.Client, tag: str) -> None:
    queued = api.post(
        "/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 60, "labels": {"q": tag}, "wait": False}
    )
    assert queued.status_code == 202, queued.text
    killed = api.delete("/api/v1/sandboxes", params={"label": f"q:{tag}"}).json()
    assert killed["count"] == 1 and killed["stopping"] + killed["destroyed"] == 1
    assert wait_for_sandboxes(api, [queued.json()["id"]]) == {queued.json()["id"]: "destroyed"}
