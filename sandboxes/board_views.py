"""The board page: a launch drawn live, and the buttons that start and end one.

The page itself is a shell: a canvas, counters and a chart that board.js
fills from the websocket (sandboxes/consumers.py).  Starting a launch sizes it
to the wordmark: one sandbox per lit pixel.
"""

from __future__ import annotations

from django.contrib import messages
from django.http import Http404, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from billing.services import hourly_price
from console.access import HtmxRequest, team_view
from console.errors import ApiError
from console.models import Membership, Role

from . import services
from .models import Launch
from .wordmark import PRESETS
from .wordmark import render as render_wordmark

BOARD_LABEL = "board"


@team_view()
def board(request: HtmxRequest, membership: Membership) -> HttpResponse:
    launches = Launch.objects.filter(team=membership.team).order_by("-created_at")
    launch = None
    if request.GET.get("launch"):
        launch = launches.filter(pk=request.GET["launch"]).first()
        if launch is None:
            raise Http404("no such launch")
    else:
        launch = launches.filter(labels__has_key=BOARD_LABEL).first() or launches.first()
    price = hourly_price("running", "tiny", 1.0, 128)
    context = {
        "launch": launch,
        "recent": launches[:10],
        "presets": [(name, count) for name, count in PRESETS.items()],
        "can_launch": membership.can(Role.MEMBER),
        "price_per_second": float(price) / 3600,
        "config": {"launch": launch.id if launch else None, "count": launch.count if launch else 0},
    }
    return render(request, "sandboxes/board.html", context)


@require_POST
@team_view(Role.MEMBER, "start a launch")
def board_launch(request: HtmxRequest, membership: Membership) -> HttpResponse:
    preset = request.POST.get("preset", "small")
    text = (request.POST.get("text") or "forkyard").strip()[:24] or "forkyard"
    if preset not in PRESETS:
        messages.error(request, f"unknown wordmark size {preset!r}")
        return redirect("console:board")
    count = render_wordmark(text, PRESETS[preset]).count
    spec = services.CreateSpec(template="base", size="tiny", ttl_s=3600, labels={BOARD_LABEL: preset, "board_text": text})
    try:
        launch, _ = services.launch_create(team=membership.team, key=None, spec=spec, count=count)
    except ApiError as error:
        messages.error(request, error.message)
        return redirect("console:board")
    messages.success(request, f"launching {count:,} sandboxes: one per pixel of “{text}”")
    return redirect(f"/board/?launch={launch.id}")


@require_POST
@team_view(Role.MEMBER, "tear a launch down")
def board_teardown(request: HtmxRequest, membership: Membership, launch_id: str) -> HttpResponse:
    launch = Launch.objects.filter(team=membership.team, pk=launch_id).first()
    if launch is None:
        raise Http404("no such launch")
    services.launch_destroy(launch=launch)
    messages.success(request, "tearing the launch down: every sandbox stops, and so does its billing")
    return redirect(f"/board/?launch={launch.id}")
