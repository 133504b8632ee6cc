"""Exec through the engine: argv and shell forms, cwd, env, stdin, output caps, timeouts, streaming."""

from __future__ import annotations

import pytest

from sandboxes.engine import errors

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
    assert result.duration_ms < 3000
    survivors = engine.exec(sandbox, "ps -o comm | grep -c sleep || true").stdout.strip()
    assert survivors == b"0", "the command's background children outlived its timeout"


def test_background_service_started_with_setsid_outlives_the_exec(engine, sandbox):
    result = engine.exec(sandbox, "setsid sleep 300 >/dev/null 2>&1 < /dev/null & echo started")
    assert result.stdout == b"started\n"
    assert engine.exec(sandbox, "ps -o args | grep -c '[s]leep 300'").stdout.strip() == b"1"


def test_exec_returns_when_the_command_exits_even_if_a_child_holds_the_pipes(engine, sandbox):
    result = engine.exec(sandbox, "sleep 30 & echo done", timeout_s=10)
    assert result.stdout == b"done\n"
    assert result.duration_ms < 5000
    assert not result.timed_out


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
