"""Sandboxes through the real HTTP API: create, exec, files, pause, kill."""

from __future__ import annotations

import base64
import io
import json
import tarfile
import time
from datetime import UTC, datetime

import pytest

pytestmark = pytest.mark.root


@pytest.fixture
def sandbox(api):
    created = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 300, "labels": {"suite": "api"}})
    assert created.status_code == 201, created.text
    yield created.json()
    api.delete(f"/api/v1/sandboxes/{created.json()['id']}")


def test_every_response_names_the_region_and_the_limits(api, sandbox):
    for response in (api.get("/api/v1/me"), api.get(f"/api/v1/sandboxes/{sandbox['id']}"), api.get("/api/v1/sandboxes/sb_nope")):
        assert response.headers["X-Forkyard-Region"] == "test-region-1"
        assert int(response.headers["X-RateLimit-Limit"]) > 0
        assert "X-RateLimit-Remaining" in response.headers and "X-RateLimit-Reset" in response.headers


def test_create_returns_a_running_sandbox(api, sandbox):
    assert sandbox["state"] == "running"
    assert sandbox["id"].startswith("sb_")
    assert sandbox["host"] and sandbox["region"] == "test-region-1"
    assert (sandbox["cpu"], sandbox["memory_mib"], sandbox["size"]) == (1.0, 128, "tiny")
    assert sandbox["labels"] == {"suite": "api"}
    assert sandbox["ready_at"] and sandbox["expires_at"]
    listed = api.get("/api/v1/sandboxes", params={"label": "suite=api", "state": "running"}).json()["sandboxes"]
    assert sandbox["id"] in {item["id"] for item in listed}


def test_exec_results(api, sandbox):
    url = f"/api/v1/sandboxes/{sandbox['id']}/exec"
    result = api.post(url, json={"cmd": "echo out; echo err >&2; exit 4"}).json()
    assert (result["exit_code"], result["stdout"], result["stderr"]) == (4, "out\n", "err\n")
    assert result["duration_ms"] > 0 and result["timed_out"] is False
    assert api.post(url, json={"cmd": ["cat"], "stdin": "piped"}).json()["stdout"] == "piped"
    assert api.post(url, json={"cmd": "pwd; echo $X", "cwd": "/tmp", "env": {"X": "y"}}).json()["stdout"] == "/tmp\ny\n"
    timed = api.post(url, json={"cmd": "sleep 30", "timeout_s": 0.3}).json()
    assert timed["timed_out"] is True and timed["exit_code"] == 137
    raw = api.post(url, json={"cmd": "printf '\\377\\000'", "output": "base64"}).json()
    assert base64.b64decode(raw["stdout"]) == b"\xff\x00" and raw["encoding"] == "base64"
    capped = api.post(url, json={"cmd": "head -c 100000 /dev/zero", "max_output_bytes": 1000}).json()
    assert capped["stdout_truncated"] is True and len(capped["stdout"]) == 1000


def test_exec_stream_sends_output_as_it_comes(api, sandbox):
    """The first line arrives while the command still runs: the command waits for a file that
    the test writes only once it has that line (a stream held back to the end would never get it)."""
    base = f"/api/v1/sandboxes/{sandbox['id']}"
    command = (
        "echo first; i=0; while [ ! -e /tmp/go ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; "
        "if [ -e /tmp/go ]; then echo released; else echo never released; fi"
    )
    messages = []
    with api.stream("POST", f"{base}/exec/stream", json={"cmd": command}) as response:
        assert response.headers["content-type"] == "application/x-ndjson"
        for line in response.iter_lines():
            messages.append(json.loads(line))
            if messages[-1] == {"type": "stdout", "data": "first\n"}:
                written = api.put(f"{base}/files", params={"path": "/tmp/go"}, content=b"")
                assert written.status_code == 200, written.text
    outputs = [message["data"] for message in messages if message["type"] == "stdout"]
    assert "".join(outputs) == "first\nreleased\n", messages
    assert outputs[0] == "first\n", "the first line came with the rest"
    assert [message["type"] for message in messages][-1] == "exit" and messages[-1]["exit_code"] == 0


def test_files_round_trip_and_archives(api, sandbox):
    base = f"/api/v1/sandboxes/{sandbox['id']}"
    payload = bytes(range(256)) * 4096
    written = api.put(f"{base}/files", params={"path": "/work/data.bin"}, content=payload)
    assert written.status_code == 200 and written.json()["bytes"] == len(payload)
    assert api.get(f"{base}/files", params={"path": "/work/data.bin"}).content == payload
    entries = api.get(f"{base}/files/list", params={"path": "/work"}).json()["entries"]
    assert [(entry["name"], entry["size"]) for entry in entries] == [("data.bin", len(payload))]
    archive = api.get(f"{base}/archive", params={"path": "/work"}).content
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        assert tar.extractfile("work/data.bin").read() == payload
    upload = io.BytesIO()
    with tarfile.open(fileobj=upload, mode="w") as tar:
        info = tarfile.TarInfo("pkg/hello.sh")
        info.size, info.mode = 19, 0o755
        tar.addfile(info, io.BytesIO(b"#!/bin/sh\necho hi\n\n"))
    assert api.put(f"{base}/archive", params={"path": "/opt"}, content=upload.getvalue()).json()["files"] == 1
    assert api.post(f"{base}/exec", json={"cmd": ["/opt/pkg/hello.sh"]}).json()["stdout"] == "hi\n"
    assert api.delete(f"{base}/files", params={"path": "/work", "recursive": True}).json()["removed"] is True
    missing = api.get(f"{base}/files", params={"path": "/work/data.bin"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "file_not_found"


def test_pause_and_resume(api, sandbox):
    base = f"/api/v1/sandboxes/{sandbox['id']}"
    assert api.post(f"{base}/pause").json()["state"] == "paused"
    refused = api.post(f"{base}/exec", json={"cmd": "true"})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "sandbox_not_running"
    assert api.post(f"{base}/resume").json()["state"] == "running"
    assert api.post(f"{base}/exec", json={"cmd": "echo back"}).json()["stdout"] == "back\n"
    usage = api.get("/api/v1/usage", params={"group_by": "size"}).json()
    assert {line["group"] for line in usage["lines"]} >= {"running:tiny", "paused:tiny"}


def test_kill_is_final_and_idempotent(api):
    sandbox = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny"}).json()
    first = api.delete(f"/api/v1/sandboxes/{sandbox['id']}")
    assert first.status_code == 200 and first.json()["state"] == "destroyed" and first.json()["ended_at"]
    assert api.delete(f"/api/v1/sandboxes/{sandbox['id']}").json()["state"] == "destroyed"
    gone = api.post(f"/api/v1/sandboxes/{sandbox['id']}/exec", json={"cmd": "true"})
    assert gone.status_code == 409 and gone.json()["error"]["code"] == "sandbox_not_running"


def test_idempotent_create_creates_once(api, stack):
    body = {"template": "base", "size": "tiny", "idempotency_key": f"retry-{time.time()}"}
    first = api.post("/api/v1/sandboxes", json=body)
    second = api.post("/api/v1/sandboxes", json=body)
    assert (first.status_code, second.status_code) == (201, 200)
    assert first.json()["id"] == second.json()["id"]
    listed = api.get("/api/v1/sandboxes", params={"state": "running", "limit": 1000}).json()["sandboxes"]
    assert sum(1 for item in listed if item["id"] == first.json()["id"]) == 1
    api.delete(f"/api/v1/sandboxes/{first.json()['id']}")


def test_ttl_ends_the_sandbox_and_its_billing(api, stack):
    """The engine's TTL timer ends it (its own record says so), at the expiry the API promised, and the
    billed period closes then."""
    sandbox = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 1}).json()
    with stack.engine.client() as engine:
        [engine_id] = [record["id"] for record in engine.list() if record.get("key") == sandbox["id"]]
        expired_before = engine.info()["counters"]["ttl_expired"]
    deadline = time.monotonic() + 30  # a guard against a hang, not a measure
    state = sandbox["state"]
    while time.monotonic() < deadline and state == "running":
        time.sleep(0.2)
        state = api.get(f"/api/v1/sandboxes/{sandbox['id']}").json()["state"]
    final = api.get(f"/api/v1/sandboxes/{sandbox['id']}").json()
    assert final["state"] == "destroyed", final
    with stack.engine.client() as engine:
        record = engine.get(engine_id)
        assert engine.info()["counters"]["ttl_expired"] > expired_before
    assert (record["state"], record["reason"]) == ("destroyed", "ttl expired"), record
    assert record["expires_at"] - record["created_at"] == pytest.approx(1.0)
    assert record["ended_at"] >= record["expires_at"], "ended before its TTL"

    def epoch_ms(text: str) -> int:
        return int(datetime.fromisoformat(text).timestamp() * 1000)

    def engine_ms(epoch_s: float) -> int:
        return int(datetime.fromtimestamp(epoch_s, tz=UTC).timestamp() * 1000)

    # The API shows the engine's own times (to the millisecond), not when the control plane noticed.
    assert epoch_ms(final["expires_at"]) == engine_ms(record["expires_at"])
    assert epoch_ms(final["ended_at"]) == engine_ms(record["ended_at"])
    listed = api.get("/api/v1/sandboxes", params={"state": "running", "limit": 1000}).json()["sandboxes"]
    assert sandbox["id"] not in {item["id"] for item in listed}
    # One billed period, closed at the engine's end time.
    periods = stack.shell(
        "from billing.models import UsagePeriod; "
        f"print([(p.ended_at is None, int(p.ended_at.timestamp() * 1000) if p.ended_at else 0) for p in UsagePeriod.objects.filter(sandbox_id={sandbox['id']!r})])"
    )
    assert periods.strip().splitlines()[-1] == str([(False, engine_ms(record["ended_at"]))])
