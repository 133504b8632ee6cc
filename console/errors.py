"""What the control plane refuses, and why: domain errors with a stable code.

Services and selectors raise these; they know nothing of HTTP.  Each kind of
refusal is a class, and the public API turns a class into a status code in
one table (``console.api_base.STATUS``); the console shows the message.

Every error carries a ``code`` (stable, for programs), a ``message`` (a
sentence a person can act on), and optionally the ``field`` it is about,
``details`` (numbers a program may use: a limit, a state) and
``retry_after_s`` (when trying again later may work).
"""

from __future__ import annotations

from typing import Any


class Refused(Exception):
    """A request the system will not carry out (the base of every kind below)."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        field: str | None = None,
        details: dict[str, Any] | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.details = details or {}
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.field:
            error["field"] = self.field
        if self.details:
            error["details"] = self.details
        return {"error": error}


class InvalidRequest(Refused):
    """The request itself is wrong: fix it before sending it again."""


class Forbidden(Refused):
    """The caller may not do this (their role or key does not allow it)."""


class NotFound(Refused):
    """No such object in the caller's team: the same answer whether it does not exist or is another team's."""


class Conflict(Refused):
    """The object is not in a state that allows it (a stopped sandbox, a snapshot in use, a name taken)."""


class TooLarge(Refused):
    """The request's body is over what the endpoint accepts."""


class BeyondCapacity(Refused):
    """Well formed, but more than the fleet could ever hold (a shape no host has room for): never retry as is."""


class OverBudget(Refused):
    """What it would cost takes a budget past its monthly limit (``*_budget_exceeded``, naming which): 402."""


class OverLimit(Refused):
    """Over one of the team's limits (requests per second, sandboxes at once)."""


class Unavailable(Refused):
    """No capacity, or a part of the system is not answering: try again after ``retry_after_s``."""

    def __init__(self, code: str, message: str, *, retry_after_s: int = 5, **kwargs: Any) -> None:
        super().__init__(code, message, retry_after_s=retry_after_s, **kwargs)


class Failed(Refused):
    """Something broke on our side; the code names what (the API answers 500)."""


class UpstreamFailed(Refused):
    """A server we passed the request to (an inference upstream, a model server) failed or gave a bad answer."""


class UpstreamTimeout(Refused):
    """A server we passed the request to did not answer in time."""


def not_found(kind: str, identifier: str, *, field: str | None = None) -> NotFound:
    """``<kind>_not_found``, naming what was asked for (cut short: it came from the caller)."""
    return NotFound(f"{kind}_not_found", f"no {kind.replace('_', ' ')} {identifier[:80]!r}", field=field)


def invalid(message: str, *, field: str | None = None, **kwargs: Any) -> InvalidRequest:
    """The most common refusal: ``invalid_request``, naming the field."""
    return InvalidRequest("invalid_request", message, field=field, **kwargs)
