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


def _check_same_team(membership: Membership, acting: Membership) -> None:
    if membership.team_id != acting.team_id:
        raise AccountError("forbidden", "that member is in another team")


def _check_role_change(acting: Membership, role: str, current: str | None = None) -> None:
    """Admins manage members; only owners make owners, or unmake them."""
    if role not in Role.values:
        raise AccountError("invalid_role", f"role must be one of {', '.join(Role.values)}", field="role")
    if not acting.can(Role.ADMIN):
        raise AccountError("forbidden", "only admins and owners manage members")
    if Role.OWNER in (role, current) and not acting.can(Role.OWNER):
        raise AccountError("forbidden", "only owners make owners or change an owner's role", field="role")


@transaction.atomic
def invitation_create(*, acting: Membership, email: str, role: str) -> Invitation:
    """An invitation to ``acting``'s team; a new one for the same email replaces the old."""
    _check_role_change(acting, role)
    team = acting.team
    if Membership.objects.filter(team=team, user__email__iexact=email).exists():
        raise AccountError("already_member", f"{email} is already a member of {team.name}", field="email")
    Invitation.objects.filter(team=team, email__iexact=email, accepted_at__isnull=True).delete()
    return Invitation.objects.create(team=team, email=email.lower(), role=role, invited_by=acting.user)


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
def user_signup_and_accept(*, token: str, username: str, password: str) -> Membership:
    """A new account made from an invitation link, and the invitation accepted with it:
    both or neither (an invitation gone meanwhile leaves no orphan account)."""
    invitation = Invitation.objects.filter(token=token, accepted_at__isnull=True).first()
    if invitation is None:
        raise AccountError("invitation_invalid", "this invitation is unknown, used or expired")
    if User.objects.filter(username__iexact=username).exists():
        raise AccountError("username_taken", "that username is taken", field="username")
    user = User.objects.create_user(username=username, email=invitation.email, password=password)
    return invitation_accept(token=token, user=user)


@transaction.atomic
def membership_set_role(*, membership: Membership, role: str, acting: Membership) -> Membership:
    _check_same_team(membership, acting)
    _check_role_change(acting, role, current=membership.role)
    if membership.role == Role.OWNER and role != Role.OWNER and _last_owner(membership):
        raise AccountError("last_owner", "a team keeps at least one owner")
    membership.role = role
    membership.save(update_fields=["role"])
    return membership


@transaction.atomic
def membership_remove(*, membership: Membership, acting: Membership) -> None:
    _check_same_team(membership, acting)
    leaving = acting.pk == membership.pk  # anyone may leave
    if not leaving and not acting.can(Role.ADMIN):
        raise AccountError("forbidden", "only admins and owners remove members")
    if not leaving and membership.role == Role.OWNER and not acting.can(Role.OWNER):
        raise AccountError("forbidden", "only owners remove an owner")
    if membership.role == Role.OWNER and _last_owner(membership):
        raise AccountError("last_owner", "a team keeps at least one owner")
    membership.delete()


def _last_owner(membership: Membership) -> bool:
    return not Membership.objects.filter(team=membership.team, role=Role.OWNER).exclude(pk=membership.pk).exists()
