"""The engine's durable record of what it owns: SQLite in its state directory.

WAL mode with ``synchronous=NORMAL``: a commit survives the engine being
killed at any instant (the fault we design for).  A power loss may drop the
last commits, which costs nothing: every sandbox died with the power, and
recovery removes whatever the kernel or the disk still holds.

Each row is validated when loaded.  A row that does not parse (a corrupted or
half-written record) moves to the ``quarantine`` table with the reason; the
other rows load as usual.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
PRIVATE_FILE = 0o600

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    record TEXT NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes (state);
CREATE TABLE IF NOT EXISTS idempotency_keys (
    key TEXT PRIMARY KEY,
    sandbox_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS templates (
    name TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS layers (
    id TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS quarantine (
    rowid INTEGER PRIMARY KEY,
    kind TEXT NOT NULL,
    key TEXT NOT NULL,
    raw TEXT,
    reason TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""

STATES = ("creating", "running", "paused", "stopped", "destroying", "destroyed")
LIVE_STATES = ("creating", "running", "paused", "destroying")


@dataclass
class SandboxRecord:
    id: str
    state: str
    template: str
    layers: list[str]
    cpu: float
    memory_mib: int
    pids_max: int
    disk_bytes: int
    cgroup: str
    cgroup_dirs: list[str]
    socket_path: str
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    created_at: float = 0.0
    expires_at: float = 0.0
    ready_at: float = 0.0
    pid: int = 0
    start_time: int = 0
    size: str = ""
    reason: str = ""
    ended_at: float = 0.0
    paused_at: float = 0.0
    pool: str = ""  # "template/size" while waiting in a warm pool, "" once claimed
    key: str = ""  # the caller's idempotency key, if any
    # Its init runs each command in a cgroup of its own (native/init.c's fourth
    # fd); sandboxes an older engine made do not, and are not sent one.
    exec_cgroups: bool = False
    # Its init takes another command on a connection after answering 'W'
    # (native/init.c), so the engine keeps connections to it between commands;
    # an older engine's init takes one command per connection.
    init_reuse: bool = False
    # Its init starts a file writer on request (native/files.c), which makes the
    # file API's changes as a process of the sandbox; for sandboxes an older
    # engine made, the engine makes them itself.
    init_files: bool = False
    # Root inside is this host uid, the first of the sandbox's own range
    # (uid_ranges.py); 0 for a sandbox an older engine made, whose root is
    # uid_base, the layers' range.
    root_uid: int = 0
    # Whom its commands run as when an exec names no user: its template's
    # default user (users.py), "" for root.
    user: str = ""
    # Destroyed after this many seconds without an exec or a file call (0: never);
    # the clock restarts at every call, and at an engine start (an adopted
    # sandbox's last call is not recorded: a restart counts as one).
    idle_timeout_s: int = 0
    # Its network (network.py), for a sandbox with a policy: slot, interface,
    # addresses and the egress rules applied; {} for loopback only.
    network: dict[str, Any] = field(default_factory=dict)
    # Its disk's btrfs subvolume (disks.py), whose quota group counts what it holds; 0: a tmpfs of its own.
    disk_volume: int = 0

    @classmethod
    def from_json(cls, raw: str) -> SandboxRecord:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("record is not an object")
        record = cls(**data)
        if record.state not in STATES:
            raise ValueError(f"unknown state {record.state!r}")
        if not isinstance(record.layers, list) or not all(isinstance(layer, str) for layer in record.layers):
            raise ValueError("layers is not a list of strings")
        if not isinstance(record.pid, int) or not isinstance(record.cgroup_dirs, list):
            raise ValueError("pid or cgroup_dirs has the wrong type")
        return record

    def to_json(self) -> str:
        # What asdict() gives, without its deep copy (a create writes the
        # record twice; asdict was most of the engine's own time in one).
        return json.dumps({name: getattr(self, name) for name in _SANDBOX_FIELDS}, separators=(",", ":"))

    def public(self) -> dict[str, Any]:
        """What the engine's API shows of a sandbox."""
        return {
            "id": self.id,
            "state": self.state,
            "template": self.template,
            "size": self.size or None,
            "cpu": self.cpu,
            "memory_mib": self.memory_mib,
            "labels": self.labels,
            "created_at": self.created_at,
            "ready_at": self.ready_at or None,
            "expires_at": self.expires_at,
            "ended_at": self.ended_at or None,
            "reason": self.reason or None,
            "key": self.key or None,
            "idle_timeout_s": self.idle_timeout_s,
            "network": {key: self.network.get(key) for key in ("address", "egress", "group")} if self.network else None,
            # The memory group it shares a memory cgroup with (cgroups.py), if any.
            "memory_group": self.cgroup.rpartition("/")[0].removeprefix("mg-") or None,
        }


_SANDBOX_FIELDS = tuple(item.name for item in fields(SandboxRecord))


@dataclass
class TemplateRecord:
    name: str
    layers: list[str]
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    source: str = ""
    size_bytes: int = 0  # a template: all of it; a snapshot: its own new layer (what saved state bills)
    created_at: float = 0.0
    # Snapshots (a snapshot is a template whose top layer came out of a sandbox):
    kind: str = "template"  # or "snapshot"
    parent: str = ""  # the template or snapshot it was taken from
    services: list[dict[str, Any]] = field(default_factory=list)
    total_bytes: int = 0  # every layer below it too
    files: int = 0  # entries in its own layer
    paused_ms: float = 0.0  # how long the sandbox was frozen for it
    user: str = ""  # whom an exec that names no user runs as (a name or uid of its /etc/passwd); "" for root

    @classmethod
    def from_json(cls, raw: str) -> TemplateRecord:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("record is not an object")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


class Store:
    """Thread-safe: the engine's event loop and its worker threads share it."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        # Root's alone (it holds every sandbox's env): made 0600 before SQLite
        # opens it, which then gives its -wal and -shm files the same mode.
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE))
        os.chmod(path, PRIVATE_FILE)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(SCHEMA)
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _execute(self, sql: str, parameters: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, parameters).fetchall()

    # --- sandboxes --------------------------------------------------------

    def put_sandbox(self, record: SandboxRecord) -> None:
        self._execute(
            "INSERT INTO sandboxes (id, state, record, updated_at) VALUES (?, ?, ?, ?) "
            "ON CONFLICT(id) DO UPDATE SET state=excluded.state, record=excluded.record, updated_at=excluded.updated_at",
            (record.id, record.state, record.to_json(), time.time()),
        )

    def put_sandboxes(self, records: list[SandboxRecord]) -> None:
        """Many records in one transaction (a policy changed under a thousand sandboxes: one commit, not a
        thousand)."""
        rows = [(record.id, record.state, record.to_json(), time.time()) for record in records]
        with self._lock:
            self._db.execute("BEGIN")  # the connection commits each statement on its own otherwise
            try:
                self._db.executemany(
                    "INSERT INTO sandboxes (id, state, record, updated_at) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT(id) DO UPDATE SET state=excluded.state, record=excluded.record, updated_at=excluded.updated_at",
                    rows,
                )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def delete_sandbox(self, sandbox_id: str) -> None:
        self._execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))

    def sandboxes(self) -> Iterator[SandboxRecord]:
        """Every valid record; invalid ones are quarantined on the way."""
        for sandbox_id, raw in self._execute("SELECT id, record FROM sandboxes ORDER BY id"):
            try:
                record = SandboxRecord.from_json(raw)
                if record.id != sandbox_id:
                    raise ValueError("record id does not match its key")
            except (ValueError, TypeError) as error:
                self.quarantine("sandbox", sandbox_id, raw, str(error))
                self.delete_sandbox(sandbox_id)
                continue
            yield record

    def sandboxes_by_id(self, ids: list[str]) -> Iterator[SandboxRecord]:
        for sandbox_id in ids:
            for _, raw in self._execute("SELECT id, record FROM sandboxes WHERE id = ?", (sandbox_id,)):
                try:
                    yield SandboxRecord.from_json(raw)
                except (ValueError, TypeError) as error:
                    self.quarantine("sandbox", sandbox_id, raw, str(error))
                    self.delete_sandbox(sandbox_id)

    def purge_tombstones(self, older_than: float) -> int:
        with self._lock:
            cursor = self._db.execute("DELETE FROM sandboxes WHERE state = 'destroyed' AND updated_at < ?", (older_than,))
            self._db.execute("DELETE FROM idempotency_keys WHERE sandbox_id NOT IN (SELECT id FROM sandboxes)")
            return cursor.rowcount

    def claim_key(self, key: str, sandbox_id: str) -> str:
        """Bind ``key`` to ``sandbox_id`` unless it is bound already; return the bound id.

        A unique key in the database, not a check in Python: two creates racing
        with one key cannot both win.
        """
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO idempotency_keys (key, sandbox_id) VALUES (?, ?)", (key, sandbox_id))
            (bound,) = self._db.execute("SELECT sandbox_id FROM idempotency_keys WHERE key = ?", (key,)).fetchone()
            return str(bound)

    def release_key(self, key: str, sandbox_id: str) -> None:
        self._execute("DELETE FROM idempotency_keys WHERE key = ? AND sandbox_id = ?", (key, sandbox_id))

    # --- templates and layers -----------------------------------------------

    def put_template(self, record: TemplateRecord) -> None:
        self._execute(
            "INSERT INTO templates (name, record) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET record=excluded.record",
            (record.name, record.to_json()),
        )

    def delete_template(self, name: str) -> None:
        self._execute("DELETE FROM templates WHERE name = ?", (name,))

    def templates(self) -> Iterator[TemplateRecord]:
        for name, raw in self._execute("SELECT name, record FROM templates ORDER BY name"):
            try:
                yield TemplateRecord.from_json(raw)
            except (ValueError, TypeError) as error:
                self.quarantine("template", name, raw, str(error))
                self.delete_template(name)

    def put_layer(self, layer_id: str, record: dict[str, Any]) -> None:
        self._execute(
            "INSERT INTO layers (id, record) VALUES (?, ?) ON CONFLICT(id) DO UPDATE SET record=excluded.record",
            (layer_id, json.dumps(record)),
        )

    def delete_layer(self, layer_id: str) -> None:
        self._execute("DELETE FROM layers WHERE id = ?", (layer_id,))

    def layers(self) -> dict[str, dict[str, Any]]:
        result = {}
        for layer_id, raw in self._execute("SELECT id, record FROM layers"):
            try:
                result[layer_id] = json.loads(raw)
            except ValueError as error:
                self.quarantine("layer", layer_id, raw, str(error))
                self.delete_layer(layer_id)
        return result

    # --- quarantine and metadata ------------------------------------------

    def quarantine(self, kind: str, key: str, raw: str | None, reason: str) -> None:
        self._execute(
            "INSERT INTO quarantine (kind, key, raw, reason, at) VALUES (?, ?, ?, ?, ?)",
            (kind, key, raw, reason, time.time()),
        )

    def quarantined(self) -> list[dict[str, Any]]:
        rows = self._execute("SELECT kind, key, reason, at FROM quarantine ORDER BY rowid")
        return [{"kind": kind, "key": key, "reason": reason, "at": at} for kind, key, reason, at in rows]

    def get_meta(self, key: str) -> str | None:
        rows = self._execute("SELECT value FROM meta WHERE key = ?", (key,))
        return rows[0][0] if rows else None

    def set_meta(self, key: str, value: str) -> None:
        self._execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            (key, value),
        )


def open_store(path: Path) -> Store:
    """Open the store; a database that is not SQLite at all is set aside."""
    try:
        store = Store(path)
        store._execute("SELECT count(*) FROM sandboxes")
        return store
    except sqlite3.DatabaseError:
        aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
        path.rename(aside)
        for suffix in ("-wal", "-shm"):
            sidecar = path.with_name(path.name + suffix)
            if sidecar.exists():
                sidecar.rename(aside.with_name(aside.name + suffix))
        store = Store(path)
        store.quarantine("database", str(path), None, f"unreadable database moved to {aside.name}")
        return store
