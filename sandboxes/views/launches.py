"""Launches in the console: the list, a new one, and one launch with its progress, its sandboxes and its Tear down."""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST
from django.views.decorators.vary import vary_on_headers

from billing.models import UsagePeriod
from billing.selectors import cost_so_far
from console.access import HtmxRequest, team_view
from console.audit import Actor, started_by
from console.errors import Refused
from console.models import Membership
from console.permissions import Action
from console.selectors import limits_of

from .. import selectors
from ..forms import NewLaunchForm
from ..models import Launch
from ..services.launches import launch_create, launch_destroy
from .sandboxes import _new_form_options

PAGE_SIZE = 50


@team_view()
def launch_list(request: HttpRequest, membership: Membership) -> HttpResponse:
    page = selectors.launches_page(membership.team, cursor=request.GET.get("cursor"), limit=PAGE_SIZE, strict=False)
    return render(request, "sandboxes/launch_list.html", {"page": page, "can_run": membership.can("member")})


@team_view(Action.RUN_LAUNCHES)
def launch_new(request: HttpRequest, membership: Membership) -> HttpResponse:
    options = _new_form_options(membership)
    form = NewLaunchForm(request.POST if request.method == "POST" else None, max_count=limits_of(membership.team).max_launch_count, **options)
    if form.is_valid():
        try:
            launch, _ = launch_create(
                team=membership.team, key=None, spec=form.spec(), count=form.cleaned_data["count"], actor=Actor.of(request)
            )
        except Refused as error:
            form.add_error(error.field if error.field in form.fields else None, error.message)
        else:
            messages.success(request, f"Launching {launch.count:,} sandboxes.")
            return redirect("console:launch", launch_id=launch.id)
    return render(request, "sandboxes/launch_new.html", {"form": form})


def _context(launch: Launch) -> dict[str, object]:
    return {
        "launch": launch,
        "progress": selectors.launch_progress(launch),
        "cost": cost_so_far(UsagePeriod.objects.filter(sandbox__launch=launch)),
        "live": launch.state in (Launch.State.CREATING, Launch.State.READY, Launch.State.STOPPING),
    }


@vary_on_headers("HX-Request")
@team_view()
def launch_detail(request: HtmxRequest, membership: Membership, launch_id: str) -> HttpResponse:
    launch = selectors.launch_for(membership.team, launch_id)
    context = _context(launch)
    part = request.GET.get("part")
    if request.htmx and part == "progress":  # the progress panel polls itself while the launch moves
        return render(request, "sandboxes/_launch_progress.html", context)
    page = selectors.launch_members_page(launch, cursor=request.GET.get("cursor"), limit=PAGE_SIZE, strict=False)
    context["page"] = page
    if request.htmx and part == "members":  # and so does its first page of sandboxes, as they are made
        return render(request, "sandboxes/_launch_members.html", context)
    context["started_by"] = started_by(membership.team, launch.id)
    return render(request, "sandboxes/launch_detail.html", context)


@require_POST
@team_view(Action.RUN_LAUNCHES)
def launch_teardown(request: HtmxRequest, membership: Membership, launch_id: str) -> HttpResponse:
    launch = selectors.launch_for(membership.team, launch_id)
    launch, _ = launch_destroy(launch=launch, actor=Actor.of(request))  # the hosts' lanes destroy them
    messages.success(request, f"Tearing {launch.id} down: every sandbox stops, and its billing when it is gone.")
    return redirect("console:launch", launch_id=launch.id)
