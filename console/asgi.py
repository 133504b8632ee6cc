"""ASGI entry points: HTTP (the API and the console) and websockets (the board).

Two servers, each doing what it is good at:

* ``http_application``, served by uvicorn (uvloop, httptools): the API and the
  console's pages.  uvicorn hands a request's body over as it arrives, so the
  API refuses a request before reading its body (no key, over its rate
  limit, over its size: ``console.bodies``) and streams uploads on to the
  sandbox's engine without holding them.  Daphne (Twisted) reads every body
  whole, to memory and a temporary file, before the application sees the
  request: a 1 GiB PUT without a key cost the web server 1 GiB and 2 GiB.
* Either one first sends a request whose Host names a preview URL
  (``{port}-{sandbox}.{FORKYARD_PREVIEW_DOMAIN}``) to the sandbox's exposed
  port (``sandboxes/api/preview.py``): HTTP and websockets, proxied.
* ``websocket_application``, served by Daphne: the board's websocket
  (Channels; the board page connects to it at ``FORKYARD_WEBSOCKET_URL``),
  and the API's (a background process's terminal: ``sandboxes/api/pty.py``).

``application`` is both, for a single ASGI server (``runserver``, or Daphne
alone) where the bodies' protections above matter less than one process.

The API has a Django handler of its own whose middleware is only the async
one (``API_MIDDLEWARE``): the console's stack (sessions, CSRF, messages,
WhiteNoise) is sync, and in an async server each sync middleware costs a hop
to a thread and back on every request.
"""

import os
import re
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from typing import Any
from urllib.parse import parse_qs

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

from asgiref.sync import ThreadSensitiveContext, sync_to_async  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402

get_asgi_application()  # sets Django up before anything below imports models

from channels.auth import AuthMiddlewareStack  # noqa: E402
from django.conf import settings  # noqa: E402
from django.core import signals  # noqa: E402
from django.core.exceptions import RequestAborted  # noqa: E402
from django.core.handlers.asgi import ASGIHandler, get_script_prefix  # noqa: E402
from django.urls import set_script_prefix  # noqa: E402

from console.api_base import check_key, status_of  # noqa: E402
from console.authorize import authorize  # noqa: E402
from console.bodies import (  # noqa: E402
    CONSOLE_RULE,
    BodyRule,
    StreamedBody,
    declared_length,
    header,
    read_bounded,
    rule_for,
    send_refusal,
    too_large,
)
from console.contract import unknown_parameter  # noqa: E402
from console.errors import Refused, TooLarge  # noqa: E402
from console.middleware import OUTAGE, RETRY_AFTER_S, dependency_error  # noqa: E402
from console.routing import api_websocket_urlpatterns, websocket_urlpatterns  # noqa: E402
from grading.api import fast as inference  # noqa: E402
from sandboxes.api import hot_path, preview  # noqa: E402

# An ASGI application's arguments, as Django's handler takes them.
Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[Mapping[str, Any]], Awaitable[None]]
Scope = dict[str, Any]

PUBLIC = re.compile(r"^/api/v1/(openapi\.json|docs)(/.*)?$")  # the API's description: no key needed
_rule: ContextVar[BodyRule] = ContextVar("body_rule", default=CONSOLE_RULE)


class BoundedHandler(ASGIHandler):
    """Django's ASGI handler, reading at most the current rule's bytes of a body."""

    async def read_body(self, receive: Receive) -> Any:
        return await read_bounded(receive, _rule.get().limit)

    async def handle_bounded(self, scope: Scope, receive: Receive, send: Send, rule: BodyRule) -> None:
        token = _rule.set(rule)
        try:
            async with ThreadSensitiveContext():  # as Django's own __call__: a request's sync code off the shared thread
                await self.handle(scope, receive, send)
        except TooLarge as error:
            await send_refusal(send, scope, 413, error.body())
        finally:
            _rule.reset(token)


class ConsoleHandler(BoundedHandler):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        length = declared_length(scope)
        if length is not None and length > CONSOLE_RULE.limit:
            await send_refusal(send, scope, 413, too_large(CONSOLE_RULE.limit).body())
            return
        await self.handle_bounded(scope, receive, send, CONSOLE_RULE)


class ApiHandler(BoundedHandler):
    """The API: ``API_MIDDLEWARE`` in place of ``MIDDLEWARE``, and requests refused before their bodies are read."""

    def load_middleware(self, is_async: bool = False) -> None:
        console_middleware = settings.MIDDLEWARE
        settings.MIDDLEWARE = settings.API_MIDDLEWARE
        try:
            super().load_middleware(is_async)
        finally:
            settings.MIDDLEWARE = console_middleware

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rule = rule_for(scope["method"], scope["path"])
        if not PUBLIC.match(scope["path"]) and not await self.authenticate(scope, send):
            return
        unknown = unknown_parameter(scope)
        if unknown is not None:
            await send_refusal(send, scope, 400, unknown.body())
            return
        length = declared_length(scope)
        if length is not None and length > rule.limit:
            await send_refusal(send, scope, 413, too_large(rule.limit).body())
            return
        if inference.route(scope):  # the inference gateway (grading/api/fast.py): async end to end
            await self.handle_inference(scope, receive, send, rule)
            return
        hot = hot_path.route(scope, length)
        if hot is not None:
            await self.handle_hot(scope, receive, send, rule, hot)
        elif rule.streamed:
            await self.handle_streamed(scope, receive, send, rule)
        else:
            await self.handle_bounded(scope, receive, send, rule)

    @staticmethod
    async def whole_body(scope: Scope, receive: Receive, send: Send, rule: BodyRule) -> bytes | None:
        """The whole (bounded) body; None once answered 413, or when the caller left."""
        try:
            return (await read_bounded(receive, rule.limit)).getvalue()
        except TooLarge as error:
            await send_refusal(send, scope, 413, error.body())
        except RequestAborted:
            pass
        return None

    async def handle_inference(self, scope: Scope, receive: Receive, send: Send, rule: BodyRule) -> None:
        body = await self.whole_body(scope, receive, send, rule)
        if body is not None:
            await inference.answer(scope, body, receive, send)

    async def handle_hot(self, scope: Scope, receive: Receive, send: Send, rule: BodyRule, call: hot_path.Call) -> None:
        """The hot path answers ``call`` if it can; else the view, with the (bounded) body already read."""
        body = await self.whole_body(scope, receive, send, rule)
        if body is None:
            return
        if await hot_path.answer(call, scope, body, receive, send):
            return
        sent = False

        async def replay() -> Mapping[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        if rule.streamed:
            await self.handle_streamed(scope, replay, send, rule)
        else:
            await self.handle_bounded(scope, replay, send, rule)

    async def authenticate(self, scope: Scope, send: Send) -> bool:
        """Check the key and count the request from the headers alone; answer and return False if refused."""
        scheme, _, token = header(scope, b"authorization").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            await _unauthorized(send, scope)
            return False
        try:
            key, verdict = await check_key(token.strip())
        except Exception as error:
            if not dependency_error(error):
                raise
            await send_refusal(send, scope, 503, OUTAGE, {"Retry-After": str(RETRY_AFTER_S)})
            return False
        if key is None or verdict is None:
            await _unauthorized(send, scope)
            return False
        if not verdict.allowed:
            refusal = verdict.refusal()
            headers = {**verdict.headers(), "Retry-After": str(refusal.retry_after_s)}
            await send_refusal(send, scope, status_of(refusal), refusal.body(), headers)
            return False
        # What the key may do (console.permissions: its role, scopes and label limit), from the path alone.
        refused = await authorize(key, scope["method"], scope["path"], parse_qs(scope.get("query_string", b"").decode("latin1")))
        if refused is not None:
            await send_refusal(send, scope, status_of(refused), refused.body(), verdict.headers())
            return False
        scope["forkyard.auth"] = (key, verdict)  # ApiKeyAuth takes it from here: one check per request
        return True

    async def handle_streamed(self, scope: Scope, receive: Receive, send: Send, rule: BodyRule) -> None:
        """Django's handling without its body read: the view reads the body (``request.body_stream``) as it arrives.

        No task listens for the client leaving meanwhile (it would take the
        body's messages): reading the body notices that instead.
        """
        async with ThreadSensitiveContext():
            await self._handle_streamed(scope, receive, send, rule)

    async def _handle_streamed(self, scope: Scope, receive: Receive, send: Send, rule: BodyRule) -> None:
        body = StreamedBody(receive, rule.limit)
        set_script_prefix(get_script_prefix(scope))
        await signals.request_started.asend(sender=self.__class__, scope=scope)
        request, error_response = self.create_request(scope, body)  # type: ignore[arg-type]  # read by chunks()
        if request is None:
            assert error_response is not None
            await self.send_response(error_response, send)
            return
        request.body_stream = body  # type: ignore[attr-defined]  # read by sandboxes.api.data
        try:
            response = await self.run_get_response(request)
        except RequestAborted:
            return
        await self.send_response(response, send)
        await sync_to_async(response.close)()


async def _unauthorized(send: Send, scope: Scope) -> None:
    refusal = Refused("unauthorized", "a valid API key is required: Authorization: Bearer <key>")
    await send_refusal(send, scope, 401, refusal.body(), {"WWW-Authenticate": "Bearer"})


api_application = ApiHandler()
console_application = ConsoleHandler()


async def http_application(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        return  # nothing to start or stop
    target = preview.target_of(scope)
    if target is not None:  # a sandbox's exposed port, by its Host (sandboxes/api/preview.py)
        await preview.serve(scope, receive, send, target)
        return
    if scope["type"] == "websocket":
        await _websockets(scope, receive, send)
        return
    handler = api_application if scope["path"].startswith(settings.API_PREFIX) else console_application
    await handler(scope, receive, send)


async def _websockets_only(scope: Scope, receive: Receive, send: Send) -> None:
    await send_refusal(send, scope, 404, {"error": {"code": "not_found", "message": "this server carries websockets only"}})


# The stubs want channels' own pattern type, which only they know: Django's path() makes these.
_board_websockets = AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))  # type: ignore[arg-type]
# The API's (a process's terminal, sandboxes/api/pty.py) take the API key from a header: no session
# or cookie is read, and a page cannot set that header, so there is no origin to check.
_api_websockets = URLRouter(api_websocket_urlpatterns)  # type: ignore[arg-type]


async def _websockets(scope: Scope, receive: Receive, send: Send) -> None:
    target = preview.target_of(scope)
    if target is not None:
        await preview.serve(scope, receive, send, target)
        return
    # Any: channels' stubs type scopes and events as their own TypedDicts, which Django's handler does not use.
    application: Any = _api_websockets if scope["path"].startswith(settings.API_PREFIX) else _board_websockets
    await application(scope, receive, send)


websocket_application = ProtocolTypeRouter({"http": _websockets_only, "websocket": _websockets})
application = ProtocolTypeRouter({"http": http_application, "websocket": websocket_application})
