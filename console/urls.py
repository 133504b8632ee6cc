"""URLs: the public API under /api/v1, the console, the admin."""

from __future__ import annotations

from django.contrib import admin
from django.urls import path

from billing.api import router as usage_router
from sandboxes.api import policies as policy_router
from sandboxes.api import router as sandbox_router

from .api import router as account_router
from .api_base import api

api.add_router("", sandbox_router)
api.add_router("", policy_router)
api.add_router("", usage_router)
api.add_router("", account_router)

urlpatterns = [
    path("api/v1/", api.urls),
    path("admin/", admin.site.urls),
]
