"""The durable record: quarantine of bad rows and of an unreadable database."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from sandboxes.engine.store import SandboxRecord, open_store


def _record(sandbox_id: str) -> SandboxRecord:
    return SandboxRecord(
        id=sandbox_id,
        state="running",
        template="base",
        layers=["sha256:x"],
        cpu=1,
        memory_mib=128,
        pids_max=256,
        disk_bytes=1,
        cgroup=f"fy-{sandbox_id}",
        cgroup_dirs=[],
        socket_path="/x",
    )


def test_round_trip_and_quarantine_of_a_corrupted_row(tmp_path: Path):
    path = tmp_path / "engine.sqlite3"
    store = open_store(path)
    store.put_sandbox(_record("sb-good"))
    store.put_sandbox(_record("sb-bad"))
    store.close()
    database = sqlite3.connect(path)
    database.execute('UPDATE sandboxes SET record = \'{"id": "sb-bad", "state": "flying"\' WHERE id = \'sb-bad\'')
    database.commit()
    database.close()
    store = open_store(path)
    assert [record.id for record in store.sandboxes()] == ["sb-good"]
    assert [(item["kind"], item["key"]) for item in store.quarantined()] == [("sandbox", "sb-bad")]
    assert [record.id for record in store.sandboxes()] == ["sb-good"]  # quarantined once, gone after


def test_a_record_with_an_unknown_state_is_quarantined(tmp_path: Path):
    store = open_store(tmp_path / "engine.sqlite3")
    record = _record("sb-odd")
    record.state = "flying"
    store.put_sandbox(record)
    assert list(store.sandboxes()) == []
    assert store.quarantined()[0]["reason"] == "unknown state 'flying'"


def test_unreadable_database_is_moved_aside(tmp_path: Path):
    path = tmp_path / "engine.sqlite3"
    path.write_bytes(b"garbage" * 1000)
    store = open_store(path)
    assert list(store.sandboxes()) == []
    assert store.quarantined()[0]["kind"] == "database"
    assert list(tmp_path.glob("engine.sqlite3.corrupt-*"))


def test_a_record_is_written_exactly_as_asdict_would_write_it():
    import json
    from dataclasses import asdict

    record = _record("sb-json")
    record.env, record.labels, record.cgroup_dirs = {"PATH": "/bin", "é": "ü"}, {"team": "a"}, ["/sys/fs/cgroup/x"]
    assert record.to_json() == json.dumps(asdict(record), separators=(",", ":"))
    assert SandboxRecord.from_json(record.to_json()) == record
