"""The console's inference pages: endpoints, recent calls and grades, and what the team keeps.

Calls and grades are shown by their metadata; their prompts and answers only
while the team keeps content (and only to the team's members: every read is
the team's own, another team's call is a 404).
"""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from console.access import team_view
from console.audit import Actor
from console.errors import Refused, invalid
from console.models import Membership
from console.permissions import Action

from . import selectors, services


@team_view()
def inference(request: HttpRequest, membership: Membership) -> HttpResponse:
    team = membership.team
    context = {
        "settings": selectors.team_inference(team),
        "retain_days": team.retain_content_days,
        "endpoints": selectors.endpoints_page(team, cursor=None, limit=50, strict=False).rows,
        "calls": selectors.calls_page(team, cursor=None, limit=50).rows,
        "grades": selectors.grades_page(team, cursor=None, limit=20, strict=False).rows,
        "retained": selectors.retained_count(team),
        "can_manage": membership.can("admin"),
    }
    return render(request, "grading/inference.html", context)


@team_view()
def call_detail(request: HttpRequest, membership: Membership, call_id: str) -> HttpResponse:
    call = selectors.call_for(membership.team, call_id)
    return render(request, "grading/call_detail.html", {"call": call, "content": selectors.retained_for_call(call)})


@team_view()
def grade_detail(request: HttpRequest, membership: Membership, grade_id: str) -> HttpResponse:
    grade = selectors.grade_for(membership.team, grade_id)
    content = selectors.retained_for_grade(grade) if grade.retained else None
    return render(request, "grading/grade_detail.html", {"grade": grade, "items": (content or {}).get("items")})


@require_POST
@team_view(Action.MANAGE_RETENTION)
def retention(request: HttpRequest, membership: Membership) -> HttpResponse:
    unknown = sorted(set(request.POST) - {"csrfmiddlewaretoken", "retain_days", "zero_retention"})
    raw = request.POST.get("retain_days", "0")
    try:
        if unknown:
            raise invalid(f"unknown field {unknown[0][:40]!r}", field=unknown[0][:40])
        if not raw.isdigit():
            raise invalid("retention is 0 (off) to 30 days", field="retain_days")
        days = int(raw)
        settings = services.team_inference_set(
            team=membership.team,
            retain_days=days,
            zero_retention=request.POST.get("zero_retention") == "on",
            actor=Actor.of(request),
        )
    except Refused as error:
        messages.error(request, f"Nothing changed: {error.message}.")
    else:
        kept = f"content is kept {days} days" if days else "nothing is kept"
        zero = "; calls go only to providers that keep nothing" if settings.zero_retention else ""
        messages.success(request, f"Saved: {kept}{zero}.")
    return redirect("console:inference")
