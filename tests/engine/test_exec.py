"""Exec through the engine: argv and shell forms, cwd, env, stdin, output caps, timeouts, streaming."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hashlib
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from sandboxes.engine import errors
from sandboxes.engine.client import AsyncEngineClient
from sandboxes.engine.protocol import encode_json
from tests.engine.engines import sandbox_processes, separate_engine, wait_for

pytestmark = pytest.mark.root


def test_shell_string_runs_in_sh(engine, sandbox):
    result = engine.exec(sandbox, "echo hello; echo oops >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr) == (3, b"hello\n", b"oops\n")
    assert not result.timed_out
    assert result.duration_ms > 0


def test_argv_list_is_not_interpreted_by_a_shell(engine, sandbox):
    result = engine.exec(sandbox, ["echo", "$HOME", "a;b", "*"])
    assert result.stdout == b"$HOME a;b *\n"


def test_cwd_and_env_are_applied(engine, sandbox):
    result = engine.exec(sandbox, "pwd; echo $GREETING; echo $PATH", cwd="/tmp", env={"GREETING": "hi there"})
    lines = result.stdout.decode().splitlines()
    assert lines[0] == "/tmp"
    assert lines[1] == "hi there"
    assert "/usr/bin" in lines[2]  # the template's PATH still applies


def test_create_env_is_seen_by_every_exec(engine):
    sandbox = engine.create(template="base", size="tiny", env={"ROLLOUT": "42"})["id"]
    try:
        assert engine.exec(sandbox, "echo $ROLLOUT").stdout == b"42\n"
        assert engine.exec(sandbox, "echo $ROLLOUT", env={"ROLLOUT": "7"}).stdout == b"7\n"
    finally:
        engine.destroy(sandbox)


def test_stdin_is_delivered_as_bytes(engine, sandbox):
    payload = bytes(range(256)) * 1000
    result = engine.exec(sandbox, "wc -c", stdin=payload)
    assert result.stdout.strip() == str(len(payload)).encode()
    assert engine.exec(sandbox, ["cat"], stdin=b"line one\nline two\n").stdout == b"line one\nline two\n"


def test_missing_program_is_exit_127_not_an_error(engine, sandbox):
    result = engine.exec(sandbox, ["/no/such/program"])
    assert result.exit_code == 127
    assert b"No such file or directory" in result.stderr
    assert engine.exec(sandbox, ["definitely-not-installed"]).exit_code == 127


def test_missing_cwd_is_reported_in_the_result(engine, sandbox):
    result = engine.exec(sandbox, ["pwd"], cwd="/nowhere")
    assert result.exit_code == 127
    assert b"/nowhere" in result.stderr


def test_timeout_kills_the_whole_process_tree_and_is_a_result(engine, sandbox):
    result = engine.exec(sandbox, "sleep 1000 & sleep 1000 & while :; do :; done", timeout_s=0.5)
    assert result.timed_out
    assert result.signal == 9
    # Killed when the result comes; init reaps them as it gets to it (a killed child stays listed until then).
    deadline = time.monotonic() + 10
    while (survivors := engine.exec(sandbox, "ps -o comm | grep -c sleep || true").stdout.strip()) != b"0":
        assert time.monotonic() < deadline, f"the command's background children outlived its timeout: {survivors!r}"
        time.sleep(0.05)


def test_background_service_started_with_setsid_outlives_the_exec(engine, sandbox):
    result = engine.exec(sandbox, "setsid sleep 300 >/dev/null 2>&1 < /dev/null & echo started")
    assert result.stdout == b"started\n"
    assert engine.exec(sandbox, "ps -o args | grep -c '[s]leep 300'").stdout.strip() == b"1"


def test_exec_returns_when_the_command_exits_even_if_a_child_holds_the_pipes(engine, sandbox):
    result = engine.exec(sandbox, "sleep 631 & echo done", timeout_s=600)
    assert result.stdout == b"done\n"
    assert not result.timed_out
    # Returned while the child still runs (and holds the pipes): it did not wait for it.
    assert "sleep 631" in sandbox_processes(sandbox).values()


def test_output_floods_are_capped_and_reported(engine, sandbox):
    result = engine.exec(sandbox, "head -c 5000000 /dev/zero; head -c 10 /dev/zero >&2", max_output_bytes=100_000)
    assert len(result.stdout) == 100_000
    assert result.stdout_truncated
    assert result.extra["stdout_bytes"] == 5_000_000
    assert not result.stderr_truncated and len(result.stderr) == 10


def test_binary_output_is_kept_exactly(engine, sandbox):
    result = engine.exec(sandbox, "printf '\\000\\377\\n\\001'")
    assert result.stdout == b"\x00\xff\n\x01"


def test_streaming_exec_delivers_output_as_it_comes(engine, sandbox):
    seen: list[tuple[str, bytes]] = []
    result = engine.exec_stream(
        sandbox, "for i in 1 2 3; do echo $i; sleep 0.1; done; echo err >&2", lambda stream, data: seen.append((stream, data))
    )
    assert result.exit_code == 0
    assert b"".join(data for stream, data in seen if stream == "stdout") == b"1\n2\n3\n"
    assert ("stderr", b"err\n") in seen
    assert len([1 for stream, _ in seen if stream == "stdout"]) >= 2, "output arrived in one piece, not streamed"


def test_many_concurrent_execs_in_one_sandbox(engine_process, sandbox):
    import concurrent.futures

    def run(index: int) -> bytes:
        with engine_process.client() as client:
            return client.exec(sandbox, f"echo {index}").stdout

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outputs = list(pool.map(run, range(64)))
    assert outputs == [f"{index}\n".encode() for index in range(64)]


@pytest.mark.parametrize(
    "options,field",
    [
        ({"cmd": 42}, "cmd"),
        ({"cmd": []}, "cmd"),
        ({"cmd": ["echo", 3]}, "cmd"),
        ({"cmd": ["echo\0x"]}, "cmd"),
        ({"cmd": ""}, "cmd"),
        ({"cmd": "true", "cwd": "relative"}, "cwd"),
        ({"cmd": "true", "env": {"A": 1}}, "env"),
        ({"cmd": "true", "env": {"A=B": "x"}}, "env"),
        ({"cmd": "true", "timeout_s": -1}, "timeout_s"),
        ({"cmd": "true", "timeout_s": "soon"}, "timeout_s"),
        ({"cmd": "true", "stdin": 5}, "stdin"),
    ],
)
def test_bad_exec_input_is_a_clear_error(engine, sandbox, options, field):
    with pytest.raises(errors.InvalidRequest) as raised:
        engine.call("exec", id=sandbox, **options)
    assert raised.value.details.get("field") == field


def test_exec_in_a_missing_sandbox(engine):
    with pytest.raises(errors.SandboxNotFound):
        engine.exec("sb-doesnotexist", "true")


def test_huge_argv_is_refused_not_truncated(engine, sandbox):
    with pytest.raises(errors.TooLarge):
        engine.exec(sandbox, ["echo", "x" * 300_000])


# --- large outputs: streamed, never held whole ----------------------------------------------------


def _peak_rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1])


def test_output_up_to_the_cap_arrives_whole_and_the_engine_stays_small(work_dir):
    """64 MiB is the documented cap; four such outputs at once must not grow the
    engine by anything like their size: output is passed on as it is read,
    paced by the caller, never gathered (VmHWM: the engine's peak resident size)."""
    output_bytes = 60_000_000
    with separate_engine(work_dir / f"output-{os.urandom(3).hex()}") as engine_process:
        with engine_process.client() as client:
            sandbox = client.create(template="base", size="tiny", ttl_s=600)["id"]
            result = client.exec(sandbox, f"head -c {output_bytes} /dev/zero", max_output_bytes=64 << 20, timeout_s=120)
            assert (result.exit_code, len(result.stdout), result.stdout_truncated) == (0, output_bytes, False)
            assert result.stdout.count(0) == output_bytes
            # call("exec") still answers with the output in the result (what the control plane reads).
            answer = client.call(
                "exec",
                id=sandbox,
                cmd="head -c 20000000 /dev/urandom | tee /tmp/sent; md5sum < /tmp/sent >&2; rm /tmp/sent",
                max_output_bytes=64 << 20,
                timeout_s=120,
            )
            assert len(base64.b64decode(answer["stdout_b64"])) == 20_000_000
            assert hashlib.md5(base64.b64decode(answer["stdout_b64"])).hexdigest().encode() in base64.b64decode(
                answer["stderr_b64"]
            )
        peak_before = _peak_rss_kib(engine_process.pid)

        def run_one(_: int) -> int:
            received = [0]
            with engine_process.client() as each:
                summary, _ = each.stream(
                    "exec",
                    {"id": sandbox, "cmd": f"head -c {output_bytes} /dev/zero", "max_output_bytes": 64 << 20, "timeout_s": 300},
                    on_data=lambda payload: received.__setitem__(0, received[0] + len(payload) - 1),
                )
            assert summary["exit_code"] == 0 and summary["stdout_bytes"] == output_bytes
            return received[0]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(run_one, range(4))) == [output_bytes] * 4
        grown_kib = _peak_rss_kib(engine_process.pid) - peak_before
        # Gathered, four outputs would need 240 MB at least (and their JSON
        # and base64 copies); streamed, a few 64 KiB chunks per exec.  One
        # output's size leaves room for the allocator and the interpreter.
        assert grown_kib * 1024 < output_bytes, f"the engine grew by {grown_kib} KiB for 4 x {output_bytes} bytes of output"
        with engine_process.client() as client:
            client.destroy(sandbox)


def test_the_async_client_puts_frames_back_into_the_result(engine_process, sandbox):
    async def run() -> dict:
        client = AsyncEngineClient(engine_process.config.socket_path)
        try:
            return await client.call(
                "exec", id=sandbox, cmd="head -c 17000000 /dev/zero; echo err >&2", max_output_bytes=64 << 20
            )
        finally:
            await client.close()

    answer = asyncio.run(run())
    assert len(base64.b64decode(answer["stdout_b64"])) == 17_000_000
    assert base64.b64decode(answer["stderr_b64"]) == b"err\n"


# --- a caller that goes away ends its command; a retried key does not run it again ---------------------------


def _send_exec(engine_process, args: dict) -> socket.socket:
    """An exec sent on a raw connection, which the test then drops (a killed web server, say)."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(str(engine_process.config.socket_path))
    connection.sendall(encode_json({"op": "exec", "args": args}))
    return connection


def test_closing_the_connection_ends_the_command_and_everything_it_started(engine_process, engine, sandbox):
    command = (
        "setsid sleep 611 </dev/null >/dev/null 2>&1 &"  # left its session
        " (setsid sleep 612 </dev/null >/dev/null 2>&1 &);"  # and was reparented to init
        " sleep 610"
    )
    connection = _send_exec(engine_process, {"id": sandbox, "cmd": command, "timeout_s": 600})
    started = wait_for(
        lambda: all(any(f"sleep {n}" == line for line in sandbox_processes(sandbox).values()) for n in (610, 611, 612)),
        "the command and its children to start",
    )
    assert started
    connection.close()
    wait_for(
        lambda: not [line for line in sandbox_processes(sandbox).values() if line.startswith("sleep 61")],
        "the command and everything it started to be killed",
    )
    assert engine.exec(sandbox, "echo still here").stdout == b"still here\n", "the sandbox itself lives on"


def test_a_service_the_command_started_outlives_a_command_that_ended_normally(engine, sandbox):
    engine.exec(sandbox, "setsid sleep 620 </dev/null >/dev/null 2>&1 & echo started")
    # The command may end before its background child has exec'd sleep: wait for the service to be there.
    wait_for(lambda: any(line == "sleep 620" for line in sandbox_processes(sandbox).values()), "the service to start")
    engine.exec(sandbox, "true")  # its command's cgroup is removed once empty, not before
    assert any(line == "sleep 620" for line in sandbox_processes(sandbox).values())


def test_an_exec_key_runs_the_command_once(engine_process, engine, sandbox):
    key = f"step-{os.urandom(4).hex()}"
    command = "echo run >> /tmp/runs; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo output; exit 3"
    results: dict[str, object] = {}

    def first() -> None:
        with engine_process.client() as client:
            results["first"] = client.exec(sandbox, command, key=key, timeout_s=120)

    def second() -> None:
        with engine_process.client() as client:
            results["second"] = client.exec(sandbox, command, key=key, timeout_s=120)

    runner = threading.Thread(target=first)
    runner.start()
    wait_for(lambda: engine.exec(sandbox, "cat /tmp/runs").stdout == b"run\n", "the first exec to start")
    waiter = threading.Thread(target=second)
    waiter.start()
    wait_for(lambda: engine.info()["exec_keys"]["waiting"] == 1, "the second exec to wait for the first")
    engine.exec(sandbox, "touch /tmp/go")
    runner.join(60)
    waiter.join(60)
    first_result, second_result = results["first"], results["second"]
    assert (first_result.exit_code, first_result.stdout, first_result.extra["replayed"]) == (3, b"output\n", False)
    # It waited for the first and got its result and output (spooled while the command ran).
    assert (second_result.exit_code, second_result.stdout, second_result.extra["replayed"]) == (3, b"output\n", True)
    assert second_result.duration_ms == first_result.duration_ms
    # Once it ended and both were answered, its output is gone: later retries get the status only.
    later = engine.exec(sandbox, command, key=key)
    assert (later.exit_code, later.stdout, later.extra["replayed"], later.duration_ms) == (3, b"", True, first_result.duration_ms)
    streamed = engine.exec_stream(sandbox, command, lambda *_: None, key=key)
    assert (streamed.exit_code, streamed.extra["replayed"]) == (3, True)
    assert engine.exec(sandbox, "cat /tmp/runs").stdout == b"run\n", "the command ran once"
    assert engine.exec(sandbox, "echo again >> /tmp/runs", key=key + "-other").extra["replayed"] is False
    with pytest.raises(errors.InvalidRequest):
        engine.exec(sandbox, "true", key="k" * 256)


def test_a_retry_of_a_command_whose_caller_left_gets_that_news(engine_process, engine, sandbox):
    key = f"left-{os.urandom(4).hex()}"
    command = "echo run >> /tmp/left-runs; sleep 600"
    connection = _send_exec(engine_process, {"id": sandbox, "cmd": command, "key": key, "timeout_s": 900})
    wait_for(lambda: any(line == "sleep 600" for line in sandbox_processes(sandbox).values()), "the command to start")
    connection.close()
    wait_for(lambda: not any(line == "sleep 600" for line in sandbox_processes(sandbox).values()), "the command to be killed")
    retried = wait_for(lambda: engine.exec(sandbox, command, key=key, timeout_s=5), "the retry")
    assert (retried.extra["replayed"], retried.extra["caller_left"], retried.signal) == (True, True, 9)
    assert engine.exec(sandbox, "cat /tmp/left-runs").stdout == b"run\n"
