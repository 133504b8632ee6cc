"""Errors the public API answers with: a stable code, a sentence, the field."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    status = 400

    def __init__(
        self,
        code: str,
        message: str,
        *,
        status: int | None = None,
        field: str | None = None,
        retry_after_s: int | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        if status is not None:
            self.status = status
        self.field = field
        self.retry_after_s = retry_after_s
        self.details = details or {}

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.field:
            error["field"] = self.field
        if self.details:
            error["details"] = self.details
        return {"error": error}


def not_found(kind: str, identifier: str) -> ApiError:
    # The same answer whether it does not exist or belongs to another team.
    return ApiError(f"{kind}_not_found", f"no {kind.replace('_', ' ')} {identifier[:80]!r}", status=404)


def unavailable(message: str, retry_after_s: int = 5, code: str = "unavailable") -> ApiError:
    return ApiError(code, message, status=503, retry_after_s=retry_after_s)


def from_engine(error: Exception) -> ApiError:
    """Map an engine error (sandboxes.engine.errors) to the API's."""
    from sandboxes.engine import errors as engine

    if isinstance(error, engine.Unavailable):
        return unavailable("the sandbox's host is not answering; try again shortly", code="host_unavailable")
    if isinstance(error, engine.NoCapacity):
        return unavailable(error.message, code="no_capacity")
    if isinstance(error, engine.EngineError):
        field = error.details.get("field") or (error.details.get("path") and "path")
        status = error.status if 400 <= error.status < 600 else 500
        details = {key: value for key, value in error.details.items() if key in ("path", "size", "limit", "state", "type")}
        return ApiError(error.code, error.message, status=status, field=field, details=details)
    return ApiError("internal_error", "an unexpected error occurred", status=500)
