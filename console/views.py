"""The console's overview, the team switcher, and invitation links (accept, or sign up and accept)."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth import login
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from billing import charts
from sandboxes import selectors as sandbox_selectors
from sandboxes.models import Sandbox

from .access import forget_team_context, team_context, team_view
from .errors import Refused
from .forms import SignupForm, TeamSwitchForm
from .models import Membership
from .selectors import SESSION_TEAM, invitation_by_token
from .services import invitation_accept, user_signup_and_accept


@team_view()
def overview(request: HttpRequest, membership: Membership) -> HttpResponse:
    team = membership.team
    counts = sandbox_selectors.state_counts(team)
    midnight = timezone.now().replace(hour=0, minute=0, second=0, microsecond=0)
    last_day = charts.window_series(team, "24h", "size")
    context = {
        "running": counts.get(Sandbox.State.RUNNING, 0),
        "live": sum(counts.get(state, 0) for state in Sandbox.LIVE),
        "launches_today": sandbox_selectors.launches_today(team),
        # Midnight is an hour boundary within the last 24 hours: today's spend is in the series.
        "spend_today": last_day.amount_since(midnight),
        "recent_launches": sandbox_selectors.recent_launches(team),
        "figure": charts.seconds_figure(last_day, "Sandbox-seconds, last 24 hours"),
    }
    return render(request, "console/overview.html", context)


@login_required
@require_POST
def switch_team(request: HttpRequest) -> HttpResponse:
    form = TeamSwitchForm(request.POST)
    memberships, _ = team_context(request)
    chosen = next((m for m in memberships if form.is_valid() and m.team_id == form.cleaned_data["team"]), None)
    if chosen is None:
        messages.error(request, "You are not a member of that team.")
    else:
        request.session[SESSION_TEAM] = chosen.team_id
        forget_team_context(request)
        messages.success(request, f"Now working in {chosen.team.name}.")
    return redirect("console:overview")


def _joined(request: HttpRequest, membership: Membership) -> HttpResponse:
    request.session[SESSION_TEAM] = membership.team_id
    forget_team_context(request)
    messages.success(request, f"You joined {membership.team.name} as {membership.get_role_display().lower()}.")
    return redirect("console:overview")


def invitation(request: HttpRequest, token: str) -> HttpResponse:
    """An invitation link: a signed-in user accepts it; anyone else makes an account here."""
    invited = invitation_by_token(token)
    if invited is None:
        return render(request, "console/invitation_invalid.html", status=404)
    form = None
    if request.method == "POST" and request.user.is_authenticated:
        try:
            return _joined(request, invitation_accept(token=token, user=request.user))
        except Refused as error:
            messages.error(request, error.message)
    elif request.method == "POST":
        form = SignupForm(request.POST)
        if form.is_valid():
            try:
                membership = user_signup_and_accept(
                    token=token, username=form.cleaned_data["username"], password=form.cleaned_data["password1"]
                )
            except Refused as error:
                form.add_error(error.field if error.field in form.fields else None, error.message)
            else:
                login(request, membership.user, backend="django.contrib.auth.backends.ModelBackend")
                return _joined(request, membership)
    elif not request.user.is_authenticated:
        form = SignupForm()
    return render(request, "console/invitation.html", {"invitation": invited, "form": form})
