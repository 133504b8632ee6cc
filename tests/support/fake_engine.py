"""A recording fake of the engine's client, for in-process tests of the worker and the transitions.

It answers the calls the control plane makes (``sandboxes.engine_link``
hands it out in place of ``EngineClient`` through ``connected_to``) the way
the engine does: creates idempotent on their key, destroys idempotent, the
same records and errors.  It records every call, in order, so a test can say
exactly what the worker asked of the engine.  Like youki's test manager for
cgroups, it stands in only for the engine's interface: the database, the
transitions and the worker under test are the real ones.  The engine itself
is tested with real sandboxes (``tests/engine``), and the whole product with
both (``tests/api``).

A test can hold creates at a gate (``hold_creates``), to have something
happen while the engine is creating, and make any operation fail with an
engine error (``fail``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sandboxes.engine import errors


@dataclass
class FakeEngine:
    """One host's engine: its sandboxes and templates, and every call made to it."""

    templates: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {"base": {"name": "base", "kind": "template", "layers": ["l1"], "size_bytes": 1}}
    )
    sandboxes: dict[str, dict[str, Any]] = field(default_factory=dict)
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    failures: dict[str, errors.EngineError] = field(default_factory=dict)
    max_sandboxes: int = 1000
    kernel_fits: int | None = None  # what its preflight says the host's kernel limits allow (None: max_sandboxes)
    overhead_kib: int = 600  # the kernel's memory per sandbox it reports
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _gate: threading.Event | None = None
    _waiting: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))

    # --- what a test arranges -------------------------------------------------------

    def fail(self, op: str, error: errors.EngineError) -> None:
        """Every later ``op`` raises ``error``."""
        self.failures[op] = error

    @contextmanager
    def hold_creates(self) -> Iterator[FakeEngine]:
        """Creates wait inside the engine until the block ends; ``wait_for_create`` sees one arrive."""
        self._gate = threading.Event()
        try:
            yield self
        finally:
            self._gate.set()
            self._gate = None

    def wait_for_create(self, timeout_s: float = 10) -> None:
        assert self._waiting.acquire(timeout=timeout_s), "no create reached the engine"

    def ops(self) -> list[str]:
        return [op for op, _ in self.calls]

    def running(self) -> list[dict[str, Any]]:
        return [record for record in self.sandboxes.values() if record["state"] == "running"]

    # --- the client's surface -------------------------------------------------------

    def _record(self, op: str, args: dict[str, Any]) -> None:
        with self._lock:
            self.calls.append((op, args))
        if op in self.failures:
            raise self.failures[op]

    def info(self) -> dict[str, Any]:
        self._record("info", {})
        live = [record for record in self.sandboxes.values() if record["state"] in ("running", "paused")]
        return {
            "cpus": 2,
            "memory_mib": 24576,
            "max_sandboxes": self.max_sandboxes,
            "sandboxes": len(live),
            "pooled": 0,
            "committed_memory_mib": sum(record["memory_mib"] for record in live),
            "version": "fake",
            "sizes": {},
            "preflight": {"fits": self.max_sandboxes if self.kernel_fits is None else self.kernel_fits},
            "sandbox_overhead_kib": {"kib": self.overhead_kib, "default_kib": 600},
        }

    def create(self, **args: Any) -> dict[str, Any]:
        self._record("create", args)
        if args.get("template") not in self.templates:
            raise errors.TemplateNotFound(f"no template {args.get('template')!r}", field="template")
        gate = self._gate
        if gate is not None:
            self._waiting.release()
            gate.wait(30)
        with self._lock:
            existing = next(
                (record for record in self.sandboxes.values() if args.get("key") and record["key"] == args["key"]), None
            )
            if existing is not None:
                return dict(existing)  # a replay: the same sandbox
            now = time.time()
            record = {
                "id": f"fake-{next(self._ids)}",
                "key": args.get("key"),
                "state": "running",
                "template": args["template"],
                "size": args.get("size", ""),
                "cpu": args.get("cpu"),
                "memory_mib": args.get("memory_mib", 0),
                "labels": args.get("labels", {}),
                "ready_at": now,
                "expires_at": now + float(args.get("ttl_s", 3600)),
                "ended_at": None,
            }
            self.sandboxes[record["id"]] = record
            return dict(record)

    def destroy(self, sandbox_id: str) -> dict[str, Any]:
        self._record("destroy", {"id": sandbox_id})
        with self._lock:
            record = self.sandboxes.get(sandbox_id)
            if record is None:
                raise errors.SandboxNotFound(f"no sandbox {sandbox_id!r}")
            if record["state"] != "destroyed":
                record.update(state="destroyed", ended_at=time.time())
            return dict(record)

    def destroy_many(self, sandbox_ids: list[str]) -> list[dict[str, Any]]:
        """As the engine's: each destroyed (recorded as a destroy each), or its error."""
        answers = []
        for sandbox_id in sandbox_ids:
            try:
                answers.append(self.destroy(sandbox_id))
            except errors.EngineError as error:
                answers.append({"id": sandbox_id, "error": error.to_dict()})
        return answers

    def get(self, sandbox_id: str) -> dict[str, Any]:
        self._record("get", {"id": sandbox_id})
        record = self.sandboxes.get(sandbox_id)
        if record is None:
            raise errors.SandboxNotFound(f"no sandbox {sandbox_id!r}")
        return dict(record)

    def list(self, state: str | None = None, label: str | None = None) -> list[dict[str, Any]]:
        self._record("list", {})
        return [dict(record) for record in self.sandboxes.values() if record["state"] != "destroyed"]

    def call(self, op: str, body: bytes | Iterable[bytes] | None = None, **args: Any) -> Any:
        self._record(op, args)
        if op == "templates.list":
            return {"templates": [dict(template) for template in self.templates.values()]}
        if op == "templates.get":
            if args["name"] not in self.templates:
                raise errors.TemplateNotFound(f"no template {args['name']!r}")
            return dict(self.templates[args["name"]])
        if op == "templates.delete":
            if self.templates.pop(args["name"], None) is None:
                raise errors.TemplateNotFound(f"no template {args['name']!r}")
            return {}
        if op == "snapshots.create":
            layer = f"layer-of-{args['name']}"
            self.templates[args["name"]] = {"name": args["name"], "kind": "snapshot", "layers": [layer], "size_bytes": 2**20}
            return {
                "name": args["name"],
                "layer": layer,
                "layers": [layer],
                "size_bytes": 2**20,
                "total_bytes": 2**21,
                "paused_ms": 1.5,
                "services": args.get("services", []),
            }
        if op in ("pause", "resume"):
            record = self.sandboxes[args["id"]]
            record["state"] = "paused" if op == "pause" else "running"
            return dict(record)
        raise errors.InvalidRequest(f"the fake engine does not know {op!r}")

    def close(self) -> None:
        pass
