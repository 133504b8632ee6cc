"""Websocket routes (the live launch board lives in sandboxes.consumers)."""

from __future__ import annotations

websocket_urlpatterns: list = []
