"""URLs: the public API under /api/v1, the console, the admin."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import URLPattern, URLResolver, include, path

from billing import api as usage_api
from billing import views as billing_views
from grading import views as grading_views
from grading.api import endpoints as endpoints_api
from grading.api import grades as grades_api
from grading.api import inference as inference_api
from sandboxes.api import batch as batch_api
from sandboxes.api import data as data_api
from sandboxes.api import desktop as desktop_api
from sandboxes.api import launches as launches_api
from sandboxes.api import leases as leases_api
from sandboxes.api import metrics as metrics_api
from sandboxes.api import policies as policies_api
from sandboxes.api import ports as ports_api
from sandboxes.api import processes as processes_api
from sandboxes.api import sandboxes as sandboxes_api
from sandboxes.api import snapshots as snapshots_api
from sandboxes.api import templates as templates_api
from sandboxes.board import urls as board_urls
from sandboxes.views import launches as launch_views
from sandboxes.views import policies as policy_views
from sandboxes.views import sandboxes as sandbox_views
from sandboxes.views import snapshots as snapshot_views

from . import api as account_api
from . import views, views_account, views_team
from .api_base import api as api  # re-exported: the API once every router below is mounted on it
from .forms import ThrottledSignIn

for module in (
    sandboxes_api,
    data_api,
    processes_api,
    ports_api,
    desktop_api,
    batch_api,
    launches_api,
    metrics_api,
    leases_api,
    snapshots_api,
    templates_api,
    policies_api,
    usage_api,
    inference_api,
    endpoints_api,
    grades_api,
    account_api,
):
    api.add_router("", module.router)

console_patterns: list[URLPattern | URLResolver] = [
    path("", views.overview, name="overview"),
    path("team/switch/", views.switch_team, name="switch-team"),
    path("invitations/<str:token>/", views.invitation, name="invitation"),
    path("sandboxes/", sandbox_views.sandbox_list, name="sandboxes"),
    path("sandboxes/new/", sandbox_views.sandbox_new, name="sandbox-new"),
    path("sandboxes/<str:sandbox_id>/", sandbox_views.sandbox_detail, name="sandbox"),
    path("sandboxes/<str:sandbox_id>/metrics/", sandbox_views.sandbox_metrics, name="sandbox-metrics"),
    path("sandboxes/<str:sandbox_id>/files/", sandbox_views.sandbox_files, name="sandbox-files"),
    path("sandboxes/<str:sandbox_id>/files/download/", sandbox_views.sandbox_file_download, name="sandbox-file-download"),
    path("sandboxes/<str:sandbox_id>/terminal/", sandbox_views.sandbox_terminal, name="sandbox-terminal"),
    path("sandboxes/<str:sandbox_id>/desktop/", sandbox_views.sandbox_desktop, name="sandbox-desktop"),
    path("sandboxes/<str:sandbox_id>/desktop/view/", sandbox_views.sandbox_desktop_view, name="sandbox-desktop-view"),
    path("sandboxes/<str:sandbox_id>/exec/", sandbox_views.sandbox_exec, name="sandbox-exec"),
    path("sandboxes/<str:sandbox_id>/kill/", sandbox_views.sandbox_kill, name="sandbox-kill"),
    path("sandboxes/<str:sandbox_id>/pause/", sandbox_views.sandbox_pause_view, {"paused": True}, name="sandbox-pause"),
    path("sandboxes/<str:sandbox_id>/resume/", sandbox_views.sandbox_pause_view, {"paused": False}, name="sandbox-resume"),
    path("sandboxes/<str:sandbox_id>/snapshot/", sandbox_views.sandbox_snapshot, name="sandbox-snapshot"),
    path("launches/", launch_views.launch_list, name="launches"),
    path("launches/new/", launch_views.launch_new, name="launch-new"),
    path("launches/<str:launch_id>/", launch_views.launch_detail, name="launch"),
    path("launches/<str:launch_id>/teardown/", launch_views.launch_teardown, name="launch-teardown"),
    path("templates/", snapshot_views.template_list, name="templates"),
    path("templates/<str:name>/", snapshot_views.template_detail, name="template"),
    path("snapshots/", snapshot_views.snapshot_list, name="snapshots"),
    path("snapshots/<str:snapshot_id>/", snapshot_views.snapshot_detail, name="snapshot"),
    path("snapshots/<str:snapshot_id>/delete/", snapshot_views.snapshot_delete_view, name="snapshot-delete"),
    path("snapshots/<str:snapshot_id>/launch/", snapshot_views.snapshot_launch, name="snapshot-launch"),
    path("policies/", policy_views.policy_list, name="policies"),
    path("policies/new/", policy_views.policy_new, name="policy-new"),
    path("policies/<str:policy_id>/edit/", policy_views.policy_edit, name="policy-edit"),
    path("policies/<str:policy_id>/delete/", policy_views.policy_delete_view, name="policy-delete"),
    path("keys/", views_account.key_list, name="keys"),
    path("keys/new/", views_account.key_new, name="key-new"),
    path("keys/<str:key_id>/revoke/", views_account.key_revoke, name="key-revoke"),
    path("keys/<str:key_id>/rename/", views_account.key_rename, name="key-rename"),
    path("keys/<str:key_id>/rotate/", views_account.key_rotate, name="key-rotate"),
    path("keys/<str:key_id>/delete/", views_account.key_delete, name="key-delete"),
    path("members/", views_account.member_list, name="members"),
    path("members/invite/", views_account.invite, name="invite"),
    path("members/invitations/<int:invitation_id>/revoke/", views_account.invitation_revoke_view, name="invitation-revoke"),
    path("members/invitations/<int:invitation_id>/resend/", views_account.invitation_resend_view, name="invitation-resend"),
    path("limits/", views_team.limits, name="limits"),
    path("audit/", views_team.audit, name="audit"),
    path("members/<int:membership_id>/role/", views_account.member_role, name="member-role"),
    path("members/<int:membership_id>/remove/", views_account.member_remove, name="member-remove"),
    path("usage/", billing_views.usage, name="usage"),
    path("usage/statement/", billing_views.statement, name="statement"),
    path("usage/statement.csv", billing_views.statement_csv, name="statement-csv"),
    path("budgets/", billing_views.budget_list, name="budgets"),
    path("budgets/new/", billing_views.budget_new, name="budget-new"),
    path("budgets/<str:budget_id>/", billing_views.budget_edit, name="budget-edit"),
    path("budgets/<str:budget_id>/delete/", billing_views.budget_delete_view, name="budget-delete"),
    path("inference/", grading_views.inference, name="inference"),
    path("inference/calls/<str:call_id>/", grading_views.call_detail, name="inference-call"),
    path("inference/grades/<str:grade_id>/", grading_views.grade_detail, name="grade"),
    path("inference/retention/", grading_views.retention, name="retention"),
    path("", include(board_urls)),
]
urlpatterns = [
    path("api/v1/", api.urls),
    path("admin/", admin.site.urls),
    path(
        "login/",
        auth_views.LoginView.as_view(redirect_authenticated_user=True, authentication_form=ThrottledSignIn),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", include((console_patterns, "console"))),
]
