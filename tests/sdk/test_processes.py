"""Background processes through the SDK (sync and async alike), and commands that end with their caller:
a stream closed, or the task reading it cancelled, kills the command and what it started with setsid."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from forkyard import AsyncClient, Client, NotFound, RateLimited, Sandbox, UnknownOption
from tests.api.test_processes import engine_id, gone, host_pids
from tests.engine.engines import wait_for

pytestmark = pytest.mark.root

SETSID_COMMAND = (
    "setsid sleep {n}1 </dev/null >/dev/null 2>&1 & (setsid sleep {n}2 </dev/null >/dev/null 2>&1 &); echo started; sleep {n}0"
)


def test_a_background_process_is_listed_read_signalled_and_reaped(sb: Sandbox) -> None:
    process = sb.processes.start("trap 'echo bye; exit 3' TERM; echo one; read line; echo got $line; while :; do sleep 0.1; done")
    assert process.running and process.pid > 1
    assert [item.pid for item in sb.processes.list()] == [process.pid]
    wait_for(lambda: process.refresh().stdout_bytes >= 4, "its first line")
    assert process.output().stdout.data == "one\n"
    assert process.output().stdout.data == "", "each byte is handed out once"
    assert process.write("two\n") == 4
    wait_for(lambda: process.refresh().stdout_bytes >= 12, "its answer")
    assert process.output().stdout.data == "got two\n"
    assert process.wait(timeout_s=0.2).running, "a bounded wait returns it still running"
    process.signal("TERM")
    ended = process.wait(timeout_s=60)
    assert (ended.state, ended.exit_code, ended.exit_signal) == ("exited", 3, None)
    assert process.output().stdout.data == "bye\n", "what came with its exit"
    with pytest.raises(NotFound) as reaped:
        sb.processes.get(process.pid)
    assert reaped.value.code == "process_not_found"
    assert sb.processes.list() == []


def test_a_terminal_through_the_sdk(sb: Sandbox) -> None:
    shell = sb.processes.start("/bin/sh", pty={"rows": 20, "cols": 70}, output="base64")
    assert shell.pty == {"rows": 20, "cols": 70}
    shell.write(b"stty size\n")
    seen = b""

    def read() -> bytes:
        nonlocal seen
        seen += shell.output().stdout.bytes
        return seen

    wait_for(lambda: b"20 70" in read(), "its size")
    shell.resize(33, 99)
    shell.write("stty size\n")
    wait_for(lambda: b"33 99" in read(), "its new size")
    shell.kill()
    assert shell.wait(timeout_s=60).exit_signal == 9


def test_options_are_checked_and_the_cap_is_not_retried(fy: Client, sb: Sandbox) -> None:
    with pytest.raises(UnknownOption):
        sb.processes.start("true", tiemout=1)  # type: ignore[call-arg]
    for _ in range(32):
        sb.processes.start("sleep 600")
    with pytest.raises(RateLimited) as over:
        sb.processes.start("sleep 600")
    assert over.value.code == "too_many_processes"


def test_async_processes(stack: Any, sb: Sandbox) -> None:
    async def run() -> None:
        async with AsyncClient(stack.url, stack.teams[0].key) as fy:
            sandbox = fy.sandboxes.ref(sb.id)
            process = await sandbox.processes.start(["sh", "-c", "echo out; echo err >&2; exit 4"])
            ended = await process.wait(timeout_s=60)
            assert (ended.state, ended.exit_code) == ("exited", 4)
            output = await process.output()
            assert (output.stdout.data, output.stderr.data) == ("out\n", "err\n")
            sleeper = await sandbox.processes.start("sleep 600")
            assert [item.pid for item in await sandbox.processes.list()] == [sleeper.pid]
            await sleeper.signal("KILL")
            assert (await sleeper.wait(timeout_s=60)).exit_signal == 9
            with pytest.raises(NotFound):
                await sandbox.processes.get(sleeper.pid)

    asyncio.run(run())


def test_closing_a_stream_ends_its_command_and_its_setsid_descendants(stack: Any, sb: Sandbox) -> None:
    inner = engine_id(stack, sb.id)
    stream = sb.exec_stream(SETSID_COMMAND.format(n=72), timeout_s=600)
    chunks = iter(stream)
    assert next(chunks).data == "started\n"
    alive = wait_for(lambda: len(host_pids(inner, "sleep 72")) == 3 and host_pids(inner, "sleep 72"), "all three sleeps")
    stream.close()
    wait_for(lambda: all(gone(pid, line) for pid, line in alive.items()), "the command and its setsid descendants to die")


def test_cancelling_the_task_that_streams_ends_its_command(stack: Any, sb: Sandbox) -> None:
    inner = engine_id(stack, sb.id)

    async def run() -> dict[int, str]:
        async with AsyncClient(stack.url, stack.teams[0].key) as fy:
            sandbox = fy.sandboxes.ref(sb.id)
            started = asyncio.Event()

            async def follow() -> None:
                async for chunk in sandbox.exec_stream(SETSID_COMMAND.format(n=73), timeout_s=600):
                    if chunk.data == "started\n":
                        started.set()

            task = asyncio.create_task(follow())
            await asyncio.wait_for(started.wait(), 60)
            alive = await asyncio.to_thread(
                wait_for, lambda: len(host_pids(inner, "sleep 73")) == 3 and host_pids(inner, "sleep 73"), "all three sleeps"
            )
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return alive

    alive = asyncio.run(run())
    wait_for(lambda: all(gone(pid, line) for pid, line in alive.items()), "the command and its setsid descendants to die")


def test_the_cli_starts_lists_reads_signals_and_waits(cli: Any, sb: Sandbox) -> None:
    started = cli("processes", "start", sb.id, "--", "trap 'echo stopping; exit 5' TERM; echo up; while :; do sleep 0.1; done")
    assert started.returncode == 0, started.stderr
    pid = started.stdout.strip()
    assert pid.isdigit()
    listed = cli("processes", "list", sb.id)
    assert pid in listed.stdout and "running" in listed.stdout, listed.stdout
    wait_for(lambda: cli("processes", "logs", sb.id, pid).stdout == "up\n", "its first line")
    assert cli("processes", "signal", sb.id, pid, "--signal", "TERM").returncode == 0
    waited = cli("processes", "wait", sb.id, pid, "--timeout", "60")
    assert (waited.returncode, waited.stdout) == (5, "up\nstopping\n"), waited.stderr
    gone_now = cli("processes", "logs", sb.id, pid)
    assert gone_now.returncode == 1 and "process_not_found" in gone_now.stderr
    bad = cli("processes", "start", "--pty", "tall", sb.id, "--", "true")
    assert bad.returncode == 1 and "ROWSxCOLS" in bad.stderr
    missing = cli("processes", "start", sb.id, "--", "/no/such/program", "x")
    assert missing.returncode == 127 and "/no/such/program" in missing.stderr, missing
