"""The board page: a launch drawn live, and the buttons that start and end one.

The page carries the launch's first frame (its layout and a snapshot of every pixel and counter,
the same bytes the websocket's first two messages are: ``ticker.snapshot_frames``), so board.js
draws it before any message arrives; the websocket (sandboxes/board/consumer.py) then brings the
changes.  Starting a launch sizes it to the wordmark: one sandbox per lit pixel.  The presets the
team's limits or budgets would refuse are shown as such, naming the limit.  ``/board/`` shows the
board's own launches (labelled ``board``) unless another is picked; Tear down asks first, naming
who started the launch, and works in place (``fetch``), so the drawing stays.
"""

from __future__ import annotations

import base64
from decimal import Decimal

from django.conf import settings
from django.contrib import messages
from django.http import Http404, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from billing.budgets import admit_spend
from billing.models import Price
from billing.selectors import budget_states
from billing.services import hourly_price
from console.access import HtmxRequest, team_view
from console.audit import Actor, started_by
from console.errors import OverBudget, Refused
from console.models import Membership, Role, Team
from console.permissions import Action
from console.selectors import limits_of

from .. import selectors, sizes
from ..models import Launch, Sandbox
from ..schemas import SandboxCreate
from ..services.launches import launch_create, launch_destroy
from . import ticker
from .wordmark import PRESETS
from .wordmark import render as render_wordmark

BIG_LAUNCH = 4096  # sandboxes: from here on, a board launch is in memory groups
BIG_LAUNCH_MEMORY_GROUP = 64
BOARD_LABEL = "board"
BOARD_TTL_S = 3600


def preset_refusals(team: Team, hourly: Decimal) -> dict[str, str]:
    """Why the team could not start each preset now (its limits, its budgets), by preset name."""
    limits = limits_of(team)
    live = Sandbox.objects.filter(team=team, state__in=Sandbox.LIVE).count()
    refusals = {}
    for name, count in PRESETS.items():
        if count > limits.max_launch_count:
            refusals[name] = f"over the team's limit of {limits.max_launch_count:,} sandboxes per launch"
        elif live + count > limits.max_sandboxes:
            refusals[name] = f"over the team's limit of {limits.max_sandboxes:,} sandboxes at once ({live:,} live)"
        else:
            try:
                admit_spend(team=team, key=None, labels={BOARD_LABEL: name}, hourly=hourly, ttl_s=BOARD_TTL_S, count=count)
            except OverBudget as refused:
                refusals[name] = f"over the {refused.details.get('scope', 'team')} budget ({refused.code})"
    return refusals


def _who(launch: Launch) -> str:
    found = started_by(launch.team, launch.pk)
    if found:
        return found.removeprefix("user ")
    return f"key {launch.api_key.name}" if launch.api_key_id and launch.api_key else "someone in the team"


@team_view()
def board(request: HtmxRequest, membership: Membership) -> HttpResponse:
    team = membership.team
    launches = Launch.objects.filter(team=team).select_related("api_key").order_by("-created_at")
    own = launches.filter(labels__has_key=BOARD_LABEL)
    if request.GET.get("launch"):
        launch = launches.filter(pk=request.GET["launch"]).first()
        if launch is None:
            raise Http404("no such launch")
    else:
        launch = own.first()  # the board's own; a teammate's training run only when picked
    tiny = sizes.catalogue()["tiny"]
    price = hourly_price(Price.Kind.RUNNING, tiny.size, tiny.cpu, tiny.memory_mib)
    refusals = preset_refusals(team, price) if membership.can(Role.MEMBER) else {}
    first_frame = None
    pace = None
    who = None
    if launch is not None:
        layout, snapshot = ticker.snapshot_frames(launch)
        first_frame = {"layout": base64.b64encode(layout).decode(), "snapshot": base64.b64encode(snapshot).decode()}
        pace = selectors.launch_pace(launch)
        who = _who(launch)
    present = request.GET.get("present") == "1"
    context = {
        "launch": launch,
        "recent": own[:10],
        "presets": [(name, count, refusals.get(name)) for name, count in PRESETS.items()],
        "can_launch": membership.can(Role.MEMBER),
        "price_per_second": float(price) / 3600,
        "pace": pace,
        "started_by": who,
        "present": present,
        "budgets": [state for state in budget_states(team) if state.reached],
        "config": {
            "launch": launch.id if launch else None,
            "count": launch.count if launch else 0,
            "socket": settings.FORKYARD_WEBSOCKET_URL,
            "socket_port": settings.FORKYARD_WEBSOCKET_PORT,
            "first_frame": first_frame,
            "pace": {"average": pace.average_per_s, "peak": pace.peak_per_s, "all_running_s": pace.all_running_s}
            if pace
            else None,
            "present": present,
        },
    }
    return render(request, "sandboxes/board.html", context)


@require_POST
@team_view(Action.RUN_LAUNCHES)
def board_launch(request: HtmxRequest, membership: Membership) -> HttpResponse:
    preset = request.POST.get("preset", "small")
    text = (request.POST.get("text") or "forkyard").strip()[:24] or "forkyard"
    if preset not in PRESETS:
        messages.error(request, f"unknown wordmark size {preset!r}")
        return redirect("console:board")
    count = render_wordmark(text, PRESETS[preset]).count
    labels = {BOARD_LABEL: preset, "board_text": text}
    spec = SandboxCreate.model_validate({"template": "base", "size": "tiny", "ttl_s": BOARD_TTL_S, "labels": labels})
    try:
        # The big wordmarks share memory cgroups 64 at a time: a memory cgroup per sandbox would make the
        # kernel's memory grow with the square of their number (cgroups.py, "memory groups").
        group_size = BIG_LAUNCH_MEMORY_GROUP if count >= BIG_LAUNCH else 1
        launch, _ = launch_create(
            team=membership.team, key=None, spec=spec, count=count, memory_group_size=group_size, actor=Actor.of(request)
        )
    except Refused as error:
        messages.error(request, f"The {preset} wordmark ({count:,} sandboxes) cannot start: {error.message}.")
        return redirect("console:board")
    messages.success(request, f"launching {count:,} sandboxes: one per pixel of “{text}”")
    return redirect(f"/board/?launch={launch.id}")


@require_POST
@team_view(Action.RUN_LAUNCHES)
def board_teardown(request: HtmxRequest, membership: Membership, launch_id: str) -> HttpResponse:
    launch = selectors.launch_for(membership.team, launch_id)
    launch, stopping = launch_destroy(launch=launch, actor=Actor.of(request))
    if request.headers.get("X-Requested-With") == "fetch":  # the page's own button: it stays, and draws on
        return JsonResponse({"launch": launch.id, "state": launch.state, "stopping": sum(len(ids) for ids in stopping.values())})
    messages.success(request, "tearing the launch down: every sandbox stops, and so does its billing")
    return redirect(f"/board/?launch={launch.id}")
