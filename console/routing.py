"""Websocket routes."""

from __future__ import annotations

from django.urls import path

from sandboxes.consumers import BoardConsumer

websocket_urlpatterns = [
    # django-stubs types path() for views only; channels routes ASGI applications the same way.
    path("ws/board/<str:launch_id>/", BoardConsumer.as_asgi()),  # type: ignore[arg-type]
]
