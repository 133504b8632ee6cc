"""Websocket routes."""

from __future__ import annotations

from django.urls import path

from sandboxes.api.port_tunnel import PortTunnelConsumer
from sandboxes.api.pty import ProcessConsumer
from sandboxes.board.consumer import BoardConsumer
from sandboxes.views.live_view import LiveViewConsumer
from sandboxes.views.terminal import TerminalConsumer

websocket_urlpatterns = [
    # django-stubs types path() for views only; channels routes ASGI applications the same way.
    path("ws/board/<str:launch_id>/", BoardConsumer.as_asgi()),  # type: ignore[arg-type]
    # The console's terminal: the API's pty socket, signed in by the session (sandboxes/views/terminal.py).
    path("ws/terminal/<str:sandbox_id>/<int:pid>/", TerminalConsumer.as_asgi()),  # type: ignore[arg-type]
    # The console's live view of a desktop: its VNC server's bytes, signed in by the session (sandboxes/views/live_view.py).
    path("ws/desktop/<str:sandbox_id>/<str:mode>/", LiveViewConsumer.as_asgi()),  # type: ignore[arg-type]
]

# The API's websockets: authenticated by the API key in a header (no session, no cookie).
api_websocket_urlpatterns = [
    path("api/v1/sandboxes/<str:sandbox_id>/processes/<int:pid>/pty", ProcessConsumer.as_asgi()),  # type: ignore[arg-type]
    path("api/v1/sandboxes/<str:sandbox_id>/ports/<int:port>/connect", PortTunnelConsumer.as_asgi()),  # type: ignore[arg-type]
]
