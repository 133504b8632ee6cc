"""The public API's foundation: the NinjaAPI object, key auth, limits and error format.

Every endpoint is async (Daphne runs every sync view on one shared thread, so
a slow sync view would stall all of them); database work goes through one
``sync_to_async`` hop per request where it can.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.security import HttpBearer

from console.db import db

from .errors import ApiError
from .keys import api_key_authenticate
from .middleware import dependency_error, outage_response
from .models import ApiKey, TeamLimits
from .ratelimit import Verdict, limiter

DESCRIPTION = """forkyard gives every reinforcement-learning rollout a Linux sandbox of its own.

Authenticate with `Authorization: Bearer <api key>`. A key sees only its team's objects.
Every response names the region that served it (`X-Forkyard-Region`) and the caller's
limits (`X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`). Over the rate
limit: `429` with `Retry-After`. No capacity, or a dependency down: `503` with `Retry-After`.
Errors are JSON: `{"error": {"code": "...", "message": "...", "field": "..."}}`.
"""


def _check(token: str) -> tuple[ApiKey | None, Verdict | None]:
    key = api_key_authenticate(token)
    if key is None:
        return None, None
    try:
        limits = key.team.limits
    except TeamLimits.DoesNotExist:
        limits = TeamLimits.objects.create(team=key.team)
    return key, limiter().hit(key.team_id, limits.requests_per_second)


class ApiKeyAuth(HttpBearer):
    """Bearer API keys, checked and counted against the team's rate limit."""

    async def __call__(self, request: HttpRequest) -> ApiKey | None:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        key, verdict = await db(_check)(token.strip())
        if key is None or verdict is None:
            return None
        request.forkyard_headers = verdict.headers()  # type: ignore[attr-defined]
        if not verdict.allowed:
            raise ApiError(
                "rate_limited",
                f"over the team's limit of {verdict.limit} requests per second",
                status=429,
                retry_after_s=verdict.retry_after_s,
            )
        return key

    def authenticate(self, request: HttpRequest, token: str) -> Any:  # pragma: no cover - __call__ is used
        raise NotImplementedError


api = NinjaAPI(
    title="forkyard",
    version="1.0.0",
    description=DESCRIPTION,
    auth=ApiKeyAuth(),
    urls_namespace="api-v1",
    docs_url="/docs",
    openapi_url="/openapi.json",
)


def error_response(request: HttpRequest, error: ApiError) -> HttpResponse:
    response = api.create_response(request, error.body(), status=error.status)
    if error.retry_after_s is not None:
        response["Retry-After"] = str(error.retry_after_s)
    return response


@api.exception_handler(ApiError)
def _api_error(request: HttpRequest, error: ApiError) -> HttpResponse:
    return error_response(request, error)


@api.exception_handler(AuthenticationError)
def _unauthorized(request: HttpRequest, error: AuthenticationError) -> HttpResponse:
    return error_response(
        request, ApiError("unauthorized", "a valid API key is required: Authorization: Bearer <key>", status=401)
    )


TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
SOURCES = ("body", "query", "path", "header", "cookie")


def _structural(part: object) -> bool:
    """Parts of a pydantic error location that are not the caller's field names:
    which member of a union was tried."""
    text = str(part)
    return text in TYPE_TAGS or "[" in text or text.startswith("function-")


def _field_of(location: list[object]) -> str | None:
    """``services.0.ready.http.path`` from ``("body", "payload", "services", 0, ...)``: where the
    value came from (body, query...) leads the location; a field may itself be named ``path``."""
    parts = [str(part) for part in location]
    if parts and parts[0] in SOURCES:
        source = parts.pop(0)
        if source == "body" and parts[:1] == ["payload"]:
            parts.pop(0)  # the name of the view's body argument
    return ".".join(part for part in parts if not _structural(part)) or None


@api.exception_handler(ValidationError)
def _invalid(request: HttpRequest, error: ValidationError) -> HttpResponse:
    first = error.errors[0] if error.errors else {}
    field = _field_of(list(first.get("loc", [])))
    message = first.get("msg", "invalid input")
    return error_response(
        request,
        ApiError(
            "invalid_request",
            f"{field}: {message}" if field else message,
            status=400,
            field=field,
            details={
                "errors": [
                    {"field": ".".join(str(p) for p in e.get("loc", [])), "message": e.get("msg")} for e in error.errors[:20]
                ]
            },
        ),
    )


@api.exception_handler(HttpError)
def _http_error(request: HttpRequest, error: HttpError) -> HttpResponse:
    codes = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 413: "too_large"}
    return error_response(request, ApiError(codes.get(error.status_code, "error"), str(error), status=error.status_code))


@api.exception_handler(Exception)
def _unexpected(request: HttpRequest, error: Exception) -> HttpResponse:
    if dependency_error(error):
        return outage_response(request, error)
    import logging

    logging.getLogger("forkyard.api").exception("unhandled error on %s", request.path)
    return error_response(request, ApiError("internal_error", "an unexpected error occurred; it has been logged", status=500))


def key_of(request: HttpRequest) -> ApiKey:
    key = request.auth  # type: ignore[attr-defined]
    assert isinstance(key, ApiKey)
    return key
