"""ASGI entry point: Daphne serves HTTP (Django) and websockets (Channels).

The API gets a Django handler of its own, with only async middleware: the
console's stack (sessions, CSRF, messages, WhiteNoise) is sync, and in an
async server each sync middleware costs a hop to a thread and back on every
request, several times over. The API authenticates by key and needs none of
it; with them, an exec of `true` spent most of its time in those hops.
"""

import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402

django_application = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from django.conf import settings  # noqa: E402
from django.core.handlers.asgi import ASGIHandler  # noqa: E402

from console.routing import websocket_urlpatterns  # noqa: E402


class ApiHandler(ASGIHandler):
    """Django's ASGI handler with ``API_MIDDLEWARE`` in place of ``MIDDLEWARE``."""

    def load_middleware(self, is_async: bool = False) -> None:
        console_middleware = settings.MIDDLEWARE
        settings.MIDDLEWARE = settings.API_MIDDLEWARE
        try:
            super().load_middleware(is_async)
        finally:
            settings.MIDDLEWARE = console_middleware


api_application = ApiHandler()


# An ASGI application's arguments, as Django's handler takes them.
Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[Mapping[str, Any]], Awaitable[None]]


async def http(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    handler = api_application if scope["path"].startswith(settings.API_PREFIX) else django_application
    await handler(scope, receive, send)


application = ProtocolTypeRouter(
    {
        "http": http,
        # The stubs want channels' own pattern type, which only they know: Django's path() makes these.
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),  # type: ignore[arg-type]
    }
)
