"""The template context every console page shares: the team, the switcher, the navigation."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from django.urls import NoReverseMatch, reverse

from billing.selectors import reached_budgets_sentence

from .access import team_context
from .models import Role

NAV_ITEMS = [
    ("console:sandboxes", "Sandboxes"),
    ("console:launches", "Launches"),
    ("console:board", "Board"),
    ("console:templates", "Templates"),
    ("console:snapshots", "Snapshots"),
    ("console:policies", "Network policies"),
    ("console:keys", "API keys"),
    ("console:members", "Members"),
    ("console:inference", "Inference"),
    ("console:usage", "Usage"),
    ("console:budgets", "Budgets"),
    ("console:limits", "Limits"),
    ("console:audit", "Audit log"),
]
ADMIN_ONLY = {"console:audit"}


def _routed(name: str) -> bool:
    # The board ships separately (sandboxes/board_urls.py): link it only once it exists.
    try:
        reverse(name)
    except NoReverseMatch:
        return False
    return True


def console(request: HttpRequest) -> dict[str, Any]:
    if not getattr(request, "user", None) or not request.user.is_authenticated:
        return {"nav_items": [], "memberships": [], "team": None, "membership": None}
    memberships, membership = team_context(request)
    return {
        "budget_banner": reached_budgets_sentence(membership.team) if membership else "",
        "nav_items": [
            (name, label)
            for name, label in NAV_ITEMS
            if _routed(name) and (name not in ADMIN_ONLY or bool(membership and membership.can(Role.ADMIN)))
        ],
        "memberships": memberships,
        "membership": membership,
        "team": membership.team if membership else None,
        "is_admin": bool(membership and membership.can(Role.ADMIN)),
    }
