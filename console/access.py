"""Who may see a console page: signed in, a member of the session's team, with a role.

Every console view is wrapped in :func:`team_view`, which hands the view the
caller's membership; the view reads and writes only that membership's team,
so another team's objects are not found (404) rather than forbidden.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django_htmx.middleware import HtmxDetails

from .errors import NotFound
from .models import Membership
from .permissions import LEAST_ROLE, WHO, Action, allows
from .selectors import SESSION_TEAM, current_membership, memberships_of

View = Callable[..., HttpResponse]


class HtmxRequest(HttpRequest):
    """A request as django-htmx's middleware leaves it (for type checkers)."""

    htmx: HtmxDetails


_CACHE = "_forkyard_memberships"


def team_context(request: HttpRequest) -> tuple[list[Membership], Membership | None]:
    """(the user's memberships, the current one), read once per request: the
    view and the context processor share it."""
    cached: tuple[list[Membership], Membership | None] | None = getattr(request, _CACHE, None)
    if cached is None:
        memberships = memberships_of(request.user) if request.user.is_authenticated else []
        cached = (memberships, current_membership(memberships, request.session.get(SESSION_TEAM)))
        setattr(request, _CACHE, cached)
    return cached


def forget_team_context(request: HttpRequest) -> None:
    """After the user's memberships change within a request (joined, left, switched)."""
    if hasattr(request, _CACHE):
        delattr(request, _CACHE)


def team_view(action: Action = Action.READ) -> Callable[[View], View]:
    """Sign-in required; call ``view(request, membership, ...)`` if the member's role allows ``action``
    (``console.permissions``, the table the API reads too).

    An object the view looks up and does not find in the team (``NotFound``
    from a selector) is the console's 404 page, whatever view asked.
    """

    def decorate(view: View) -> View:
        @wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            _, membership = team_context(request)
            if membership is None:
                return render(request, "console/no_team.html", status=403)
            if not allows(membership.role, action):
                raise PermissionDenied(
                    f"Only {WHO[LEAST_ROLE[action]]} can {action.value}: you are a {membership.role} of {membership.team.name}."
                )
            try:
                return view(request, membership, *args, **kwargs)
            except NotFound as error:
                raise Http404(error.message) from None

        return login_required(wrapper)

    return decorate
