"""Background processes through the real HTTP API, and commands that end with the stream that started them.

What is checked is what the kernel says: a process's pid inside the sandbox
(``$$``), and whether the host still has the processes a command started
(read from ``/proc``, by their cgroup), not what the API claims.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK
from websockets.sync.client import connect

from tests.engine.engines import sandbox_processes, wait_for

pytestmark = pytest.mark.root


def engine_id(stack: Any, sandbox_id: str) -> str:
    """The engine's own id of a sandbox (its record's ``key`` is the API's id)."""
    with stack.engine.client() as engine:
        return next(record["id"] for record in engine.list() if record.get("key") == sandbox_id)


def host_pids(engine_sandbox: str, prefix: str) -> dict[int, str]:
    """Host pid -> command line of the sandbox's processes whose command line starts with ``prefix``."""
    return {pid: line for pid, line in sandbox_processes(engine_sandbox).items() if line.startswith(prefix)}


def gone(pid: int, line: str) -> bool:
    """The kernel no longer has process ``pid`` running ``line`` (it may have reused the number since)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip() != line
    except OSError:
        return True


def start(api: httpx.Client, sandbox_id: str, cmd: Any, **options: Any) -> dict[str, Any]:
    answer = api.post(f"/api/v1/sandboxes/{sandbox_id}/processes", json={"cmd": cmd, **options})
    assert answer.status_code == 201, answer.text
    return answer.json()


def test_a_background_process_is_listed_signalled_and_reaped(api: httpx.Client, running: str) -> None:
    process = start(
        api, running, "echo $$ > /tmp/bg.pid; trap 'echo got term; exit 7' TERM; echo ready; while :; do sleep 0.1; done"
    )
    pid = process["pid"]
    assert process["state"] == "running" and process["ended_at"] is None
    listed = api.get(f"/api/v1/sandboxes/{running}/processes").json()
    assert [item["pid"] for item in listed["processes"]] == [pid] and listed["next_cursor"] is None
    base = f"/api/v1/sandboxes/{running}/processes/{pid}"
    wait_for(lambda: api.get(base).json()["stdout"]["data"] == "ready\n", "its first line")
    inside = api.post(f"/api/v1/sandboxes/{running}/exec", json={"cmd": "cat /tmp/bg.pid"}).json()["stdout"].strip()
    assert inside == str(pid), "the pid is the sandbox's own"
    later = api.get(base, params={"stdout_offset": 6}).json()["stdout"]
    assert (later["data"], later["offset"], later["next_offset"]) == ("", 6, 6)
    waited = api.post(f"{base}/wait", json={"timeout_s": 0.2})
    assert waited.status_code == 200 and waited.json()["state"] == "running", waited.text
    signalled = api.post(f"{base}/signal", json={"signal": "TERM"})
    assert signalled.status_code == 200, signalled.text
    ended = api.post(f"{base}/wait", json={"timeout_s": 60, "stdout_offset": 6}).json()
    assert (ended["state"], ended["exit_code"], ended["stdout"]["data"]) == ("exited", 7, "got term\n")
    assert ended["ended_at"] is not None
    reaped = api.get(base)
    assert (reaped.status_code, reaped.json()["error"]["code"]) == (404, "process_not_found"), reaped.text
    assert api.get(f"/api/v1/sandboxes/{running}/processes").json()["processes"] == []


def test_a_cancelled_stream_kills_its_command_and_what_it_started_with_setsid(
    stack: Any, api: httpx.Client, running: str
) -> None:
    inner = engine_id(stack, running)
    cmd = "setsid sleep 711 </dev/null >/dev/null 2>&1 & (setsid sleep 712 </dev/null >/dev/null 2>&1 &); echo started; sleep 710"
    with httpx.Client(base_url=stack.url, headers=api.headers, timeout=60) as client:
        with client.stream("POST", f"/api/v1/sandboxes/{running}/exec/stream", json={"cmd": cmd, "timeout_s": 600}) as answer:
            assert answer.status_code == 200
            lines = answer.iter_lines()  # held, not dropped: dropping the iterator closes the response
            assert "started" in next(lines)
            alive = wait_for(lambda: len(host_pids(inner, "sleep 71")) == 3 and host_pids(inner, "sleep 71"), "all three sleeps")
        # The stream is closed (the client hung up mid-command).
    wait_for(lambda: all(gone(pid, line) for pid, line in alive.items()), "the command and its setsid descendants to die")
    assert api.post(f"/api/v1/sandboxes/{running}/exec", json={"cmd": "echo still"}).json()["stdout"] == "still\n"


def test_a_terminal_takes_input_and_a_new_size(api: httpx.Client, running: str) -> None:
    process = start(api, running, "/bin/sh", pty={"rows": 30, "cols": 90})
    base = f"/api/v1/sandboxes/{running}/processes/{process['pid']}"
    assert process["pty"] == {"rows": 30, "cols": 90}
    sent = api.post(f"{base}/input", json={"data": "stty size; tty\n"})
    assert sent.status_code == 200 and sent.json()["written"] == len("stty size; tty\n"), sent.text
    wait_for(lambda: "30 90" in api.get(base).json()["stdout"]["data"], "its size")
    assert "/dev/pts/" in api.get(base).json()["stdout"]["data"]
    resized = api.post(f"{base}/resize", json={"rows": 50, "cols": 132})
    assert resized.status_code == 200 and resized.json()["pty"] == {"rows": 50, "cols": 132}, resized.text
    api.post(f"{base}/input", json={"data_b64": base64.b64encode(b"stty size\nexit 4\n").decode()})
    ended = api.post(f"{base}/wait", json={"timeout_s": 60, "output": "base64"}).json()
    assert ended["exit_code"] == 4 and b"50 132" in base64.b64decode(ended["stdout"]["data"])


def test_input_to_a_pipe_and_end_of_input(api: httpx.Client, running: str) -> None:
    process = start(api, running, "wc -c")
    base = f"/api/v1/sandboxes/{running}/processes/{process['pid']}"
    assert (
        api.post(f"{base}/input", json={"data_b64": base64.b64encode(b"\x00\xff" * 500).decode(), "eof": True}).status_code == 200
    )
    assert api.post(f"{base}/wait", json={"timeout_s": 60}).json()["stdout"]["data"].strip() == "1000"


def test_refusals_are_clear(api: httpx.Client, running: str) -> None:
    sleeper = start(api, running, "sleep 600")
    base = f"/api/v1/sandboxes/{running}/processes/{sleeper['pid']}"

    def refused(answer: httpx.Response, status: int, code: str) -> None:
        assert (answer.status_code, answer.json()["error"]["code"]) == (status, code), answer.text

    refused(api.post(f"{base}/signal", json={"signal": "NOPE"}), 400, "invalid_request")
    refused(api.post(f"{base}/signal", json={"signal": 99}), 400, "invalid_request")
    refused(api.post(f"{base}/resize", json={"rows": 10, "cols": 10}), 400, "invalid_request")
    refused(api.post(f"{base}/input", json={"data": "a", "data_b64": "YQ=="}), 400, "invalid_request")
    refused(api.post(f"{base}/input", json={"data_b64": "not base64!"}), 400, "invalid_request")
    refused(api.post(f"/api/v1/sandboxes/{running}/processes", json={"cmd": "true", "stdin": "x"}), 400, "invalid_request")
    refused(api.post(f"/api/v1/sandboxes/{running}/processes", json={"cmd": "true", "pty": {"rows": 0}}), 400, "invalid_request")
    refused(api.get(f"/api/v1/sandboxes/{running}/processes/424242"), 404, "process_not_found")
    assert api.post(f"{base}/signal", json={"signal": "KILL"}).status_code == 200
    assert api.post(f"{base}/wait", json={"timeout_s": 60}).json()["signal"] == 9
    refused(api.post(f"{base}/signal", json={"signal": "KILL"}), 404, "process_not_found")
    exited = start(api, running, "true")
    wait_for(lambda: api.get(f"/api/v1/sandboxes/{running}/processes/{exited['pid']}").json()["state"] == "exited", "exit")
    refused(api.post(f"/api/v1/sandboxes/{running}/processes/{exited['pid']}/signal", json={}), 409, "process_not_running")


def test_the_number_of_processes_is_capped(api: httpx.Client, running: str) -> None:
    started = [start(api, running, "sleep 600")["pid"] for _ in range(32)]
    over = api.post(f"/api/v1/sandboxes/{running}/processes", json={"cmd": "sleep 600"})
    assert (over.status_code, over.json()["error"]["code"]) == (429, "too_many_processes"), over.text
    assert len(api.get(f"/api/v1/sandboxes/{running}/processes").json()["processes"]) == len(started)


def test_a_paused_sandbox_starts_none(api: httpx.Client, running: str) -> None:
    assert api.post(f"/api/v1/sandboxes/{running}/pause").status_code == 200
    answer = api.post(f"/api/v1/sandboxes/{running}/processes", json={"cmd": "true"})
    assert (answer.status_code, answer.json()["error"]["code"]) == (409, "sandbox_not_running"), answer.text
    assert api.get(f"/api/v1/sandboxes/{running}/processes").json()["processes"] == []


def _socket(stack: Any, sandbox_id: str, pid: int, key: str | None) -> Any:
    """A websocket client on a process's terminal (Daphne, as deployed), with ``key`` as its bearer."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = f"ws://127.0.0.1:{stack.ws_port}/api/v1/sandboxes/{sandbox_id}/processes/{pid}/pty"
    return connect(url, additional_headers=headers, open_timeout=30)


def test_a_terminal_over_a_websocket(stack: Any, api: httpx.Client, running: str) -> None:
    shell = start(api, running, "/bin/sh", pty={"rows": 24, "cols": 80})
    with _socket(stack, running, shell["pid"], stack.teams[0].key) as socket:
        socket.send(json.dumps({"type": "resize", "rows": 40, "cols": 100}))
        socket.send(b"stty size; echo $((6*7))\n")
        screen = b""
        while b"40 100" not in screen or b"\n42" not in screen.replace(b"\r", b""):
            frame = socket.recv(timeout=30)
            assert isinstance(frame, bytes), frame
            screen += frame
        socket.send(json.dumps({"type": "bogus"}))
        while isinstance(reply := socket.recv(timeout=30), bytes):
            pass  # the rest of the screen (its prompt)
        assert json.loads(reply)["code"] == "invalid_request", "a bad message is answered, not fatal"
        socket.send(json.dumps({"type": "input", "data": "exit 3\n"}))
        while True:
            frame = socket.recv(timeout=30)
            if isinstance(frame, str):
                break
        ended = json.loads(frame)
        assert (ended["type"], ended["pid"], ended["exit_code"]) == ("exit", shell["pid"], 3)
        with pytest.raises(ConnectionClosedOK):
            socket.recv(timeout=30)
    assert api.get(f"/api/v1/sandboxes/{running}/processes/{shell['pid']}").json()["state"] == "exited"


def test_leaving_the_websocket_leaves_the_process(stack: Any, api: httpx.Client, running: str) -> None:
    process = start(api, running, "echo hello; sleep 600")
    with _socket(stack, running, process["pid"], stack.teams[0].key) as socket:
        assert socket.recv(timeout=30) == b"hello\n", "what it wrote before the socket opened is replayed"
    still = api.get(f"/api/v1/sandboxes/{running}/processes/{process['pid']}").json()
    assert still["state"] == "running"


def test_the_websocket_is_the_team_s_own(stack: Any, team_b: Any, api: httpx.Client, running: str) -> None:
    process = start(api, running, "cat >/dev/null", pty={"rows": 24, "cols": 80})
    for key, code, close in (
        (team_b.key, "sandbox_not_found", 4404),
        (None, "unauthorized", 4401),
        ("wrong", "unauthorized", 4401),
    ):
        with _socket(stack, running, process["pid"], key) as socket:
            assert json.loads(socket.recv(timeout=30))["code"] == code
            with pytest.raises(ConnectionClosed) as closed:
                socket.recv(timeout=30)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == close
    with _socket(stack, running, 424242, stack.teams[0].key) as socket:
        assert json.loads(socket.recv(timeout=30))["code"] == "process_not_found"
    answer = api.get(f"/api/v1/sandboxes/{running}/processes/{process['pid']}").json()
    assert (answer["state"], answer["stdout"]["total_bytes"]) == ("running", 0), "team B's socket reached nothing"


def test_a_background_process_runs_as_the_user_named(api: httpx.Client, running: str) -> None:
    made = api.post(
        f"/api/v1/sandboxes/{running}/exec",
        json={"cmd": "echo 'runner:x:1500:1500:runner:/home/runner:/bin/sh' >> /etc/passwd; echo 'runner:x:1500:' >> /etc/group"},
    )
    assert made.json()["exit_code"] == 0, made.text
    process = start(api, running, "id -u; id -g; grep '^Uid:' /proc/self/status", user="runner")
    ended = api.post(f"/api/v1/sandboxes/{running}/processes/{process['pid']}/wait", json={"timeout_s": 60}).json()
    lines = ended["stdout"]["data"].splitlines()
    assert (ended["exit_code"], lines[0], lines[1]) == (0, "1500", "1500"), ended
    assert lines[2].split()[1:] == ["1500"] * 4, "every uid the kernel holds for it"
    refused = api.post(f"/api/v1/sandboxes/{running}/processes", json={"cmd": "true", "user": "nobody-here"})
    assert (refused.status_code, refused.json()["error"]["code"]) == (400, "user_not_found"), refused.text


def test_a_websocket_offset_that_is_not_a_whole_number_is_refused(stack: Any, api: httpx.Client, running: str) -> None:
    """``?stdout_offset=²`` passed str.isdigit() and then broke int(): the consumer died with a traceback
    and the socket closed with no word; "x" was silently 0. Both are an error frame, then 4400."""
    process = start(api, running, "echo hello; sleep 600")
    for query in ("stdout_offset=%C2%B2", "stdout_offset=x", "stderr_offset=-1"):
        url = f"ws://127.0.0.1:{stack.ws_port}/api/v1/sandboxes/{running}/processes/{process['pid']}/pty?{query}"
        with connect(url, additional_headers={"Authorization": f"Bearer {stack.teams[0].key}"}, open_timeout=30) as socket:
            error = json.loads(socket.recv(timeout=30))
            assert (error["type"], error["code"]) == ("error", "invalid_request"), (query, error)
            with pytest.raises(ConnectionClosed) as closed:
                socket.recv(timeout=30)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4400, query
    with _socket(stack, running, process["pid"], stack.teams[0].key) as socket:
        assert socket.recv(timeout=30) == b"hello\n", "a socket without offsets still replays from 0"


def test_a_terminal_socket_closes_when_its_key_is_revoked(stack: Any, api: httpx.Client, running: str) -> None:
    """A socket authenticated once kept its terminal, input and all, after its key was revoked."""
    key = api.post("/api/v1/keys", json={"name": "terminal-only", "role": "member"}).json()
    process = start(api, running, "cat", pty={"rows": 24, "cols": 80})
    with _socket(stack, running, process["pid"], key["secret"]) as socket:
        socket.send(b"before\n")
        seen = b""
        while b"before" not in seen:
            seen += socket.recv(timeout=30)
        assert api.delete(f"/api/v1/keys/{key['id']}").json()["revoked_at"]
        while isinstance(frame := socket.recv(timeout=30), bytes):
            pass  # the rest of the echo
        assert json.loads(frame)["code"] == "unauthorized"
        with pytest.raises(ConnectionClosed) as closed:
            socket.recv(timeout=30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401
    answer = api.get(f"/api/v1/sandboxes/{running}/processes/{process['pid']}").json()
    assert answer["state"] == "running", "closing the socket leaves the process"
