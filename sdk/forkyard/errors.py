"""Typed errors for every way a forkyard call can fail.

The API answers errors as JSON, ``{"error": {"code", "message", "field", "details"}}``,
with a stable ``code``.  Each HTTP status maps to one exception class, so that
callers catch what they can act on (``NotFound``, ``RateLimited``, ``NoCapacity``)
and read the rest from the attributes of ``ForkyardError``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC
from typing import Any

REGION_HEADER = "X-Forkyard-Region"
REQUEST_ID_HEADER = "X-Request-Id"


class ForkyardError(Exception):
    """Any error from forkyard: the API's own, a transport failure, or a local one.

    ``code`` is the API's stable code (``sandbox_not_found``, ``invalid_size``,
    ...), ``status`` the HTTP status (``None`` when no answer came), ``field``
    the request field at fault, ``retry_after`` the seconds the server asked
    to wait, ``request_id`` and ``region`` the response headers that identify
    the answer.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        status: int | None = None,
        field: str | None = None,
        details: Mapping[str, Any] | None = None,
        retry_after: float | None = None,
        request_id: str | None = None,
        region: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status
        self.field = field
        self.details: dict[str, Any] = dict(details or {})
        self.retry_after = retry_after
        self.request_id = request_id
        self.region = region

    def __str__(self) -> str:
        where = f" (field {self.field})" if self.field else ""
        return f"[{self.code}] {self.message}{where}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, status={self.status!r}, message={self.message!r})"


class InvalidRequest(ForkyardError):
    """400, 413 or 422: the request itself is wrong; ``field`` names the culprit."""


class UnknownOption(InvalidRequest, TypeError):
    """An option the SDK does not know (``sb.exec("...", tiemout=1)``), or one given under two names:
    refused before anything is sent, never silently ignored.  ``field`` names it.  It is a
    ``TypeError`` too, as Python's own unexpected keyword arguments are."""


class Unauthorized(ForkyardError):
    """401: no API key, or one that is unknown, revoked or expired."""


class Forbidden(ForkyardError):
    """403: the key is valid but its role may not do this (e.g. manage keys)."""


class NotFound(ForkyardError):
    """404: no such object, or it belongs to another team (the API does not say which)."""


class Conflict(ForkyardError):
    """409: the object is in the wrong state, e.g. ``sandbox_not_running``."""


class RateLimited(ForkyardError):
    """429: over the team's request rate or sandbox quota; ``retry_after`` says when to come back."""


class ServerError(ForkyardError):
    """500 and other unexpected 5xx answers."""


class NotImplementedByServer(ServerError):
    """501: the server knows the endpoint but this deployment cannot do it yet (e.g. snapshots)."""


class Unavailable(ServerError):
    """503 (a host or a dependency is down), 502/504, or no answer at all (connection failures)."""


class NoCapacity(Unavailable):
    """503 ``no_capacity``: every host is full or none is online; try again after ``retry_after``."""


class SnapshotFailed(ForkyardError):
    """A snapshot being waited for failed: ``code`` and ``message`` say why (``sandbox_not_running``,
    ``too_large``...), ``details["snapshot"]`` names it."""


class TemplateBuildFailed(ForkyardError):
    """A template build being waited for failed: ``code`` says why (``step_failed``, ``step_timed_out``...),
    ``details`` name the ``build`` and its ``failed_step``, and ``output`` is that step's output (its tail)."""

    output: str = ""


class WaitTimeout(ForkyardError, TimeoutError):
    """A wait in the SDK (a launch, a sandbox still starting) ran past its timeout."""


class UnsafeArchive(ForkyardError):
    """``download_dir`` refused an entry of the sandbox's archive that would land outside its
    target directory (an absolute name, ``..``, a link leading out) or is a device or FIFO:
    nothing of it was written.  ``details["entry"]`` names it."""


class ConfigurationError(ForkyardError):
    """The client is missing its URL or API key, or was given an invalid option."""


BY_STATUS: dict[int, type[ForkyardError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: InvalidRequest,
    422: InvalidRequest,
    429: RateLimited,
    501: NotImplementedByServer,
    502: Unavailable,
    503: Unavailable,
    504: Unavailable,
}


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date), or None."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    from datetime import datetime
    from email.utils import parsedate_to_datetime

    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def error_class(status: int, code: str) -> type[ForkyardError]:
    if status == 503 and code == "no_capacity":
        return NoCapacity
    if status in BY_STATUS:
        return BY_STATUS[status]
    if status >= 500:
        return ServerError
    return InvalidRequest if 400 <= status < 500 else ForkyardError


def error_from_body(
    status: int, body: Mapping[str, Any], *, headers: Mapping[str, str] | None = None, fallback_message: str = ""
) -> ForkyardError:
    """The typed error for an API error object (``{"code", "message", ...}``)."""
    headers = headers or {}
    code = str(body.get("code") or f"http_{status}")
    message = str(body.get("message") or fallback_message or f"the server answered {status}")
    details = body.get("details")
    field = body.get("field")
    return error_class(status, code)(
        code,
        message,
        status=status,
        field=str(field) if field else None,
        details=details if isinstance(details, Mapping) else None,
        retry_after=parse_retry_after(headers.get("Retry-After")),
        request_id=headers.get(REQUEST_ID_HEADER),
        region=headers.get(REGION_HEADER),
    )


def error_from_response(status: int, headers: Mapping[str, str], content: bytes) -> ForkyardError:
    """The typed error for a non-2xx answer, JSON or not (a proxy's HTML page, say)."""
    text = content.decode("utf-8", "replace").strip()
    try:
        document = json.loads(text) if text else {}
    except ValueError:
        document = {}
    body = document.get("error") if isinstance(document, dict) else None
    if not isinstance(body, Mapping):
        body = {}
    return error_from_body(status, body, headers=headers, fallback_message=text[:200])
