"""The public API's foundation: the NinjaAPI object, key auth, limits and error format.

Every endpoint is async (Daphne runs every sync view on one shared thread, so
a slow sync view would stall all of them); database work goes through one
``sync_to_async`` hop per request where it can.
"""

from __future__ import annotations

import logging
import re
from datetime import UTC, datetime
from typing import Annotated, Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from ninja import NinjaAPI, Schema
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.openapi.docs import DocsBase
from ninja.parser import Parser
from ninja.security import HttpBearer
from pydantic import AfterValidator, BeforeValidator

from console.db import db
from sandboxes.engine.data_path import bad_text, invalid_body

from .authorize import authorize
from .errors import (
    BeyondCapacity,
    Conflict,
    Failed,
    Forbidden,
    InvalidRequest,
    NotFound,
    OverBudget,
    OverLimit,
    Refused,
    TooLarge,
    Unavailable,
    UpstreamFailed,
    UpstreamTimeout,
    invalid,
)
from .keys import api_key_authenticate, remember, remembered
from .middleware import ContentSecurityPolicyMiddleware, dependency_error, outage_response
from .models import ApiKey
from .ratelimit import Verdict, limiter
from .selectors import limits_of

log = logging.getLogger("forkyard.api")
DESCRIPTION = """forkyard gives every reinforcement-learning rollout a Linux sandbox of its own.

Authenticate with `Authorization: Bearer <api key>`. A key sees only its team's objects.
Every response names the region that served it (`X-Forkyard-Region`) and the caller's
limits (`X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`). Over the rate
limit: `429` with `Retry-After`. No capacity, or a dependency down: `503` with `Retry-After`.
Errors are JSON: `{"error": {"code": "...", "message": "...", "field": "..."}}`.
"""


def _look_up_key(token: str) -> tuple[ApiKey, int] | None:
    """The active key for ``token`` and its team's rate limit, from the database; remembered a few seconds."""
    key = api_key_authenticate(token)
    if key is None:
        return None
    rate = limits_of(key.team).requests_per_second
    remember(token, key, rate)
    return key, rate


async def check_key(token: str) -> tuple[ApiKey | None, Verdict | None]:
    """The active key for ``token`` and the rate limiter's verdict on this request (counted once).

    A key checked a moment ago (``console.keys.remembered``) costs no query and no thread."""
    found = remembered(token) or await db(_look_up_key)(token)
    if found is None:
        return None, None
    key, rate = found
    return key, await limiter().ahit(key.team_id, rate)


async def key_still_active(token: str) -> bool:
    """Whether ``token`` still names an active key (not revoked, not expired), as ``check_key`` would find
    it, but without counting a request: for a connection that stays open (a terminal's websocket)."""
    return (remembered(token) or await db(_look_up_key)(token)) is not None


class TextParser(Parser):
    """JSON bodies whose every string is valid Unicode.

    JSON may spell a lone surrogate (``"\\ud800"``) that no UTF-8 text can
    hold: accepted, it broke every page that later showed it.  It is refused
    here, at the edge, naming the field.
    """

    def parse_body(self, request: HttpRequest) -> Any:
        data = super().parse_body(request)
        where = bad_text(data)
        if where is not None:
            raise InvalidRequest(
                "invalid_text",
                f"{where or 'the body'}: text must be valid Unicode (a lone surrogate is not)",
                field=where or None,
            )
        return data


class ApiKeyAuth(HttpBearer):
    """Bearer API keys, checked and counted against the team's rate limit."""

    async def __call__(self, request: HttpRequest) -> ApiKey | None:
        checked = getattr(request, "scope", {}).get("forkyard.auth")  # the API's ASGI handler checked it already
        if checked is None:
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not token:
                return None
            checked = await check_key(token.strip())
            key, verdict = checked
            if key is not None and verdict is not None and verdict.allowed:
                # Reached Django without the API's handler (which checks it before the body): the same check.
                refused = await authorize(key, request.method or "GET", request.path, {k: request.GET.getlist(k) for k in request.GET})
                if refused is not None:
                    raise refused
        key, verdict = checked
        if key is None or verdict is None:
            return None
        request.forkyard_headers = verdict.headers()  # type: ignore[attr-defined]
        request.forkyard_rate = verdict.limit  # type: ignore[attr-defined]  # what data tokens carry (sandboxes.gateway_access)
        if not verdict.allowed:
            raise verdict.refusal()
        return key

    def authenticate(self, request: HttpRequest, token: str) -> Any:  # pragma: no cover - __call__ is used
        raise NotImplementedError


class OfflineDocs(DocsBase):
    """``/api/v1/docs``: Swagger UI served from the project's own static files, with a page of ours
    (scripts from the site only, as the console's Content-Security-Policy allows); never a CDN."""

    def render_page(self, request: HttpRequest, api: NinjaAPI, **kwargs: Any) -> HttpResponse:
        settings = {"url": self.get_openapi_url(api, kwargs)}
        response = render(request, "console/api_docs.html", {"api": api, "swagger_settings": settings})
        response.headers.setdefault("Content-Security-Policy", ContentSecurityPolicyMiddleware.POLICY)
        return response


api = NinjaAPI(
    title="forkyard",
    version="1.0.0",
    description=DESCRIPTION,
    auth=ApiKeyAuth(),
    urls_namespace="api-v1",
    parser=TextParser(),
    docs_url="/docs",
    docs=OfflineDocs(),
    openapi_url="/openapi.json",
)


class ErrorDetail(Schema):
    code: str
    message: str
    field: str | None = None
    details: dict[str, Any] | None = None


class ErrorOut(Schema):
    error: ErrorDetail


class Unauthorized(Refused):
    """No valid API key (only the API's authentication raises it)."""


# The one place where a kind of refusal becomes an HTTP status.
STATUS: dict[type[Refused], int] = {
    InvalidRequest: 400,
    Unauthorized: 401,
    OverBudget: 402,
    Forbidden: 403,
    NotFound: 404,
    Conflict: 409,
    TooLarge: 413,
    BeyondCapacity: 422,
    OverLimit: 429,
    Failed: 500,
    UpstreamFailed: 502,
    Unavailable: 503,
    UpstreamTimeout: 504,
}


_NUMBER = re.compile(r"^\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$")


def _iso_only(value: Any) -> Any:
    """A time in a query is ISO 8601: a bare number (which pydantic would take as seconds since 1970) is refused."""
    if isinstance(value, str) and _NUMBER.match(value):
        raise ValueError("a time is ISO 8601, e.g. 2026-12-01T00:00:00Z")
    return value


def _in_utc(moment: datetime) -> datetime:
    """In UTC (a time without a zone is taken as UTC): any offset Python accepts then reaches every database
    (PostgreSQL refuses offsets past 15:59)."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


# A time a query parameter gives (``since``, ``until``, ``start``, ``end``...).
QueryTime = Annotated[datetime, BeforeValidator(_iso_only), AfterValidator(_in_utc)]

# The error answers every endpoint may give, for its OpenAPI entry.
ERRORS: dict[int, Any] = {status: ErrorOut for status in (400, 401, 403, 404, 409, 413, 422, 429, 503)}
# ... and those that start sandboxes (a create, a launch, a resume), which a budget may refuse.
BUDGETED: dict[int, Any] = {**ERRORS, 402: ErrorOut}
# And those of an endpoint that passes a request on (the inference gateway, grades, a sandbox's grade).
UPSTREAM_ERRORS: dict[int, Any] = {**ERRORS, 502: ErrorOut, 504: ErrorOut}


def status_of(error: Refused) -> int:
    for kind in type(error).__mro__:
        if kind in STATUS:
            return STATUS[kind]
    return 500


def error_response(request: HttpRequest, error: Refused) -> HttpResponse:
    response = api.create_response(request, error.body(), status=status_of(error))
    if error.retry_after_s is not None:
        response["Retry-After"] = str(error.retry_after_s)
    return response


@api.exception_handler(Refused)
def _refused(request: HttpRequest, error: Refused) -> HttpResponse:
    return error_response(request, error)


@api.exception_handler(AuthenticationError)
def _unauthorized(request: HttpRequest, error: AuthenticationError) -> HttpResponse:
    return error_response(request, Unauthorized("unauthorized", "a valid API key is required: Authorization: Bearer <key>"))


@api.exception_handler(ValidationError)
def _invalid(request: HttpRequest, error: ValidationError) -> HttpResponse:
    refusal = invalid_body(error.errors)
    return error_response(request, invalid(refusal.message, field=refusal.field, details=refusal.details))


@api.exception_handler(HttpError)
def _http_error(request: HttpRequest, error: HttpError) -> HttpResponse:
    """ninja's own refusals (a malformed body, a method not allowed) keep their status, in our format;
    a refusal of ours that ninja wrapped (the body's parser's) is answered as itself."""
    if isinstance(error.__cause__, Refused):
        return error_response(request, error.__cause__)
    codes = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 413: "too_large"}
    body = {"error": {"code": codes.get(error.status_code, "error"), "message": str(error)}}
    return api.create_response(request, body, status=error.status_code)


@api.exception_handler(Exception)
def _unexpected(request: HttpRequest, error: Exception) -> HttpResponse:
    if dependency_error(error):
        return outage_response(request, error)
    log.exception("unhandled error on %s", request.path)
    return error_response(request, Failed("internal_error", "an unexpected error occurred; it has been logged"))


def key_of(request: HttpRequest) -> ApiKey:
    key = request.auth  # type: ignore[attr-defined]
    assert isinstance(key, ApiKey)
    return key
