"""Middleware: name the region, report limits, and turn dependency outages into 503s."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse

log = logging.getLogger("forkyard.api")
RETRY_AFTER_S = 5
OUTAGE = {
    "error": {"code": "dependency_unavailable", "message": "a dependency (database or broker) is unavailable; try again shortly"}
}


class ContentSecurityPolicyMiddleware:
    """The console's pages may load scripts, styles and images from this site only.

    Inline styles stay allowed (plotly writes them as it draws); inline
    scripts do not (the pages carry data in ``json_script`` blocks, which are
    not run).  The board's websocket is on another port (Daphne): ``ws:`` and
    ``wss:`` are allowed to connect.
    """

    POLICY = "; ".join(
        (
            "default-src 'self'",
            "script-src 'self'",
            "style-src 'self' 'unsafe-inline'",
            "img-src 'self' data: blob:",
            "connect-src 'self' ws: wss:",
            "object-src 'none'",
            "base-uri 'self'",
            "form-action 'self'",
            "frame-ancestors 'none'",
        )
    )

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        response.headers.setdefault("Content-Security-Policy", self.POLICY)
        return response


def dependency_error(error: BaseException) -> bool:
    """True for a database or broker that is down, not for a bug."""
    if isinstance(error, (OperationalError, InterfaceError)):
        return True
    try:
        from kombu.exceptions import ChannelError
        from kombu.exceptions import ConnectionError as BrokerUnreachable
        from kombu.exceptions import OperationalError as BrokerDown
    except ImportError:  # pragma: no cover
        return False
    if isinstance(error, (BrokerDown, ChannelError, BrokerUnreachable)):
        return True
    return isinstance(error, DatabaseError) and "connection" in str(error).lower()


def outage_response(request: HttpRequest, error: BaseException) -> HttpResponse:
    log.warning(
        "dependency unavailable while serving %s [%s]: %s", request.path, getattr(request, "forkyard_request_id", "-"), error
    )
    response = HttpResponse(json.dumps(OUTAGE), status=503, content_type="application/json")
    response["Retry-After"] = str(RETRY_AFTER_S)
    return response


def request_id(request: HttpRequest) -> str:
    """The caller's X-Request-Id (if sane), or a new one: it names the request in our logs and theirs."""
    given = request.headers.get("X-Request-Id", "")
    if not (0 < len(given) <= 64 and given.replace("-", "").replace("_", "").isalnum()):
        given = uuid.uuid4().hex
    request.forkyard_request_id = given  # type: ignore[attr-defined]
    return given


def decorate(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    response["X-Forkyard-Region"] = settings.FORKYARD_REGION
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response["X-Request-Id"] = getattr(request, "forkyard_request_id", None) or request_id(request)
    for name, value in getattr(request, "forkyard_headers", {}).items():
        response[name] = value
    return response


class DependencyErrorsMiddleware:
    """Every response names its region; an outage is a 503 with Retry-After."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[..., Any]) -> None:
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if iscoroutinefunction(self):
            return self._acall(request)
        request_id(request)
        try:
            response = self.get_response(request)
        except Exception as error:
            if not dependency_error(error):
                raise
            response = outage_response(request, error)
        return decorate(request, response)

    async def _acall(self, request: HttpRequest) -> HttpResponse:
        request_id(request)
        try:
            response = await self.get_response(request)
        except Exception as error:
            if not dependency_error(error):
                raise
            response = outage_response(request, error)
        return decorate(request, response)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if dependency_error(exception):
            return outage_response(request, exception)
        return None
