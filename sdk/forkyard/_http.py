"""HTTP for the SDK: settings, the retry policy, and the sync and async senders.

A ``Call`` describes one request.  ``RetryPolicy`` decides, without doing any
I/O, whether a failed attempt may be tried again and after how long; the two
senders (``Sender`` over ``httpx.Client``, ``AsyncSender`` over
``httpx.AsyncClient``) only run that decision.

What is retried:
- 429 always: the API refuses over-limit requests before doing anything.
- 503 (and 502/504 from a proxy) only for idempotent calls: GET, PUT, DELETE,
  and creates that carry an ``idempotency_key`` (the API guarantees a repeated
  key creates nothing new).  A 503 whose error names the sandbox it recorded
  (a create that failed on its host) is final: a retry would only return it.
- A connection that could not be opened, for every call (nothing was sent);
  a connection lost after sending, only for idempotent calls.
Retry-After is honoured up to ``max_retry_after_s``; all the waits of one call
together stay within ``budget_s``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import quote

import httpx

from ._version import __version__
from .errors import ConfigurationError, ForkyardError, Unavailable, error_from_response

DEFAULT_URL = "http://127.0.0.1:8000"
API_PREFIX = "/api/v1"
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
RETRIED_STATUSES = frozenset({502, 503, 504})
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


@dataclass(frozen=True)
class Call:
    """One API request: what to send, and whether repeating it is harmless."""

    method: str
    path: str
    params: Mapping[str, Any] | None = None
    json: Any = None
    content: Any = None
    read_timeout_s: float | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    sandbox: str | None = None  # a data-path call (exec, a file) of this sandbox: its host's gateway may answer it

    @property
    def idempotent(self) -> bool:
        if self.method in IDEMPOTENT_METHODS:
            return True
        return isinstance(self.json, Mapping) and bool(self.json.get("idempotency_key"))

    @property
    def replayable(self) -> bool:
        """False for a streamed body (a file object, an iterator): it cannot be sent twice."""
        return self.content is None or isinstance(self.content, bytes | str)

    def request(
        self, http: httpx.Client | httpx.AsyncClient, default_timeout: httpx.Timeout, route: Route | None = None
    ) -> httpx.Request:
        """The request to the API, or, with a ``route``, to the sandbox's host's gateway with its data token."""
        params = {name: value for name, value in (self.params or {}).items() if value is not None}
        timeout = default_timeout
        if self.read_timeout_s is not None:
            timeout = httpx.Timeout(
                default_timeout.connect, read=self.read_timeout_s, write=default_timeout.write, pool=default_timeout.pool
            )
        content = self.content
        if hasattr(content, "read"):
            content = _file_chunks(content, asynchronous=isinstance(http, httpx.AsyncClient))
        headers = dict(self.headers)
        if route is not None:
            headers["Authorization"] = f"Bearer {route.token}"
        return http.build_request(
            self.method,
            (route.url if route is not None else "") + API_PREFIX + self.path,
            params=params,
            json=self.json,
            content=content,
            headers=headers,
            timeout=timeout,
        )


@dataclass(frozen=True)
class Route:
    """Where one sandbox's commands and files go: its host's gateway, with a data token (the API's ``data_path``)."""

    url: str
    token: str
    expires_at: float  # Unix time


class DataRoutes:
    """What the client knows of each sandbox's data path, learnt from the API's answers about it.

    A command or a file of a sandbox goes straight to its host when its route is
    known and has ``MARGIN_S`` left; else through the API, which answers the
    same. A sandbox the client knows nothing of yet (``sandboxes.ref(id)``) is
    looked up once (``GET /sandboxes/{id}``), then not again for ``AGAIN_S``.
    A gateway that cannot be reached is left alone for ``AGAIN_S``; a token it
    refuses (expired, revoked) is forgotten. ``enabled=False``: the API only.
    """

    MARGIN_S = 30.0
    AGAIN_S = 30.0

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.routes: dict[str, Route] = {}
        self.unreachable: dict[str, float] = {}  # gateway url -> until
        self.looked_up: dict[str, float] = {}  # sandbox id -> until
        self.direct = 0  # calls the gateways answered (for tests and curious users)

    def learn(self, data: Mapping[str, Any]) -> None:
        found = data.get("data_path") if self.enabled else None
        sandbox = data.get("id")
        if not isinstance(sandbox, str):
            return
        if not isinstance(found, Mapping):
            if data.get("state") not in (None, "running", "paused"):
                self.routes.pop(sandbox, None)  # ended: nothing to reach
            return
        try:
            expires_at = datetime.fromisoformat(str(found["expires_at"]).replace("Z", "+00:00")).timestamp()
            route = Route(str(found["url"]).rstrip("/"), str(found["token"]), expires_at)
        except (KeyError, ValueError):
            return
        if len(self.routes) > 100_000:
            self.routes.clear()
        self.routes[sandbox] = route

    def route(self, sandbox: str | None) -> Route | None:
        if sandbox is None or not self.enabled:
            return None
        route = self.routes.get(sandbox)
        now = time.time()
        if route is None or route.expires_at - now < self.MARGIN_S or self.unreachable.get(route.url, 0) > now:
            return None
        return route

    def should_look_up(self, sandbox: str | None) -> bool:
        """Whether to ask the API for this sandbox's route before its call (at most once per ``AGAIN_S``)."""
        if sandbox is None or not self.enabled or self.route(sandbox) is not None:
            return False
        known = self.routes.get(sandbox)
        if known is not None and self.unreachable.get(known.url, 0) > time.time():
            return False
        if self.looked_up.get(sandbox, 0) > time.monotonic():
            return False
        if len(self.looked_up) > 100_000:
            self.looked_up.clear()
        self.looked_up[sandbox] = time.monotonic() + self.AGAIN_S
        return True

    def gone(self, route: Route) -> None:
        """The gateway could not be reached: the API answers meanwhile."""
        self.unreachable[route.url] = time.time() + self.AGAIN_S

    def refused(self, sandbox: str | None, route: Route) -> None:
        """The gateway refused the token (expired, revoked, not its own): forget it."""
        if sandbox is not None and self.routes.get(sandbox) == route:
            del self.routes[sandbox]


def refused_token(response: httpx.Response, body: bytes) -> bool:
    """A gateway's 401 for its data token (rather than an answer of the call)."""
    if response.status_code != 401:
        return False
    try:
        return str(json.loads(body)["error"]["code"]).startswith("data_token")
    except (ValueError, KeyError, TypeError):
        return False


UPLOAD_CHUNK = 256 * 1024


def _file_chunks(file: Any, *, asynchronous: bool) -> Iterator[bytes] | AsyncIterator[bytes]:
    """A binary file as a chunked body.  httpx would send a file with the length ``fstat`` gives,
    which is 0 for a pipe (``forkyard files write ... < /dev/stdin``); chunks need no length."""

    def chunks() -> Iterator[bytes]:
        while chunk := file.read(UPLOAD_CHUNK):
            yield chunk

    async def async_chunks() -> AsyncIterator[bytes]:
        for chunk in chunks():
            yield chunk

    return async_chunks() if asynchronous else chunks()


@dataclass(frozen=True)
class RetryPolicy:
    """How failed attempts are retried; ``max_retries=0`` disables retries."""

    max_retries: int = 5
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    max_retry_after_s: float = 30.0
    budget_s: float = 120.0

    def backoff(self, attempt: int) -> float:
        """Exponential backoff with full jitter, for failures that name no wait."""
        return random.uniform(0, min(self.max_backoff_s, self.backoff_s * (2**attempt)))

    def _within_budget(self, delay: float, attempt: int, elapsed_s: float) -> float | None:
        if attempt >= self.max_retries or elapsed_s + delay > self.budget_s:
            return None
        return delay

    def after_failure(self, call: Call, error: ForkyardError, attempt: int, elapsed_s: float) -> float | None:
        """Seconds to wait before retrying an error answer, or None to give up."""
        if not call.replayable:
            return None
        if error.status == 429:
            # Over a rate or a quota: it frees with time. Not a sandbox's process limit: only a
            # process ending frees that, and waiting blindly for one helps nobody.
            retryable = error.code != "too_many_processes"
        elif error.status in RETRIED_STATUSES:
            retryable = call.idempotent and "sandbox" not in error.details
        else:
            retryable = False
        if not retryable:
            return None
        delay = error.retry_after if error.retry_after is not None else self.backoff(attempt)
        return self._within_budget(min(delay, self.max_retry_after_s), attempt, elapsed_s)

    def after_transport_error(self, call: Call, error: httpx.TransportError, attempt: int, elapsed_s: float) -> float | None:
        """Seconds to wait before retrying after no answer came, or None to give up."""
        if not call.replayable or not (isinstance(error, NOT_SENT) or call.idempotent):
            return None
        return self._within_budget(self.backoff(attempt), attempt, elapsed_s)


@dataclass(frozen=True)
class RateLimit:
    """The caller's request-rate limit as the last response reported it."""

    limit: int
    remaining: int
    reset_s: int

    @classmethod
    def from_headers(cls, headers: httpx.Headers) -> RateLimit | None:
        try:
            return cls(
                int(headers["X-RateLimit-Limit"]), int(headers["X-RateLimit-Remaining"]), int(headers["X-RateLimit-Reset"])
            )
        except (KeyError, ValueError):
            return None


@dataclass(frozen=True)
class Settings:
    """Where the API is, how to authenticate, and how patient to be."""

    url: str
    api_key: str
    timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    direct: bool = True  # commands and files straight to each sandbox's host (DataRoutes)

    @classmethod
    def resolve(
        cls,
        url: str | None,
        api_key: str | None,
        *,
        timeout_s: float,
        max_retries: int | None,
        retry: RetryPolicy | None,
        direct: bool | None = None,
    ) -> Settings:
        """Explicit arguments first, then FORKYARD_URL, FORKYARD_API_KEY and FORKYARD_DIRECT (0: through the API only)."""
        url = url or os.environ.get("FORKYARD_URL") or DEFAULT_URL
        api_key = api_key or os.environ.get("FORKYARD_API_KEY")
        if not api_key:
            raise ConfigurationError("configuration", "no API key: pass api_key= or set FORKYARD_API_KEY")
        if not url.startswith(("http://", "https://")):
            raise ConfigurationError("configuration", f"the URL {url!r} must start with http:// or https://")
        url = url.rstrip("/").removesuffix(API_PREFIX)
        policy = retry or RetryPolicy()
        if max_retries is not None:
            policy = RetryPolicy(
                max_retries=max_retries,
                backoff_s=policy.backoff_s,
                max_backoff_s=policy.max_backoff_s,
                max_retry_after_s=policy.max_retry_after_s,
                budget_s=policy.budget_s,
            )
        if direct is None:
            direct = os.environ.get("FORKYARD_DIRECT", "1") != "0"
        return cls(url=url, api_key=api_key, timeout_s=timeout_s, retry=policy, direct=direct)

    def client_options(self) -> dict[str, Any]:
        return {
            "base_url": self.url,
            "headers": {"Authorization": f"Bearer {self.api_key}", "User-Agent": f"forkyard-python/{__version__}"},
            "timeout": self.timeout(),
        }

    def timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s)


def unreachable(settings: Settings, error: httpx.TransportError) -> Unavailable:
    return Unavailable("connection_failed", f"no answer from {settings.url}: {type(error).__name__}: {error}".rstrip(": "))


def decode_json(content: bytes) -> Any:
    try:
        return json.loads(content) if content else None
    except ValueError as error:
        raise ForkyardError("invalid_response", f"the server answered something that is not JSON: {content[:120]!r}") from error


class Attempts:
    """The attempts of one call: builds each request, and says how long to wait before the next or raises."""

    def __init__(self, settings: Settings, call: Call) -> None:
        self.settings, self.call = settings, call
        self.started, self.count = time.monotonic(), 0

    def request(self, http: httpx.Client | httpx.AsyncClient, route: Route | None = None) -> httpx.Request:
        return self.call.request(http, self.settings.timeout(), route)

    def delay_after(self, failure: ForkyardError | httpx.TransportError) -> float:
        """Seconds to wait before the next attempt; raises the typed error when there is none."""
        policy, elapsed = self.settings.retry, time.monotonic() - self.started
        if isinstance(failure, httpx.TransportError):
            delay = policy.after_transport_error(self.call, failure, self.count, elapsed)
            if delay is None:
                raise unreachable(self.settings, failure) from failure
        else:
            delay = policy.after_failure(self.call, failure, self.count, elapsed)
            if delay is None:
                raise failure
        self.count += 1
        return delay


class Sender:
    """Sends calls through an ``httpx.Client``, retrying as the policy allows; a sandbox's commands and files
    go straight to its host when its route is known (``DataRoutes``)."""

    def __init__(self, settings: Settings, transport: httpx.BaseTransport | None = None) -> None:
        self.settings = settings
        self.http = httpx.Client(transport=transport, **settings.client_options())
        self.rate_limit: RateLimit | None = None
        self.routes = DataRoutes(settings.direct)

    def _route(self, call: Call) -> Route | None:
        if self.routes.should_look_up(call.sandbox):
            try:
                self.routes.learn(self.json(Call("GET", f"/sandboxes/{quote(str(call.sandbox), safe='')}")))
            except ForkyardError:
                pass  # the call itself, through the API, says what is wrong
        return self.routes.route(call.sandbox)

    def open(self, call: Call) -> httpx.Response:
        """The first 2xx answer, its body not yet read; a typed error otherwise."""
        attempts = Attempts(self.settings, call)
        while True:
            route = self._route(call) if call.replayable else None  # a streamed body cannot be sent twice
            try:
                response = self.http.send(attempts.request(self.http, route), stream=True)
                if not response.is_success:
                    try:
                        body = response.read()
                    finally:
                        response.close()
            except httpx.TransportError as error:
                if route is not None and isinstance(error, NOT_SENT):
                    self.routes.gone(route)  # nothing was sent: the API answers it now
                    continue
                time.sleep(attempts.delay_after(error))
                continue
            if route is not None and not response.is_success and refused_token(response, body):
                self.routes.refused(call.sandbox, route)
                continue  # nothing ran: the API answers it now
            self.rate_limit = RateLimit.from_headers(response.headers) or self.rate_limit
            if response.is_success:
                self.routes.direct += route is not None
                return response
            time.sleep(attempts.delay_after(error_from_response(response.status_code, response.headers, body)))

    def content(self, call: Call) -> bytes:
        with self.stream(call) as response:
            return response.read()

    def json(self, call: Call) -> Any:
        return decode_json(self.content(call))

    @contextmanager
    def stream(self, call: Call) -> Iterator[httpx.Response]:
        """The open 2xx response of ``call``; a connection lost while reading it is ``Unavailable``."""
        response = self.open(call)
        try:
            yield response
        except httpx.TransportError as error:
            raise unreachable(self.settings, error) from error
        finally:
            response.close()

    def close(self) -> None:
        self.http.close()


class AsyncSender:
    """Sends calls through an ``httpx.AsyncClient``, retrying as the policy allows; a sandbox's commands and
    files go straight to its host when its route is known (``DataRoutes``)."""

    def __init__(self, settings: Settings, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
        self.http = httpx.AsyncClient(transport=transport, **settings.client_options())
        self.rate_limit: RateLimit | None = None
        self.routes = DataRoutes(settings.direct)

    async def _route(self, call: Call) -> Route | None:
        if self.routes.should_look_up(call.sandbox):
            try:
                self.routes.learn(await self.json(Call("GET", f"/sandboxes/{quote(str(call.sandbox), safe='')}")))
            except ForkyardError:
                pass  # the call itself, through the API, says what is wrong
        return self.routes.route(call.sandbox)

    async def open(self, call: Call) -> httpx.Response:
        """The first 2xx answer, its body not yet read; a typed error otherwise."""
        attempts = Attempts(self.settings, call)
        while True:
            route = await self._route(call) if call.replayable else None  # a streamed body cannot be sent twice
            try:
                response = await self.http.send(attempts.request(self.http, route), stream=True)
                if not response.is_success:
                    try:
                        body = await response.aread()
                    finally:
                        await response.aclose()
            except httpx.TransportError as error:
                if route is not None and isinstance(error, NOT_SENT):
                    self.routes.gone(route)  # nothing was sent: the API answers it now
                    continue
                await asyncio.sleep(attempts.delay_after(error))
                continue
            if route is not None and not response.is_success and refused_token(response, body):
                self.routes.refused(call.sandbox, route)
                continue  # nothing ran: the API answers it now
            self.rate_limit = RateLimit.from_headers(response.headers) or self.rate_limit
            if response.is_success:
                self.routes.direct += route is not None
                return response
            await asyncio.sleep(attempts.delay_after(error_from_response(response.status_code, response.headers, body)))

    async def content(self, call: Call) -> bytes:
        async with self.stream(call) as response:
            return await response.aread()

    async def json(self, call: Call) -> Any:
        return decode_json(await self.content(call))

    @asynccontextmanager
    async def stream(self, call: Call) -> AsyncIterator[httpx.Response]:
        """The open 2xx response of ``call``; a connection lost while reading it is ``Unavailable``."""
        response = await self.open(call)
        try:
            yield response
        except httpx.TransportError as error:
            raise unreachable(self.settings, error) from error
        finally:
            await response.aclose()

    async def close(self) -> None:
        await self.http.aclose()
