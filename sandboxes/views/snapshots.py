"""Templates and snapshots in the console: the lists, one template and its last build, one snapshot, its
delete and its launch-forks form."""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST
from django.views.decorators.vary import vary_on_headers

from billing.charts import snapshot_saved_state
from console.access import HtmxRequest, team_view
from console.audit import Actor
from console.errors import Refused
from console.models import Membership
from console.permissions import Action

from .. import selectors, sizes
from ..forms import LaunchFromSnapshotForm
from ..models import Snapshot
from ..schemas import SandboxCreate
from ..services.launches import launch_create
from ..services.snapshots import snapshot_delete

PAGE_SIZE = 50


@team_view()
def template_list(request: HttpRequest, membership: Membership) -> HttpResponse:
    page = selectors.templates_page(membership.team, cursor=request.GET.get("cursor"), limit=PAGE_SIZE, strict=False)
    return render(request, "sandboxes/template_list.html", {"page": page})


@vary_on_headers("HX-Request")
@team_view()
def template_detail(request: HtmxRequest, membership: Membership, name: str) -> HttpResponse:
    """A template; for a team's own, its last build's steps, and once failed the step's error and output.
    While the build runs, htmx refreshes the build panel every second."""
    template = selectors.template_for(membership.team, name)
    build = selectors.last_build(template) if template.team_id else None
    context = {"template": template, "build": build}
    if request.htmx:
        return render(request, "sandboxes/_template_build.html", context)
    return render(request, "sandboxes/template_detail.html", context)


@team_view()
def snapshot_list(request: HttpRequest, membership: Membership) -> HttpResponse:
    page = selectors.snapshots_page(membership.team, cursor=request.GET.get("cursor"), limit=PAGE_SIZE, strict=False)
    return render(request, "sandboxes/snapshot_list.html", {"page": page})


def _snapshot_page(request: HttpRequest, snapshot: Snapshot, launch_form: LaunchFromSnapshotForm | None = None) -> HttpResponse:
    seconds, spent = snapshot_saved_state(snapshot)
    context = {
        "snapshot": snapshot,
        "users": selectors.snapshot_users(snapshot),
        "children": selectors.snapshot_children(snapshot),
        "launch_form": launch_form or LaunchFromSnapshotForm(sizes=sorted(sizes.catalogue())),
        "billed_seconds": seconds,
        "spent": spent,
    }
    return render(request, "sandboxes/snapshot_detail.html", context, status=400 if launch_form else 200)


@vary_on_headers("HX-Request")
@team_view()
def snapshot_detail(request: HtmxRequest, membership: Membership, snapshot_id: str) -> HttpResponse:
    snapshot = selectors.snapshot_for(membership.team, snapshot_id)
    if request.htmx:  # the state panel polls itself while the snapshot is taken
        return render(request, "sandboxes/_snapshot_state.html", {"snapshot": snapshot})
    return _snapshot_page(request, snapshot)


@require_POST
@team_view(Action.RUN_SANDBOXES)
def snapshot_delete_view(request: HttpRequest, membership: Membership, snapshot_id: str) -> HttpResponse:
    snapshot = selectors.snapshot_for(membership.team, snapshot_id)
    try:
        snapshot_delete(snapshot=snapshot)
    except Refused as error:
        messages.error(request, error.message)
        return redirect("console:snapshot", snapshot_id=snapshot.id)
    messages.success(request, f"Snapshot “{snapshot.name}” deleted; its saved-state billing has ended.")
    return redirect("console:snapshots")


@require_POST
@team_view(Action.RUN_SANDBOXES)
def snapshot_launch(request: HttpRequest, membership: Membership, snapshot_id: str) -> HttpResponse:
    snapshot = selectors.snapshot_for(membership.team, snapshot_id)
    form = LaunchFromSnapshotForm(request.POST, sizes=sorted(sizes.catalogue()))
    if not form.is_valid():
        return _snapshot_page(request, snapshot, launch_form=form)
    spec = SandboxCreate.model_validate(
        {"snapshot": snapshot.id, "size": form.cleaned_data["size"], "ttl_s": form.cleaned_data["ttl_s"]}
    )
    try:
        launch, _ = launch_create(
            team=membership.team, key=None, spec=spec, count=form.cleaned_data["count"], actor=Actor.of(request)
        )
    except Refused as error:
        messages.error(request, error.message)
        return redirect("console:snapshot", snapshot_id=snapshot.id)
    messages.success(request, f"Launching {launch.count} forks of “{snapshot.name}”.")
    return redirect("console:launch", launch_id=launch.id)
