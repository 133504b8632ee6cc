"""Reads for accounts: a user's teams, a team's members, keys and invitations."""

from __future__ import annotations

from datetime import datetime

from django.contrib.auth.models import User
from django.db.models import F, QuerySet
from django.utils import timezone

from .errors import not_found
from .models import ApiKey, Invitation, Membership, Team, TeamLimits
from .pagination import Page, keyset_page

SESSION_TEAM = "team_id"  # the session key for the current team (the board reads it too)


def memberships_of(user: User) -> list[Membership]:
    """Every team the user belongs to, for the team switcher: one query."""
    return list(Membership.objects.select_related("team").filter(user=user).order_by("team__name", "team_id"))


def current_membership(memberships: list[Membership], team_id: str | None) -> Membership | None:
    """The session's team, or the user's first one if the session names none they are in."""
    for membership in memberships:
        if membership.team_id == team_id:
            return membership
    return memberships[0] if memberships else None


def members_of(team: Team) -> QuerySet[Membership]:
    return Membership.objects.select_related("user").filter(team=team).order_by("user__username")


def membership_for(team: Team, membership_id: int) -> Membership:
    membership = Membership.objects.select_related("user", "team").filter(team=team, pk=membership_id).first()
    if membership is None:
        raise not_found("member", str(membership_id))
    return membership


def open_invitations(team: Team, now: datetime | None = None) -> QuerySet[Invitation]:
    now = now or timezone.now()
    return Invitation.objects.filter(team=team, accepted_at__isnull=True, expires_at__gt=now).order_by("-created_at")


def invitation_by_token(token: str) -> Invitation | None:
    """An invitation still waiting to be accepted, or None (unknown, used or expired alike)."""
    invitation = Invitation.objects.select_related("team").filter(token=token, accepted_at__isnull=True).first()
    if invitation is None or invitation.expires_at <= timezone.now():
        return None
    return invitation


def keys_of(team: Team) -> QuerySet[ApiKey]:
    # Active keys first (NULLs sort differently per database: say where they go).
    return (
        ApiKey.objects.select_related("created_by")
        .filter(team=team)
        .order_by(F("revoked_at").desc(nulls_first=True), "-created_at")
    )


def key_for(team: Team, key_id: str) -> ApiKey:
    key = ApiKey.objects.filter(team=team, pk=key_id).first()
    if key is None:
        raise not_found("key", key_id)
    return key


def keys_page(team: Team, *, cursor: str | None, limit: int) -> Page[ApiKey]:
    """For the API: newest first, one page at a time."""
    return keyset_page(ApiKey.objects.filter(team=team), cursor=cursor, limit=limit)


def limits_of(team: Team) -> TeamLimits:
    """The team's limits (the defaults, made now, for a team made without them: in the admin, say)."""
    try:
        return team.limits
    except TeamLimits.DoesNotExist:
        limits, _ = TeamLimits.objects.get_or_create(team=team)
        return limits
