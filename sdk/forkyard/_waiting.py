"""Waiting in the SDK: deadlines for polls, a launch's sandboxes as they arrive, and what a sandbox or a snapshot that failed raises."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from typing import Any

from . import _calls as calls
from .errors import SnapshotFailed, Unavailable, WaitTimeout
from .models import SandboxFields, SnapshotFields


class Deadline:
    """A time limit for a poll loop (None: wait for ever)."""

    def __init__(self, timeout_s: float | None, waiting_for: str) -> None:
        self.waiting_for = waiting_for
        self.timeout_s = timeout_s
        self.end = None if timeout_s is None else time.monotonic() + timeout_s

    def left(self) -> float:
        """Seconds left (never below 0); a deadline of None has all the time there is."""
        return float("inf") if self.end is None else max(0.0, self.end - time.monotonic())

    def check(self) -> None:
        """Raises ``WaitTimeout`` once the time is up."""
        self.next_poll(0.0)

    def next_poll(self, poll_s: float) -> float:
        """How long to sleep before the next poll; raises ``WaitTimeout`` once the time is up."""
        if self.end is None:
            return poll_s
        remaining = self.end - time.monotonic()
        if remaining <= 0:
            raise WaitTimeout("wait_timeout", f"gave up waiting for {self.waiting_for} after {self.timeout_s:g}s")
        return min(poll_s, remaining)


def backoff(first_s: float = 0.1, factor: float = 1.5, most_s: float = 2.0) -> Iterator[float]:
    """Poll intervals that grow: quick for what is done at once, easy on the API for what takes minutes."""
    delay = first_s
    while True:
        yield delay
        delay = min(delay * factor, most_s)


def raise_if_failed(sandbox: SandboxFields) -> None:
    """A sandbox that never started raises what the API answers for it: a 503 with its error code."""
    if sandbox.state != "failed":
        return
    code = sandbox.error.code if sandbox.error else "create_failed"
    message = sandbox.error.message if sandbox.error else "the sandbox failed to start"
    raise Unavailable(code, message, status=503, details={"sandbox": sandbox.id})


def raise_if_snapshot_failed(snapshot: SnapshotFields) -> None:
    if snapshot.state != "failed":
        return
    code = snapshot.error.code if snapshot.error else "snapshot_failed"
    message = snapshot.error.message if snapshot.error else "the snapshot could not be taken"
    raise SnapshotFailed(code, message, details={"snapshot": snapshot.id})


# How long launch.wait() keeps asking again for a stream that was answering before it was cut off.
RECONNECT_S = 60.0


class Arrivals:
    """What ``launch.wait()`` has handed out, read from the launch's arrivals stream
    (``GET /launches/{id}/arrivals``: the web server pushes each member as it becomes ready, the
    failed and ended ones last). A stream cut off is asked for again: it starts over, and the
    members handed out already are skipped."""

    def __init__(self, launch_id: str) -> None:
        self.call = calls.launch_arrivals(launch_id)
        self.seen: set[str] = set()
        self.last_line: float | None = None  # when the stream last answered (monotonic)

    def read(self, line: str) -> tuple[str, Mapping[str, Any]] | None:
        """``("sandbox", row)`` for a member not handed out yet, ``("progress" | "end", launch)``; None
        for the rest (a member seen before, a kind of line this SDK does not know)."""
        if not line.strip():
            return None
        self.last_line = time.monotonic()
        message = json.loads(line)
        kind = message.get("type")
        if kind == "sandbox":
            row = message["sandbox"]
            if row["id"] in self.seen:
                return None
            self.seen.add(row["id"])
            return "sandbox", row
        if kind in ("progress", "end"):
            return kind, message["launch"]
        return None

    def again(self, error: Unavailable) -> None:
        """A stream was cut off, or asking again failed: ask again while the stream answered within
        ``RECONNECT_S`` (a web server restarting), else the error goes on (it never answered, or has
        stopped answering, after the client's own retries)."""
        if self.last_line is None or time.monotonic() - self.last_line > RECONNECT_S:
            raise error
