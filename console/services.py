"""Writes for teams, members and invitations (reads live in selectors); refusals are ``console.errors``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

from django.conf import settings
from django.contrib.auth.models import User
from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.text import slugify

from .audit import Act, Actor, audit_record
from .errors import Conflict, Forbidden, InvalidRequest, NotFound
from .models import Invitation, Membership, Role, Team, TeamLimits

log = logging.getLogger("forkyard.accounts")
INVITATION_DAYS = 7


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
        raise Forbidden("forbidden", "that member is in another team")


def _check_role_change(acting: Membership, role: str, current: str | None = None) -> None:
    """Admins manage members; only owners make owners, or unmake them."""
    if role not in Role.values:
        raise InvalidRequest("invalid_role", f"role must be one of {', '.join(Role.values)}", field="role")
    if not acting.can(Role.ADMIN):
        raise Forbidden("forbidden", "only admins and owners manage members")
    if Role.OWNER in (role, current) and not acting.can(Role.OWNER):
        raise Forbidden("forbidden", "only owners make owners or change an owner's role", field="role")


def _actor(acting: Membership, actor: Actor | None) -> Actor:
    return actor or Actor(user=acting.user)


def _mail_invitation(invitation: Invitation, link: str) -> bool:
    """The invitation's link, e-mailed (Django's mail); whether it went. A mail server that is down
    does not undo the invitation: the page shows the link to send by hand."""
    try:
        send_mail(
            f"Join {invitation.team.name} on forkyard",
            f"You are invited to join {invitation.team.name} on forkyard as {invitation.role}.\n\n"
            f"Accept within {INVITATION_DAYS} days: {link}\n",
            settings.DEFAULT_FROM_EMAIL,
            [invitation.email],
        )
    except Exception as error:  # noqa: BLE001 - whatever the mail backend raised, the invitation stands
        log.warning("could not e-mail the invitation for %s: %r", invitation.email, error)
        return False
    return True


@transaction.atomic
def invitation_create(
    *, acting: Membership, email: str, role: str, link_for: Callable[[Invitation], str] | None = None, actor: Actor | None = None
) -> Invitation:
    """An invitation to ``acting``'s team; a new one for the same email replaces the old. With
    ``link_for`` (the link's URL for an invitation), the link is e-mailed once this commits."""
    _check_role_change(acting, role)
    team = acting.team
    if Membership.objects.filter(team=team, user__email__iexact=email).exists():
        raise Conflict("already_member", f"{email} is already a member of {team.name}", field="email")
    Invitation.objects.filter(team=team, email__iexact=email, accepted_at__isnull=True).delete()
    invitation = Invitation.objects.create(team=team, email=email.lower(), role=role, invited_by=acting.user)
    audit_record(
        team=team, actor=_actor(acting, actor), action=Act.MEMBER_INVITED, target_type="invitation",
        target_id=str(invitation.pk), target=invitation.email, details={"role": role},
    )
    if link_for is not None:
        link = link_for(invitation)
        transaction.on_commit(lambda: _mail_invitation(invitation, link))
    return invitation


def _open_invitation(acting: Membership, invitation_id: int) -> Invitation:
    if not acting.can(Role.ADMIN):
        raise Forbidden("forbidden", "only admins and owners manage invitations")
    invitation = Invitation.objects.select_for_update().filter(team=acting.team, pk=invitation_id, accepted_at__isnull=True).first()
    if invitation is None:
        raise NotFound("invitation_not_found", "no open invitation with that id")
    return invitation


@transaction.atomic
def invitation_revoke(*, acting: Membership, invitation_id: int, actor: Actor | None = None) -> Invitation:
    """The link stops working at once (the row is gone: its token can never be accepted)."""
    invitation = _open_invitation(acting, invitation_id)
    audit_record(
        team=acting.team, actor=_actor(acting, actor), action=Act.INVITATION_REVOKED, target_type="invitation",
        target_id=str(invitation.pk), target=invitation.email,
    )
    invitation.delete()
    return invitation


@transaction.atomic
def invitation_resend(
    *, acting: Membership, invitation_id: int, link_for: Callable[[Invitation], str], actor: Actor | None = None
) -> Invitation:
    """The same link, valid for another week from now, e-mailed again once this commits."""
    invitation = _open_invitation(acting, invitation_id)
    invitation.expires_at = timezone.now() + timedelta(days=INVITATION_DAYS)
    invitation.save(update_fields=["expires_at"])
    audit_record(
        team=acting.team, actor=_actor(acting, actor), action=Act.INVITATION_RESENT, target_type="invitation",
        target_id=str(invitation.pk), target=invitation.email,
    )
    link = link_for(invitation)
    transaction.on_commit(lambda: _mail_invitation(invitation, link))
    return invitation


@transaction.atomic
def invitation_accept(*, token: str, user: User) -> Membership:
    invitation = Invitation.objects.select_for_update().filter(token=token, accepted_at__isnull=True).first()
    if invitation is None or invitation.expires_at < timezone.now():
        raise NotFound("invitation_invalid", "this invitation is unknown, used or expired")
    try:
        membership = Membership.objects.create(team=invitation.team, user=user, role=invitation.role)
    except IntegrityError:
        raise Conflict("already_member", "you are already a member of this team") from None
    invitation.accepted_at = timezone.now()
    invitation.save(update_fields=["accepted_at"])
    audit_record(
        team=invitation.team, actor=Actor(user=user), action=Act.MEMBER_JOINED, target_type="member",
        target_id=str(membership.pk), target=user.username, details={"role": invitation.role, "email": invitation.email},
    )
    return membership


@transaction.atomic
def user_signup_and_accept(*, token: str, username: str, password: str) -> Membership:
    """A new account made from an invitation link, and the invitation accepted with it:
    both or neither (an invitation gone meanwhile leaves no orphan account)."""
    invitation = Invitation.objects.filter(token=token, accepted_at__isnull=True).first()
    if invitation is None:
        raise NotFound("invitation_invalid", "this invitation is unknown, used or expired")
    if User.objects.filter(username__iexact=username).exists():
        raise Conflict("username_taken", "that username is taken", field="username")
    user = User.objects.create_user(username=username, email=invitation.email, password=password)
    return invitation_accept(token=token, user=user)


@transaction.atomic
def membership_set_role(*, membership: Membership, role: str, acting: Membership, actor: Actor | None = None) -> Membership:
    _check_same_team(membership, acting)
    _check_role_change(acting, role, current=membership.role)
    if membership.role == Role.OWNER and role != Role.OWNER and _last_owner(membership):
        raise Conflict("last_owner", "a team keeps at least one owner")
    before = membership.role
    membership.role = role
    membership.save(update_fields=["role"])
    if before != role:
        audit_record(
            team=membership.team_id, actor=_actor(acting, actor), action=Act.MEMBER_ROLE_CHANGED, target_type="member",
            target_id=str(membership.pk), target=membership.user.username, details={"from": before, "to": role},
        )
    return membership


@transaction.atomic
def membership_remove(*, membership: Membership, acting: Membership, actor: Actor | None = None) -> None:
    _check_same_team(membership, acting)
    leaving = acting.pk == membership.pk  # anyone may leave
    if not leaving and not acting.can(Role.ADMIN):
        raise Forbidden("forbidden", "only admins and owners remove members")
    if not leaving and membership.role == Role.OWNER and not acting.can(Role.OWNER):
        raise Forbidden("forbidden", "only owners remove an owner")
    if membership.role == Role.OWNER and _last_owner(membership):
        raise Conflict("last_owner", "a team keeps at least one owner")
    audit_record(
        team=membership.team_id, actor=_actor(acting, actor), action=Act.MEMBER_REMOVED, target_type="member",
        target_id=str(membership.pk), target=membership.user.username, details={"role": membership.role, "left": leaving},
    )
    membership.delete()


def _last_owner(membership: Membership) -> bool:
    return not Membership.objects.filter(team=membership.team, role=Role.OWNER).exclude(pk=membership.pk).exists()
