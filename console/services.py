"""Writes for teams, members and invitations (reads live in selectors)."""

from __future__ import annotations

from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.text import slugify

from .models import Invitation, Membership, Role, Team, TeamLimits


class AccountError(Exception):
    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


@transaction.atomic
def team_create(*, name: str, owner: User | None = None) -> Team:
    base = slugify(name)[:50] or "team"
    slug, suffix = base, 1
    while Team.objects.filter(slug=slug).exists():
        suffix += 1
        slug = f"{base}-{suffix}"
    team = Team.objects.create(name=name, slug=slug)
    TeamLimits.objects.create(team=team)
    if owner is not None:
        Membership.objects.create(team=team, user=owner, role=Role.OWNER)
    return team


@transaction.atomic
def invitation_create(*, team: Team, email: str, role: str, invited_by: User) -> Invitation:
    if Membership.objects.filter(team=team, user__email__iexact=email).exists():
        raise AccountError("already_member", f"{email} is already a member of {team.name}", field="email")
    Invitation.objects.filter(team=team, email__iexact=email, accepted_at__isnull=True).delete()
    return Invitation.objects.create(team=team, email=email.lower(), role=role, invited_by=invited_by)


@transaction.atomic
def invitation_accept(*, token: str, user: User) -> Membership:
    invitation = Invitation.objects.select_for_update().filter(token=token, accepted_at__isnull=True).first()
    if invitation is None or invitation.expires_at < timezone.now():
        raise AccountError("invitation_invalid", "this invitation is unknown, used or expired")
    try:
        membership = Membership.objects.create(team=invitation.team, user=user, role=invitation.role)
    except IntegrityError:
        raise AccountError("already_member", "you are already a member of this team") from None
    invitation.accepted_at = timezone.now()
    invitation.save(update_fields=["accepted_at"])
    return membership


@transaction.atomic
def membership_set_role(*, membership: Membership, role: str, acting: Membership) -> Membership:
    if not acting.can(Role.ADMIN) or (role == Role.OWNER and not acting.can(Role.OWNER)):
        raise AccountError("forbidden", "your role does not allow this change")
    if membership.role == Role.OWNER and role != Role.OWNER and _last_owner(membership):
        raise AccountError("last_owner", "a team keeps at least one owner")
    membership.role = role
    membership.save(update_fields=["role"])
    return membership


@transaction.atomic
def membership_remove(*, membership: Membership, acting: Membership) -> None:
    if not acting.can(Role.ADMIN) and acting.pk != membership.pk:
        raise AccountError("forbidden", "your role does not allow removing members")
    if membership.role == Role.OWNER and _last_owner(membership):
        raise AccountError("last_owner", "a team keeps at least one owner")
    membership.delete()


def _last_owner(membership: Membership) -> bool:
    return not Membership.objects.filter(team=membership.team, role=Role.OWNER).exclude(pk=membership.pk).exists()
