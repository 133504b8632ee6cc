"""What an exec keeps for the sandbox's next one: its connection to init, its
exec cgroup; and what it must never hand on (a cancelled or timed-out command's
connection, an exec cgroup something has joined).  Asserted on the engine's
counters (``info``) and on what the kernel reports."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.engine.engines import cgroup_file, sandbox_processes, separate_engine, wait_for
from tests.engine.test_exec import _send_exec

pytestmark = pytest.mark.root


def _counts(client) -> tuple[dict[str, int], dict[str, int]]:
    info: dict[str, Any] = client.info()
    return info["init_connections"], info["counters"]


def _exec_cgroups(engine_process, sandbox: str) -> list[Path]:
    """The sandbox's exec cgroups (on cgroup v1, in the pids hierarchy: cgroups.py)."""
    directory = cgroup_file(engine_process, sandbox, "pids", "")
    return sorted(path for path in directory.iterdir() if path.is_dir() and path.name.startswith("x-"))


def _procs(directory: Path) -> list[int]:
    return [int(line) for line in (directory / "cgroup.procs").read_text().split()]


def test_execs_in_a_sandbox_share_one_init_connection_and_one_exec_cgroup(engine_process, engine, sandbox):
    connections, counters = _counts(engine)
    for index in range(5):
        assert engine.exec(sandbox, f"echo {index}").stdout == f"{index}\n".encode()
    after_connections, after = _counts(engine)
    assert after_connections["made"] - connections["made"] == 1
    assert after_connections["reused"] - connections["reused"] == 4
    assert after["exec_cgroups_made"] - counters["exec_cgroups_made"] == 1
    assert after["exec_cgroups_reused"] - counters["exec_cgroups_reused"] == 4
    kept = _exec_cgroups(engine_process, sandbox)
    assert len(kept) == 1 and _procs(kept[0]) == [], "one exec cgroup kept, and it is empty"


def test_a_timed_out_or_abandoned_command_leaves_no_connection_to_reuse(engine_process, engine, sandbox):
    engine.exec(sandbox, "true")  # leaves a connection kept for the sandbox
    connections, _ = _counts(engine)
    result = engine.exec(sandbox, "sleep 30", timeout_s=0.3)
    assert result.timed_out
    after, _ = _counts(engine)
    assert after["reused"] - connections["reused"] == 1, "it ran on the kept connection"
    assert after["idle"] == connections["idle"] - 1, "which was closed, not given back"

    engine.exec(sandbox, "true")
    connections, _ = _counts(engine)
    assert connections["made"] == after["made"] + 1, "nothing was kept: a new connection"
    caller = _send_exec(engine_process, {"id": sandbox, "cmd": "setsid sleep 641 </dev/null >/dev/null 2>&1 & sleep 640"})
    wait_for(lambda: {"sleep 640", "sleep 641"} <= set(sandbox_processes(sandbox).values()), "the command and its child to start")
    caller.close()
    wait_for(
        lambda: not [line for line in sandbox_processes(sandbox).values() if line.startswith("sleep 64")],
        "the command and what it started to be killed",
    )
    after, _ = _counts(engine)
    assert after["reused"] - connections["reused"] == 1
    assert after["idle"] == connections["idle"] - 1, "the abandoned command's connection was closed"
    assert engine.exec(sandbox, "echo still here").stdout == b"still here\n"
    assert _counts(engine)[0]["made"] == after["made"] + 1


def test_a_command_that_could_not_start_leaves_no_connection_to_reuse(engine, sandbox):
    """After 'F' init takes nothing more on that connection (native/init.c): it is closed."""
    engine.exec(sandbox, "true")
    connections, _ = _counts(engine)
    assert engine.exec(sandbox, ["/no/such/program"]).exit_code == 127
    after, _ = _counts(engine)
    assert after["reused"] - connections["reused"] == 1
    assert after["idle"] == connections["idle"] - 1
    assert engine.exec(sandbox, "echo next").stdout == b"next\n"
    assert _counts(engine)[0]["made"] == after["made"] + 1


def test_a_kept_exec_cgroup_that_something_joined_is_not_reused(engine_process, engine, sandbox):
    engine.exec(sandbox, "setsid sleep 650 </dev/null >/dev/null 2>&1 &")  # its cgroup holds the service: not kept
    sleeper = wait_for(
        lambda: next((pid for pid, line in sandbox_processes(sandbox).items() if line == "sleep 650"), None),
        "the service to start",
    )
    engine.exec(sandbox, "true")  # its cgroup ends empty: kept
    kept = [directory for directory in _exec_cgroups(engine_process, sandbox) if not _procs(directory)]
    assert len(kept) == 1
    (kept[0] / "cgroup.procs").write_text(str(sleeper))  # something joins it meanwhile (host root can)
    _, counters = _counts(engine)
    assert engine.exec(sandbox, "echo fresh").stdout == b"fresh\n"
    _, after = _counts(engine)
    assert after["exec_cgroups_reused"] == counters["exec_cgroups_reused"], "not handed to the next command"
    assert after["exec_cgroups_made"] == counters["exec_cgroups_made"] + 1
    assert _procs(kept[0]) == [sleeper], "what joined it is left alone, in its cgroup"


def test_a_sandbox_from_an_engine_without_kept_connections_gets_one_per_command(work_dir: Path):
    """A record without ``init_reuse`` (made by an older engine, whose init
    takes one command per connection) is adopted and never sent a second one."""
    with separate_engine(work_dir / f"reuse-{os.urandom(3).hex()}") as own:
        with own.client() as client:
            sandbox = client.create(template="base", size="tiny", ttl_s=600)["id"]
        own.kill()
        database = sqlite3.connect(own.config.database_path)
        (raw,) = database.execute("SELECT record FROM sandboxes WHERE id = ?", (sandbox,)).fetchone()
        record = json.loads(raw)
        assert record.pop("init_reuse") is True
        database.execute("UPDATE sandboxes SET record = ? WHERE id = ?", (json.dumps(record), sandbox))
        database.commit()
        database.close()
        own.start()
        with own.client() as client:
            connections, _ = _counts(client)
            for index in range(3):
                assert client.exec(sandbox, f"echo {index}").stdout == f"{index}\n".encode()
            after, _ = _counts(client)
            assert (after["made"] - connections["made"], after["reused"] - connections["reused"]) == (3, 0)
            assert after["idle"] == 0
            client.destroy(sandbox)
