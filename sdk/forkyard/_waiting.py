"""Waiting in the SDK: deadlines for polls, a launch's sandboxes as they arrive, and what a sandbox or a snapshot that failed raises."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from datetime import datetime, timedelta
from typing import Any

from . import _calls as calls
from ._http import Call
from .errors import SnapshotFailed, Unavailable, WaitTimeout
from .models import LaunchFields, SandboxFields, SnapshotFields, parse_time

# How far back each look for newly ready sandboxes reaches before the latest one seen: a row is
# written a little after its sandbox is ready (in batches), so a later look may find an earlier one.
LATE_WRITES = timedelta(seconds=2)
PAGE = 1000


class Deadline:
    """A time limit for a poll loop (None: wait for ever)."""

    def __init__(self, timeout_s: float | None, waiting_for: str) -> None:
        self.waiting_for = waiting_for
        self.timeout_s = timeout_s
        self.end = None if timeout_s is None else time.monotonic() + timeout_s

    def left(self) -> float:
        """Seconds left (never below 0); a deadline of None has all the time there is."""
        return float("inf") if self.end is None else max(0.0, self.end - time.monotonic())

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


class Arrivals:
    """What ``launch.wait()`` has handed out: each member once, running ones as they become ready.

    Each poll that finds more members settled asks only for those ready
    since the latest one seen (less ``LATE_WRITES``), in the order they
    became ready; whatever that missed, and the members that failed or
    ended, come at the end, in launch order, when the launch has settled.
    """

    def __init__(self, launch: LaunchFields) -> None:
        self.launch_id = launch.id
        self.seen: set[str] = set()
        self.since: datetime | None = launch.created_at
        self.settled = 0

    def due(self, launch: LaunchFields) -> bool:
        """Whether this poll should look for new arrivals: more members settled since the last look."""
        progress = launch.progress
        settled = progress.running + progress.failed + progress.ended
        if settled == self.settled or progress.running == 0:
            return False
        self.settled = settled
        return True

    def news(self, cursor: str | None) -> Call:
        since = self.since - LATE_WRITES if self.since is not None else None
        return calls.launch_sandboxes(self.launch_id, "running", PAGE, cursor, ready_since=since)

    def rest(self, cursor: str | None) -> Call:
        return calls.launch_sandboxes(self.launch_id, None, PAGE, cursor)

    def take(self, rows: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """The rows not handed out yet (now counted as handed out)."""
        fresh = [row for row in rows if row["id"] not in self.seen]
        self.seen.update(row["id"] for row in fresh)
        for row in rows:
            ready = parse_time(row.get("ready_at"))
            if ready is not None and (self.since is None or ready > self.since):
                self.since = ready
        return fresh
