"""Waiting in the SDK: deadlines for polls, and what a sandbox that failed to start raises."""

from __future__ import annotations

import time

from .errors import Unavailable, WaitTimeout
from .models import SandboxFields


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


def raise_if_failed(sandbox: SandboxFields) -> None:
    """A sandbox that never started raises what the API answers for it: a 503 with its error code."""
    if sandbox.state != "failed":
        return
    code = sandbox.error.code if sandbox.error else "create_failed"
    message = sandbox.error.message if sandbox.error else "the sandbox failed to start"
    raise Unavailable(code, message, status=503, details={"sandbox": sandbox.id})
