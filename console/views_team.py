"""The console's pages about the team's rules: its limits and current use, and its audit log."""

from __future__ import annotations

from datetime import datetime, time, timedelta

from django import forms
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from billing.selectors import budget_states
from sandboxes import selectors as sandbox_selectors
from sandboxes.models import Sandbox

from .access import team_view
from .audit import Act, audit_page
from .models import Membership
from .permissions import Action
from .ratelimit import limiter
from .selectors import limits_of

PAGE_SIZE = 50


@team_view()
def limits(request: HttpRequest, membership: Membership) -> HttpResponse:
    team = membership.team
    limits = limits_of(team)
    counts = sandbox_selectors.state_counts(team)
    live = sum(counts.get(state, 0) for state in Sandbox.LIVE)
    largest = sandbox_selectors.largest_launch(team)
    rows = [
        ("Sandboxes at once", f"{limits.max_sandboxes:,}", f"{live:,} live now", live / max(1, limits.max_sandboxes)),
        (
            "Sandboxes in one launch",
            f"{limits.max_launch_count:,}",
            f"largest so far: {largest:,}" if largest else "no launch yet",
            (largest or 0) / max(1, limits.max_launch_count),
        ),
        (
            "Requests per second",
            f"{limits.requests_per_second:,} (bursts of {limits.burst:,})",
            f"{limiter().last_second(team.pk):,} in the last second",
            limiter().last_second(team.pk) / max(1, limits.requests_per_second),
        ),
        ("Longest TTL", f"{limits.max_ttl_s:,} s ({limits.max_ttl_s / 3600:g} h)", "per sandbox, from when it is ready", None),
    ]
    return render(request, "console/limits.html", {"rows": rows, "budgets": budget_states(team)})


class AuditFilterForm(forms.Form):
    FAMILIES = [("", "Any action"), ("key", "Keys"), ("member", "Members"), ("invitation", "Invitations"),
                ("policy", "Network policies"), ("launch", "Launches"), ("budget", "Budgets")]
    action = forms.ChoiceField(required=False, choices=FAMILIES + [(value, value) for value in Act.values])
    actor = forms.CharField(required=False, max_length=100, label="Who", help_text="a username, a key's name or id")
    target = forms.CharField(required=False, max_length=100, label="Object", help_text="its id, or part of its name")
    since = forms.DateField(required=False, label="From", widget=forms.DateInput(attrs={"type": "date"}))
    until = forms.DateField(required=False, label="Until", widget=forms.DateInput(attrs={"type": "date"}))
    cursor = forms.CharField(required=False, max_length=600)


def _day(value: object, extra: timedelta = timedelta(0)) -> datetime | None:
    if not value:
        return None
    return datetime.combine(value, time(0), tzinfo=timezone.get_current_timezone()) + extra  # type: ignore[arg-type]


@team_view(Action.SEE_AUDIT)
def audit(request: HttpRequest, membership: Membership) -> HttpResponse:
    form = AuditFilterForm(request.GET)
    form.is_valid()
    data = form.cleaned_data
    page = audit_page(
        membership.team,
        cursor=data.get("cursor") or None,
        limit=PAGE_SIZE,
        action=data.get("action") or None,
        actor=data.get("actor") or None,
        target=data.get("target") or None,
        since=_day(data.get("since")),
        until=_day(data.get("until"), timedelta(days=1)),
        strict=False,
    )
    return render(request, "console/audit.html", {"form": form, "page": page})
