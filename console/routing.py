"""Websocket routes."""

from __future__ import annotations

from django.urls import path

from sandboxes.consumers import BoardConsumer

websocket_urlpatterns = [
    path("ws/board/<str:launch_id>/", BoardConsumer.as_asgi()),
]
