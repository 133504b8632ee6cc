"""The pass-through: one OpenAI-compatible call to an upstream or a model server, on httpx, async.

No gateway framework: a POST of the request (the model renamed to the
server's own name, the server's secret as the key) on a pooled connection,
and its answer read as JSON or as server-sent events. What can go wrong
becomes one refusal each, with a stable code:

| what happened | answer |
| --- | --- |
| no connection (refused, unreachable, DNS) | 502 ``upstream_unreachable`` |
| no answer, or no next chunk, within the route's timeout | 504 ``upstream_timeout`` |
| a 5xx, a body that is not JSON, a stream that stops early | 502 ``upstream_error`` |
| a 429 | 429 ``upstream_rate_limited`` (its Retry-After) |
| another 4xx | its status, ``upstream_refused``, with its message |

Nothing here logs a request or an answer: only the route and the outcome.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from console.errors import InvalidRequest, NotFound, OverLimit, Refused, UpstreamFailed, UpstreamTimeout

from .selectors import Route

CONNECT_TIMEOUT_S = 5.0
_clients: dict[tuple[int, float], httpx.AsyncClient] = {}


def client_for(route: Route) -> httpx.AsyncClient:
    """One pooled client per event loop and timeout (connections kept alive between calls)."""
    key = (id(asyncio.get_running_loop()), route.timeout_s)
    client = _clients.get(key)
    if client is None or client.is_closed:
        client = _clients[key] = httpx.AsyncClient(
            timeout=httpx.Timeout(route.timeout_s, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128, keepalive_expiry=30),
            follow_redirects=False,
        )
    return client


def _headers(route: Route) -> dict[str, str]:
    headers = {"content-type": "application/json", "accept": "application/json, text/event-stream"}
    if route.secret:
        headers["authorization"] = f"Bearer {route.secret}"
    return headers


def _where(route: Route) -> str:
    return f"dedicated endpoint {route.endpoint_id}" if route.endpoint_id else f"the upstream serving {route.model!r}"


def transport_failure(route: Route, error: httpx.HTTPError) -> Refused:
    details = {"model": route.model}
    if isinstance(error, httpx.TimeoutException) and not isinstance(error, httpx.ConnectTimeout):
        return UpstreamTimeout(
            "upstream_timeout", f"{_where(route)} did not answer within {route.timeout_s:g} s", details=details, retry_after_s=1
        )
    if isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout)):
        return UpstreamFailed("upstream_unreachable", f"{_where(route)} cannot be reached", details=details, retry_after_s=1)
    return UpstreamFailed("upstream_error", f"{_where(route)} broke off its answer ({type(error).__name__})", details=details)


def status_failure(route: Route, status: int, body: bytes, retry_after: str | None) -> Refused:
    """The refusal for an upstream's error answer: its own message where it gave one (the caller's to see)."""
    message = ""
    try:
        error = json.loads(body).get("error")
        message = str(error.get("message") if isinstance(error, dict) else error or "")[:500]
    except (ValueError, AttributeError):
        pass
    details = {"model": route.model, "upstream_status": status}
    if status == 429:
        seconds = int(retry_after) if retry_after and retry_after.isdigit() else 1
        return OverLimit("upstream_rate_limited", message or f"{_where(route)} is over its rate", details=details, retry_after_s=seconds)
    if status >= 500 or status < 400:
        return UpstreamFailed("upstream_error", f"{_where(route)} answered {status}" + (f": {message}" if message else ""), details=details)
    if status == 404:
        return NotFound("upstream_refused", message or f"{_where(route)} does not know the model", details=details)
    refusal = InvalidRequest("upstream_refused", message or f"{_where(route)} refused the request ({status})", details=details)
    refusal.status = status  # type: ignore[attr-defined]  # kept for the caller: a 400, 401, 413, 422 of the upstream's
    return refusal


async def complete(route: Route, body: dict[str, Any]) -> dict[str, Any]:
    """A non-streaming completion: the upstream's JSON answer, or a refusal."""
    try:
        response = await client_for(route).post(f"{route.base_url}/chat/completions", content=_encode(route, body), headers=_headers(route))
    except httpx.HTTPError as error:
        raise transport_failure(route, error) from None
    if response.status_code != 200:
        raise status_failure(route, response.status_code, response.content, response.headers.get("retry-after"))
    try:
        answer = response.json()
    except ValueError:
        raise UpstreamFailed("upstream_error", f"{_where(route)} answered with something that is not JSON") from None
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        raise UpstreamFailed("upstream_error", f"{_where(route)} answered with something that is not a chat completion")
    return answer


async def stream(route: Route, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """A streaming completion's chunks, as dicts, until ``[DONE]``; a refusal before the first, or mid-way."""
    request = client_for(route).build_request(
        "POST", f"{route.base_url}/chat/completions", content=_encode(route, body), headers=_headers(route)
    )
    try:
        response = await client_for(route).send(request, stream=True)
    except httpx.HTTPError as error:
        raise transport_failure(route, error) from None
    try:
        if response.status_code != 200:
            raise status_failure(route, response.status_code, await response.aread(), response.headers.get("retry-after"))
        finished = False
        try:
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    finished = True
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    raise UpstreamFailed("upstream_error", f"{_where(route)} sent an event that is not JSON") from None
                if isinstance(chunk, dict) and chunk.get("error"):
                    raise status_failure(route, 502, json.dumps(chunk).encode(), None)
                if isinstance(chunk, dict):
                    yield chunk
        except httpx.HTTPError as error:
            raise transport_failure(route, error) from None
        if not finished:
            raise UpstreamFailed("upstream_error", f"{_where(route)} ended its stream before [DONE]")
    finally:
        await response.aclose()


def _encode(route: Route, body: dict[str, Any]) -> bytes:
    return json.dumps({**body, "model": route.target_model}, separators=(",", ":")).encode()
