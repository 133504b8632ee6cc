"""Waiting in the SDK: deadlines for polls, and what a sandbox or a snapshot that failed raises."""

from __future__ import annotations

import time
from collections.abc import Iterator

from .errors import SnapshotFailed, Unavailable, WaitTimeout
from .models import SandboxFields, SnapshotFields


class Deadline:
    """A time limit for a poll loop (None: wait for ever)."""

    def __init__(self, timeout_s: float | None, waiting_for: str) -> None:
        self.waiting_for = waiting_for
        self.timeout_s = timeout_s
        self.end = None if timeout_s is None else time.monotonic() + timeout_s

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
