"""The bookkeeping of background processes, without a sandbox: limits per sandbox and per host, and tails."""

from __future__ import annotations

import asyncio

import pytest

from sandboxes.engine import errors
from sandboxes.engine.processes import Process, Processes, Tail, parse_signal, parse_terminal


def _table(limit: int, host_limit: int) -> Processes:
    return Processes("/proc", lambda *_: None, lambda *_: None, lambda *_: [], limit=limit, host_limit=host_limit)


def _held(processes: Processes, sandbox: str, pid: int, running: bool) -> Process:
    """A record as ``start`` leaves one (no fds: nothing to close)."""
    process = Process(sandbox, ["true"], "/", None, 16)
    process.pid, process.state = pid, "running" if running else "exited"
    process.ended_at = None if running else float(pid)
    if not running:
        process.exited.set_result(None)
    processes.by_sandbox.setdefault(sandbox, {})[pid] = process
    processes.held += 1
    return process


def test_limits_per_sandbox_and_per_host_forget_the_oldest_exited_first():
    async def run() -> None:
        processes = _table(limit=3, host_limit=4)
        _held(processes, "a", 10, running=True)
        oldest = _held(processes, "a", 11, running=False)
        _held(processes, "a", 12, running=False)
        processes.make_room("a")  # at the sandbox's limit: its oldest exited one goes
        assert set(processes.by_sandbox["a"]) == {10, 12} and processes.count() == 2
        assert oldest not in processes.by_sandbox["a"].values()
        _held(processes, "b", 20, running=True)
        _held(processes, "b", 21, running=True)
        processes.make_room("a")  # 4 held (the host's limit): a's exited one goes
        assert set(processes.by_sandbox["a"]) == {10} and processes.count() == 3
        _held(processes, "a", 13, running=True)
        with pytest.raises(errors.TooManyProcesses) as refused:
            processes.make_room("b")  # b has none exited, and the host is full
        assert "this host" in refused.value.message and refused.value.status == 429
        processes.forget_sandbox("a")
        assert processes.count() == 2 and "a" not in processes.by_sandbox
        processes.make_room("b")  # room again

    asyncio.run(run())


def test_tail_offsets():
    tail = Tail(10)
    tail.add(b"0123456789")
    tail.add(b"abcde")
    assert (tail.total, tail.start) == (15, 5)
    assert tail.since(0) == (b"56789abcde", 5, 5)
    assert tail.since(12) == (b"cde", 12, 0)
    assert tail.since(99) == (b"", 15, 0)
    tail.add(b"x" * 25)
    assert tail.since(0) == (b"x" * 10, 30, 30)


def test_signals_and_terminals_are_checked():
    assert (parse_signal("term"), parse_signal("SIGKILL"), parse_signal(2)) == (15, 9, 2)
    for bad in ("NOPE", "TERM;", 0, 65, True, None, 1.5):
        with pytest.raises(errors.InvalidRequest):
            parse_signal(bad)
    assert parse_terminal({"rows": 5, "cols": 6}) == parse_terminal({"rows": 5, "cols": 6})
    for bad in ({"rows": 0}, {"rows": 5, "cols": 1001}, {"rows": "5"}, {"x": 1}, [24, 80]):
        with pytest.raises(errors.InvalidRequest):
            parse_terminal(bad)
