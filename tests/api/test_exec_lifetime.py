"""A command lives no longer than its caller, and an exec sent again with its key runs once.

What is checked is what the sandbox's kernel says: whether the command's
process still exists (``kill -0`` from inside the sandbox), and what the
command wrote.  Waits are generous guards against a hang, not speed checks.
"""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest

pytestmark = pytest.mark.root


def run(api: httpx.Client, sandbox_id: str, cmd: str, **options: object) -> dict:
    answer = api.post(f"/api/v1/sandboxes/{sandbox_id}/exec", json={"cmd": cmd, **options})
    assert answer.status_code == 200, answer.text
    return answer.json()


def alive(api: httpx.Client, sandbox_id: str, pid_file: str) -> bool:
    return run(api, sandbox_id, f"kill -0 $(cat {pid_file}) 2>/dev/null && echo alive || echo gone")["stdout"].strip() == "alive"


def gone_within(api: httpx.Client, sandbox_id: str, pid_file: str, seconds: float = 20) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(api, sandbox_id, pid_file):
            return True
        time.sleep(0.2)
    return False


def started(api: httpx.Client, sandbox_id: str, pid_file: str) -> None:
    deadline = time.monotonic() + 20
    while run(api, sandbox_id, f"test -s {pid_file} && echo yes || echo no")["stdout"].strip() != "yes":
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)


def test_a_client_that_goes_away_ends_its_command(stack, api: httpx.Client, running: str) -> None:
    cmd = "echo $$ > /tmp/cmd.pid; setsid sh -c 'echo $$ > /tmp/detached.pid; sleep 300' & sleep 300"

    def caller() -> None:
        with httpx.Client(base_url=stack.url, headers=api.headers, timeout=httpx.Timeout(60, read=1.5)) as client:
            with pytest.raises(httpx.ReadTimeout):
                client.post(f"/api/v1/sandboxes/{running}/exec", json={"cmd": cmd, "timeout_s": 600})

    thread = threading.Thread(target=caller)
    thread.start()
    started(api, running, "/tmp/cmd.pid")
    started(api, running, "/tmp/detached.pid")
    thread.join(30)
    assert gone_within(api, running, "/tmp/cmd.pid"), "the command outlived its caller"
    assert gone_within(api, running, "/tmp/detached.pid"), "what the command started with setsid outlived its caller"


def test_a_web_server_killed_mid_command_ends_it(stack, api: httpx.Client, running: str) -> None:
    def caller() -> None:
        with httpx.Client(base_url=stack.url, headers=api.headers, timeout=60) as client:
            with pytest.raises(httpx.TransportError):
                client.post(
                    f"/api/v1/sandboxes/{running}/exec", json={"cmd": "echo $$ > /tmp/web.pid; sleep 300", "timeout_s": 600}
                )

    thread = threading.Thread(target=caller)
    thread.start()
    started(api, running, "/tmp/web.pid")
    stack.kill(stack.web_pid)
    thread.join(30)
    stack.restart_web()  # the HTTP server alone: start_web would start a second board, and leak the first
    assert gone_within(api, running, "/tmp/web.pid"), "the command outlived the web server that ran it"


def test_an_exec_sent_again_with_its_key_runs_once(api: httpx.Client, running: str) -> None:
    key = f"exec-{uuid.uuid4().hex}"
    first = run(api, running, "echo ran >> /tmp/count; echo out", idempotency_key=key)
    again = run(api, running, "echo ran >> /tmp/count; echo out", idempotency_key=key)
    assert (first["stdout"], first["replayed"]) == ("out\n", False)
    assert (again["exit_code"], again["replayed"], again["stdout"]) == (0, True, ""), "replayed: its output is not kept"
    assert run(api, running, "cat /tmp/count")["stdout"] == "ran\n"
    other = run(api, running, "echo ran >> /tmp/count", idempotency_key=f"{key}-2")
    assert other["replayed"] is False and run(api, running, "wc -l < /tmp/count")["stdout"].strip() == "2"


def test_an_exec_sent_again_while_it_runs_waits_for_the_same_run(api: httpx.Client, running: str) -> None:
    key = f"exec-{uuid.uuid4().hex}"
    cmd = "echo ran >> /tmp/once; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo done"
    results: list[dict] = []
    threads = [threading.Thread(target=lambda: results.append(run(api, running, cmd, idempotency_key=key))) for _ in range(2)]
    for thread in threads:
        thread.start()
    started(api, running, "/tmp/once")
    time.sleep(0.5)  # let the second exec arrive while the first runs
    run(api, running, "touch /tmp/go")
    for thread in threads:
        thread.join(30)
    assert len(results) == 2 and {result["exit_code"] for result in results} == {0}
    assert run(api, running, "cat /tmp/once")["stdout"] == "ran\n", "it ran twice"
    assert sorted(result["replayed"] for result in results) == [False, True]


def test_a_download_that_fails_midway_ends_with_an_error(api: httpx.Client, running: str) -> None:
    """The engine refuses a walk deeper than it will go; the download ends with an error, never hangs."""
    run(api, running, "d=/tmp/deep; for i in $(seq 300); do d=$d/d; done; mkdir -p $d")
    with httpx.Client(base_url=str(api.base_url), headers=api.headers, timeout=60) as client:
        try:
            with client.stream("GET", f"/api/v1/sandboxes/{running}/archive", params={"path": "/tmp/deep"}) as answer:
                if answer.status_code != 200:
                    assert answer.read() and answer.json()["error"]["code"] == "too_large", answer.text
                    return
                for _ in answer.iter_bytes():
                    pass
        except httpx.RemoteProtocolError:
            return  # ended mid-stream: the client knows it did not get the whole archive
    raise AssertionError("a download the engine could not finish ended as if it were whole")
