"""URLs: the public API under /api/v1, the console, the admin."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import URLPattern, URLResolver, include, path

from billing import views as billing_views
from billing.api import router as usage_router
from sandboxes import board_urls
from sandboxes import views as sandbox_views
from sandboxes.api import policies as policy_router
from sandboxes.api import router as sandbox_router

from . import views, views_account
from .api import router as account_router
from .api_base import api as api  # re-exported: the API once every router below is mounted on it

api.add_router("", sandbox_router)
api.add_router("", policy_router)
api.add_router("", usage_router)
api.add_router("", account_router)

console_patterns: list[URLPattern | URLResolver] = [
    path("", views.overview, name="overview"),
    path("team/switch/", views.switch_team, name="switch-team"),
    path("invitations/<str:token>/", views.invitation, name="invitation"),
    path("sandboxes/", sandbox_views.sandbox_list, name="sandboxes"),
    path("sandboxes/<str:sandbox_id>/", sandbox_views.sandbox_detail, name="sandbox"),
    path("sandboxes/<str:sandbox_id>/exec/", sandbox_views.sandbox_exec, name="sandbox-exec"),
    path("sandboxes/<str:sandbox_id>/kill/", sandbox_views.sandbox_kill, name="sandbox-kill"),
    path("sandboxes/<str:sandbox_id>/pause/", sandbox_views.sandbox_pause, {"paused": True}, name="sandbox-pause"),
    path("sandboxes/<str:sandbox_id>/resume/", sandbox_views.sandbox_pause, {"paused": False}, name="sandbox-resume"),
    path("sandboxes/<str:sandbox_id>/snapshot/", sandbox_views.sandbox_snapshot, name="sandbox-snapshot"),
    path("launches/", sandbox_views.launch_list, name="launches"),
    path("launches/<str:launch_id>/", sandbox_views.launch_detail, name="launch"),
    path("templates/", sandbox_views.template_list, name="templates"),
    path("snapshots/", sandbox_views.snapshot_list, name="snapshots"),
    path("snapshots/<str:snapshot_id>/", sandbox_views.snapshot_detail, name="snapshot"),
    path("snapshots/<str:snapshot_id>/delete/", sandbox_views.snapshot_delete, name="snapshot-delete"),
    path("snapshots/<str:snapshot_id>/launch/", sandbox_views.snapshot_launch, name="snapshot-launch"),
    path("policies/", sandbox_views.policy_list, name="policies"),
    path("policies/new/", sandbox_views.policy_new, name="policy-new"),
    path("policies/<str:policy_id>/edit/", sandbox_views.policy_edit, name="policy-edit"),
    path("policies/<str:policy_id>/delete/", sandbox_views.policy_delete, name="policy-delete"),
    path("keys/", views_account.key_list, name="keys"),
    path("keys/new/", views_account.key_new, name="key-new"),
    path("keys/<str:key_id>/revoke/", views_account.key_revoke, name="key-revoke"),
    path("members/", views_account.member_list, name="members"),
    path("members/invite/", views_account.invite, name="invite"),
    path("members/<int:membership_id>/role/", views_account.member_role, name="member-role"),
    path("members/<int:membership_id>/remove/", views_account.member_remove, name="member-remove"),
    path("usage/", billing_views.usage, name="usage"),
    path("", include(board_urls)),
]
urlpatterns = [
    path("api/v1/", api.urls),
    path("admin/", admin.site.urls),
    path("login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", include((console_patterns, "console"))),
]
