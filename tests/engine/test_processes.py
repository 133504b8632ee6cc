"""Background processes through the engine: started, listed, read, signalled, waited, reaped; terminals; limits."""

from __future__ import annotations

import base64
import signal
import socket
from pathlib import Path

import pytest

from sandboxes.engine import errors
from sandboxes.engine.cgroups import detect
from sandboxes.engine.processes import BUFFER_BYTES, MAX_PER_SANDBOX
from sandboxes.engine.protocol import decode_json, encode_json, read_frame_sync
from tests.engine.engines import sandbox_processes, wait_for

pytestmark = pytest.mark.root


def output(answer: dict, stream: str = "stdout") -> bytes:
    return base64.b64decode(answer[stream]["data_b64"])


def start(engine, sandbox: str, cmd, **args) -> dict:
    return engine.call("processes.start", id=sandbox, cmd=cmd, **args)


def test_a_background_process_is_listed_read_signalled_waited_and_reaped(engine, sandbox):
    process = start(
        engine, sandbox, "echo $$ > /tmp/bg.pid; echo ready; trap 'echo got term; exit 7' TERM; while :; do sleep 0.1; done"
    )
    pid = process["pid"]
    assert process["state"] == "running" and pid > 1
    assert [item["pid"] for item in engine.call("processes.list", id=sandbox)["processes"]] == [pid]
    ready = wait_for(lambda: output(engine.call("processes.get", id=sandbox, pid=pid)) == b"ready\n", "its first line")
    assert ready
    assert engine.exec(sandbox, "cat /tmp/bg.pid").stdout.strip() == str(pid).encode(), "its pid inside the sandbox"
    still = engine.call("processes.wait", id=sandbox, pid=pid, timeout_s=0.2)
    assert still["state"] == "running", "a bounded wait returns its state"
    engine.call("processes.signal", id=sandbox, pid=pid, signal="TERM")
    ended = engine.call("processes.wait", id=sandbox, pid=pid, timeout_s=30, stdout_offset=6)
    assert (ended["state"], ended["exit_code"], output(ended)) == ("exited", 7, b"got term\n")
    assert ended["stdout"]["offset"] == 6 and ended["stdout"]["total_bytes"] == 15
    with pytest.raises(errors.NotFound) as reaped:
        engine.call("processes.get", id=sandbox, pid=pid)
    assert reaped.value.code == "process_not_found"
    assert engine.call("processes.list", id=sandbox)["processes"] == []
    assert not any("sleep 0.1" in line for line in sandbox_processes(sandbox).values())


def test_kill_by_group_reaches_its_children(engine, sandbox):
    process = start(engine, sandbox, "sleep 630 & sleep 631; wait")
    wait_for(lambda: {"sleep 630", "sleep 631"} <= set(sandbox_processes(sandbox).values()), "both sleeps")
    engine.call("processes.signal", id=sandbox, pid=process["pid"], signal="KILL", group=True)
    ended = engine.call("processes.wait", id=sandbox, pid=process["pid"], timeout_s=30)
    assert (ended["state"], ended["signal"]) == ("exited", signal.SIGKILL)
    wait_for(lambda: not [line for line in sandbox_processes(sandbox).values() if line.startswith("sleep 63")], "its group gone")


def test_signals_to_an_ended_process_and_bad_signals_are_refused(engine, sandbox):
    process = start(engine, sandbox, "exit 3")
    wait_for(lambda: engine.call("processes.get", id=sandbox, pid=process["pid"])["state"] == "exited", "it to exit")
    with pytest.raises(errors.Conflict) as ended:
        engine.call("processes.signal", id=sandbox, pid=process["pid"], signal="TERM")
    assert ended.value.code == "process_not_running"
    for bad in ("NOPE", 0, 99, True, "TERM;"):
        with pytest.raises(errors.InvalidRequest):
            engine.call("processes.signal", id=sandbox, pid=process["pid"], signal=bad)
    with pytest.raises(errors.InvalidRequest):
        engine.call("processes.get", id=sandbox, pid="1")
    with pytest.raises(errors.NotFound):
        engine.call("processes.get", id=sandbox, pid=1), "init is not one of its processes"


def test_a_program_that_cannot_start_is_an_exited_process(engine, sandbox):
    process = start(engine, sandbox, ["/no/such/program"])
    assert (process["state"], process["exit_code"]) == ("exited", 127)
    assert b"/no/such/program" in output(process, "stderr")


def test_a_flood_keeps_the_tail_and_counts_what_was_dropped(engine, sandbox):
    size = 8 * BUFFER_BYTES
    process = start(engine, sandbox, f"head -c {size} /dev/zero | tr '\\0' a; echo END")
    ended = engine.call("processes.wait", id=sandbox, pid=process["pid"], timeout_s=60)
    assert ended["exit_code"] == 0
    stdout = ended["stdout"]
    assert stdout["total_bytes"] == size + 4
    assert stdout["dropped_bytes"] == size + 4 - BUFFER_BYTES, "only the tail is kept"
    assert stdout["missed_bytes"] == stdout["dropped_bytes"] and stdout["offset"] == stdout["dropped_bytes"]
    data = output(ended)
    assert len(data) == BUFFER_BYTES and data.endswith(b"aaaaEND\n")


def test_input_goes_to_stdin_and_eof_closes_it(engine, sandbox):
    process = start(engine, sandbox, "tr a-z A-Z")
    answer = engine.call(
        "processes.input", id=sandbox, pid=process["pid"], data_b64=base64.b64encode(b"hello\n").decode(), eof=True
    )
    assert answer["written"] == 6
    ended = engine.call("processes.wait", id=sandbox, pid=process["pid"], timeout_s=30)
    assert (ended["exit_code"], output(ended)) == (0, b"HELLO\n")


def test_a_terminal_takes_input_resizes_and_is_the_controlling_terminal(engine, sandbox):
    process = start(engine, sandbox, "/bin/sh", pty={"rows": 30, "cols": 100})
    pid = process["pid"]
    assert process["pty"] == {"rows": 30, "cols": 100}

    def send(text: str) -> None:
        engine.call("processes.input", id=sandbox, pid=pid, data_b64=base64.b64encode(text.encode()).decode())

    send("stty size; tty; echo pgrp=$(ps -o pgid= -p $$ 2>/dev/null || cat /proc/$$/stat | cut -d' ' -f8)\n")
    seen = wait_for(lambda: b"30 100" in output(engine.call("processes.get", id=sandbox, pid=pid)), "stty size")
    assert seen
    # tty's line comes after stty's: on a busy machine it may not have been read yet.
    wait_for(lambda: b"/dev/pts/" in output(engine.call("processes.get", id=sandbox, pid=pid)), "tty's answer")
    screen = output(engine.call("processes.get", id=sandbox, pid=pid))
    assert b"/dev/pts/" in screen, screen
    engine.call("processes.resize", id=sandbox, pid=pid, rows=40, cols=120)
    send("stty size\n")
    wait_for(lambda: b"40 120" in output(engine.call("processes.get", id=sandbox, pid=pid)), "the new size")
    # ^C reaches the foreground job through the terminal: it is the shell's controlling terminal.
    send("sleep 640\n")
    wait_for(lambda: "sleep 640" in sandbox_processes(sandbox).values(), "the sleep")
    send("\x03")
    wait_for(lambda: "sleep 640" not in sandbox_processes(sandbox).values(), "^C to end the sleep")
    send("echo still-here\n")
    wait_for(lambda: b"still-here\r\n" in output(engine.call("processes.get", id=sandbox, pid=pid)), "the shell to live on")
    send("exit 5\n")
    ended = engine.call("processes.wait", id=sandbox, pid=pid, timeout_s=30)
    assert ended["exit_code"] == 5
    with pytest.raises(errors.InvalidRequest):
        start(engine, sandbox, "true", pty={"rows": 0, "cols": 80})
    with pytest.raises(errors.InvalidRequest):
        start(engine, sandbox, "true", pty={"rows": 10, "cols": 10, "x": 1})


def test_resize_without_a_terminal_is_refused(engine, sandbox):
    process = start(engine, sandbox, "sleep 600")
    with pytest.raises(errors.InvalidRequest):
        engine.call("processes.resize", id=sandbox, pid=process["pid"], rows=10, cols=10)
    engine.call("processes.signal", id=sandbox, pid=process["pid"], signal="KILL")


def test_a_timeout_kills_everything_it_started(engine, sandbox):
    process = start(engine, sandbox, "setsid sleep 650 </dev/null >/dev/null 2>&1 & sleep 651", timeout_s=1)
    ended = engine.call("processes.wait", id=sandbox, pid=process["pid"], timeout_s=60)
    assert (ended["timed_out"], ended["signal"]) == (True, signal.SIGKILL)
    wait_for(lambda: not [line for line in sandbox_processes(sandbox).values() if line.startswith("sleep 65")], "all of it gone")


def test_the_number_per_sandbox_is_capped_and_exited_ones_make_room(engine, sandbox):
    pids = [start(engine, sandbox, "sleep 600")["pid"] for _ in range(MAX_PER_SANDBOX)]
    with pytest.raises(errors.EngineError) as refused:
        start(engine, sandbox, "sleep 600")
    assert (refused.value.code, refused.value.status) == ("too_many_processes", 429)
    engine.call("processes.signal", id=sandbox, pid=pids[0], signal="KILL")
    wait_for(lambda: engine.call("processes.get", id=sandbox, pid=pids[0])["state"] == "exited", "it to exit")
    newer = start(engine, sandbox, "true")  # the exited one, never waited, is forgotten to make room
    assert newer["state"] == "running" or newer["exit_code"] == 0
    listed = {item["pid"] for item in engine.call("processes.list", id=sandbox)["processes"]}
    assert pids[0] not in listed and newer["pid"] in listed


def test_processes_go_with_their_sandbox_and_are_its_own(engine):
    first = engine.create(template="base", size="tiny")["id"]
    second = engine.create(template="base", size="tiny")["id"]
    try:
        pid = start(engine, first, "sleep 600")["pid"]
        with pytest.raises(errors.NotFound):
            engine.call("processes.get", id=second, pid=pid)
        assert engine.call("processes.list", id=second)["processes"] == []
        held = engine.info()["processes"]
    finally:
        engine.destroy(second)
    engine.destroy(first)
    assert engine.info()["processes"] == held - 1, "its record went with the sandbox"
    with pytest.raises((errors.NotFound, errors.SandboxNotRunning)):
        engine.call("processes.get", id=first, pid=pid)


def test_a_destroy_removes_every_cgroup_of_its_sandbox_exec_cgroups_included(engine_process, engine):
    """A destroy removes each cgroup directory at once when the kernel lets it; one the kernel refuses
    (an exec cgroup below it) is walked and emptied first. Either way nothing is left in any hierarchy."""
    sandbox = engine.create(template="base", size="tiny")["id"]
    start(engine, sandbox, "sleep 600")
    start(engine, sandbox, "setsid sh -c 'sleep 600 & sleep 600'")
    directories = detect(engine_process.config).directories(f"fy-{sandbox}")
    below = [child for directory in directories for child in directory.iterdir() if child.is_dir()]
    assert below, "each background process runs in an exec cgroup below its sandbox's"
    engine.destroy(sandbox)
    assert [directory for directory in [*directories, *below] if directory.exists()] == []


def test_attach_streams_output_and_ending_it_leaves_the_process(engine_process, engine, sandbox):
    process = start(engine, sandbox, "echo one; read line; echo got $line; sleep 600")
    pid = process["pid"]
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(str(engine_process.config.socket_path))
    connection.sendall(encode_json({"op": "processes.attach", "args": {"id": sandbox, "pid": pid}}))
    engine.call("processes.input", id=sandbox, pid=pid, data_b64=base64.b64encode(b"two\n").decode())
    seen = b""
    while b"got two\n" not in seen:
        _, payload = read_frame_sync(connection)
        message = decode_json(payload)
        assert message.get("event") == "output", message
        seen += base64.b64decode(message["data_b64"])
    assert seen == b"one\ngot two\n"
    connection.close()
    assert engine.call("processes.get", id=sandbox, pid=pid)["state"] == "running", "a reader leaving ends nothing"
    engine.call("processes.signal", id=sandbox, pid=pid, signal="KILL", group=True)


def test_nothing_of_them_is_left_in_the_engine(engine):
    """Pipes, terminals, pidfds and init connections: every fd a process held is closed once it is reaped,
    and once its sandbox is gone (counted in the engine's own /proc/<pid>/fd)."""
    engine_fds = Path(f"/proc/{engine.ping()['pid']}/fd")
    sandbox = engine.create(template="base", size="tiny")["id"]
    baseline = len(list(engine_fds.iterdir()))
    try:
        waited = [start(engine, sandbox, "echo hi") for _ in range(4)]
        for process in waited:
            engine.call("processes.wait", id=sandbox, pid=process["pid"], timeout_s=30)
        wait_for(lambda: len(list(engine_fds.iterdir())) <= baseline, "the reaped processes' fds to close")
        for _ in range(3):
            start(engine, sandbox, "sleep 600")
            start(engine, sandbox, "sh", pty={"rows": 5, "cols": 5})
        assert len(list(engine_fds.iterdir())) > baseline
    finally:
        engine.destroy(sandbox)
    wait_for(lambda: len(list(engine_fds.iterdir())) <= baseline, "the gone sandbox's processes' fds to close")
