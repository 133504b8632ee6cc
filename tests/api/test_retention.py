"""Retention: a prompt's unique marker is found nowhere by default (database files and their write-ahead
log, every log, the broker, Redis, temporary files); with retention on it is kept, sealed, shown to its
team alone, and gone once the periodic purge has run past its 30 days."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.grading import add_upstream, deploy, judge_schema, remove_upstream

pytestmark = pytest.mark.root


KERNEL_FILESYSTEMS = {"proc", "sysfs", "cgroup", "cgroup2", "devtmpfs", "devpts", "debugfs", "tracefs", "securityfs", "bpf", "mqueue"}


def _kernel_mounts() -> set[str]:
    """Where the kernel's own filesystems are mounted: no file of ours is there, and some of theirs block
    (``/proc/kmsg`` under a proc mount another session left in /tmp) or change what they are read for."""
    mounts = set()
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] in KERNEL_FILESYSTEMS:
            mounts.add(fields[1].replace("\\040", " "))
    return mounts


def _read_without_blocking(path: Path) -> bytes:
    """A file's bytes; one that would block raises (and is skipped) instead of hanging the walk."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    with os.fdopen(descriptor, "rb") as file:
        return file.read()


def _files_holding(marker: bytes, roots: list[Path], since: float) -> list[str]:
    """Files under ``roots`` holding ``marker`` (under /tmp, only those written since ``since``: other
    sessions' files come and go there, and a directory may vanish mid-walk)."""
    found = []
    kernel = _kernel_mounts()
    for root in roots:
        for directory, subdirectories, names in os.walk(root):
            subdirectories[:] = [name for name in subdirectories if os.path.join(directory, name) not in kernel]
            for name in names:
                path = Path(directory, name)
                try:
                    status = path.lstat()
                    if not path.is_file() or path.is_symlink() or status.st_size > 512 * 1024 * 1024:
                        continue
                    if root == Path("/tmp") and status.st_mtime < since:
                        continue
                    if marker in _read_without_blocking(path):
                        found.append(str(path))
                except OSError:
                    continue
    return found


def _everywhere(stack: Any, marker: str, since: float) -> list[str]:
    """Where ``marker`` is: files of the stack (database, WAL, logs, broker, engine state, model servers'
    logs), temporary files written since the test began, rows (dumped), Redis keys of the stack."""
    found = _files_holding(marker.encode(), [stack.base_dir, Path("/tmp")], since)
    found = [path for path in found if "pytest-of" not in path and not path.endswith(".py")]
    dumped = stack.manage("dumpdata", "--natural-foreign", "-e", "contenttypes", "-e", "auth.permission", "-e", "sessions")
    if marker in dumped:
        found.append("a row of the database (dumpdata)")
    if stack.backend != "embedded":
        import redis

        client = redis.Redis.from_url(os.environ.get("FORKYARD_TEST_REDIS", "redis://127.0.0.1:6379/0"))
        for key in client.scan_iter(f"*{stack.tag}*"):
            if any(marker.encode() in (value or b"") for value in _redis_values(client, key)):
                found.append(f"redis {key!r}")
        dump = subprocess.run(["pg_dump", "--data-only", stack.environment()["DATABASE_URL"]], capture_output=True, timeout=120)
        if dump.returncode == 0 and marker.encode() in dump.stdout:
            found.append("the PostgreSQL database (pg_dump)")
    return found


def _redis_values(client: Any, key: bytes) -> list[bytes]:
    """Everything a Redis key holds, whatever its kind (kombu's unacked messages are a hash, say)."""
    kind = client.type(key)
    if kind == b"string":
        return [client.get(key) or b""]
    if kind == b"list":
        return list(client.lrange(key, 0, -1))
    if kind == b"hash":
        return [*client.hkeys(key), *client.hvals(key)]
    if kind == b"set":
        return list(client.smembers(key))
    if kind == b"zset":
        return list(client.zrange(key, 0, -1))
    if kind == b"stream":
        return [repr(entry).encode() for entry in client.xrange(key)]
    return []


def _use_the_gateway(stack: Any, key: str, model: str, marker: str, headers: dict[str, str] | None = None) -> str:
    """A call, a stream and a grade, each carrying the marker; the grade's id."""
    client = openai.OpenAI(base_url=f"{stack.url}/api/v1/inference", api_key=key, max_retries=0, default_headers=headers or {})
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"please grade {marker} now"}], max_tokens=8)
    list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"stream {marker}"}], max_tokens=8, stream=True))
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}", **(headers or {})}, timeout=120) as api:
        grade = api.post(
            "/api/v1/grades",
            json={
                "model": model,
                "rubric": [{"role": "user", "content": "Grade {answer}"}],
                "schema": judge_schema(),
                "max_tokens": 64,
                "items": [{"values": {"answer": f"the answer is {marker}"}}],
            },
        )
        assert grade.status_code == 200, grade.text
        return str(grade.json()["id"])


def _use_an_upstream(stack: Any, model: str, marker: str) -> None:
    """A call and a stream carrying the marker through an operator's upstream: another forkyard web process
    (answering through its views) serving ``model`` under another name. The gateway's pass-through and the
    other side's handling keep nothing either."""
    remote = f"remote-{uuid.uuid4().hex[:6]}"
    base_url = f"{stack.start_view_only_web()}/api/v1/inference"
    add_upstream(stack, remote, base_url, stack.teams[0].key, [remote], model_names={remote: model}, keeps_prompts=False)
    try:
        client = openai.OpenAI(base_url=f"{stack.url}/api/v1/inference", api_key=stack.teams[0].key, max_retries=0)
        deadline = time.monotonic() + 10  # the gateway reads a team's routes again every 2 s
        while remote not in [listed.id for listed in client.models.list()]:
            assert time.monotonic() < deadline, "the upstream's model never appeared"
            time.sleep(0.2)
        message = [{"role": "user", "content": f"upstream {marker}"}]
        assert client.chat.completions.create(model=remote, messages=message, max_tokens=8).model == remote
        assert list(client.chat.completions.create(model=remote, messages=message, max_tokens=8, stream=True))
    finally:
        remove_upstream(stack, remote)


def _console_as(stack: Any, team: Any) -> httpx.Client:
    """A browser-like client of the console, signed in as the team's user."""
    console = httpx.Client(base_url=stack.url, timeout=60)
    login = console.get("/login/")
    console.post(
        "/login/",
        data={"username": team.username, "password": team.password, "csrfmiddlewaretoken": login.cookies["csrftoken"]},
        headers={"Referer": f"{stack.url}/login/"},
    )
    return console


def _settle(stack: Any) -> None:
    """Let what may write asynchronously write (records after answers, the agent's WAL checkpoint)."""
    time.sleep(3)
    stack.shell("from console.db import truncate_write_ahead_log; truncate_write_ahead_log()")


def test_by_default_a_prompt_is_written_nowhere(stack, judge):
    marker = f"MARKER-{uuid.uuid4().hex}"
    since = time.time() - 1
    grade_id = _use_the_gateway(stack, stack.teams[0].key, judge["name"], marker)
    _use_an_upstream(stack, judge["name"], marker)
    # Calls that fail carry it too (in their content: a model's name is metadata, kept like the rest): a model
    # no one serves, an unknown field, a schema the request breaks.
    client = openai.OpenAI(base_url=f"{stack.url}/api/v1/inference", api_key=stack.teams[0].key, max_retries=0)
    failing: list[dict[str, Any]] = [
        {"model": "no-such-model", "messages": [{"role": "user", "content": marker}]},
        {"model": judge["name"], "messages": [{"role": "user", "content": marker}], "extra_body": {"no_such_field": marker}},
        {"model": judge["name"], "messages": [{"role": "user", "content": marker}], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": marker}}}},
    ]
    for call in failing:
        with pytest.raises(openai.APIStatusError) as failed:
            client.chat.completions.create(**call)
        assert 400 <= failed.value.status_code < 500, failed.value.body
    _settle(stack)
    assert _everywhere(stack, marker, since) == []
    # ... while its metadata was recorded: the calls, their tokens, the grade's numbers.
    counted = stack.shell(
        "from grading.models import InferenceCall, Grade; from billing.models import MeteredUsage; "
        f"print(InferenceCall.objects.filter(grade_id={grade_id!r}).count(), Grade.objects.get(pk={grade_id!r}).output_tokens > 0, "
        f"MeteredUsage.objects.filter(item={judge['name']!r}).count() > 0)"
    ).strip().splitlines()[-1].split()
    assert counted == ["1", "True", "True"], counted


def test_with_retention_content_is_kept_for_its_team_only_then_purged(stack, tiny_model, team_b):
    team = stack.new_team("Keeps content")
    stack.shell(f"from console.models import Team; Team.objects.filter(pk={team.team_id!r}).update(retain_content_days=30)")
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {team.key}"}, timeout=120) as api:
        endpoint = deploy(api, "keeper")
        try:
            marker, opted_out = f"KEPT-{uuid.uuid4().hex}", f"OPTOUT-{uuid.uuid4().hex}"
            since = time.time() - 1
            grade_id = _use_the_gateway(stack, team.key, endpoint["name"], marker)
            _use_the_gateway(stack, team.key, endpoint["name"], opted_out, headers={"X-Forkyard-Retention": "off"})
            _settle(stack)
            # Kept: the grade shows its items to its team; the console shows the call's prompt to its members.
            grade = api.get(f"/api/v1/grades/{grade_id}").json()
            assert grade["retained"] is True and marker in str(grade["results"])
            call_id = stack.shell(
                f"from grading.models import InferenceCall; print(InferenceCall.objects.filter(team_id={team.team_id!r}, "
                "grade__isnull=True, content__isnull=False).order_by('created_at').first().id)"
            ).strip().splitlines()[-1]
            console = _console_as(stack, team)
            page = console.get(f"/inference/calls/{call_id}/")
            assert page.status_code == 200 and marker in page.text
            # Sealed at rest: the database's files hold ciphertext, not the marker; the opted-out calls nowhere at all.
            assert [path for path in _everywhere(stack, marker, since) if "dumpdata" not in path and "pg_dump" not in path] == []
            assert _everywhere(stack, opted_out, since) == []
            # Another team sees none of it: not the grade, not the call's page.
            with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {team_b.key}"}) as other:
                refused = other.get(f"/api/v1/grades/{grade_id}")
                assert refused.status_code == 404 and marker not in refused.text
            intruder = _console_as(stack, team_b)
            assert intruder.get(f"/inference/calls/{call_id}/").status_code == 404
            # The clock moved forward (time-machine, in a process of the stack): 29 days on, the periodic task
            # (the function beat runs every hour) keeps all of it; 31 days on, it deletes all of it.
            def purge_after(days: int) -> tuple[int, int]:
                out = stack.shell(
                    "import time_machine; from datetime import timedelta; from django.utils import timezone; "
                    "from grading.models import RetainedContent; from grading.tasks import purge_retained_content; "
                    f"time_machine.travel(timezone.now() + timedelta(days={days}), tick=False).start(); "
                    f"print(purge_retained_content(), RetainedContent.objects.filter(team_id={team.team_id!r}).count())"
                )
                deleted, left = out.strip().splitlines()[-1].split()
                return int(deleted), int(left)

            assert purge_after(0)[1] == 3, "the call's, the stream's and the grade's content"
            assert purge_after(29)[1] == 3, "kept until their 30 days are up"
            deleted, left = purge_after(31)
            assert left == 0 and deleted >= 3
            _settle(stack)
            assert _everywhere(stack, marker, since) == []
            after = api.get(f"/api/v1/grades/{grade_id}").json()
            assert after["results"] is None and after["retained"] is False and after["items"] == 1
            assert marker not in console.get(f"/inference/calls/{call_id}/").text
        finally:
            api.delete(f"/api/v1/endpoints/{endpoint['id']}")
