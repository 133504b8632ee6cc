"""The console's pages about the team itself: API keys, members and invitations."""

from __future__ import annotations

from collections.abc import Callable

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.cache import add_never_cache_headers
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from .access import forget_team_context, team_view
from .audit import Actor
from .errors import Refused
from .forms import ApiKeyForm, InviteForm, KeyRenameForm, RoleForm, grantable_roles
from .keys import api_key_create, api_key_delete, api_key_rename, api_key_revoke, api_key_rotate
from .models import ApiKey, Invitation, Membership, Role
from .permissions import Action, describe_scopes
from .selectors import key_for, keys_of, members_of, membership_for, open_invitations
from .services import invitation_create, invitation_resend, invitation_revoke, membership_remove, membership_set_role

# --- API keys -------------------------------------------------------------------------------


@team_view()
def key_list(request: HttpRequest, membership: Membership) -> HttpResponse:
    keys = list(keys_of(membership.team))
    return render(request, "console/key_list.html", {"keys": [(key, describe_scopes(key.scopes)) for key in keys]})


def _shown_once(request: HttpRequest, key: ApiKey, secret: str, rotated: bool = False) -> HttpResponse:
    # Rendered, not redirected: the secret exists only in this response.
    response = render(request, "console/key_created.html", {"key": key, "secret": secret, "rotated": rotated})
    add_never_cache_headers(response)
    return response


@never_cache  # the one response that carries the secret: no cache may keep it
@team_view(Action.MANAGE_KEYS)
def key_new(request: HttpRequest, membership: Membership) -> HttpResponse:
    form = ApiKeyForm(request.POST if request.method == "POST" else None)
    if form.is_valid():
        new = api_key_create(
            team=membership.team,
            name=form.cleaned_data["name"],
            role=form.cleaned_data["role"],
            created_by=request.user if request.user.is_authenticated else None,  # always is: team_view signs in
            expires_at=form.expires_at(),
            scopes=form.scopes(),
            label_limit=form.cleaned_data["label_limit"],
            actor=Actor.of(request),
        )
        return _shown_once(request, new.key, new.secret)
    return render(request, "console/key_form.html", {"form": form})


@require_POST
@team_view(Action.MANAGE_KEYS)
def key_revoke(request: HttpRequest, membership: Membership, key_id: str) -> HttpResponse:
    key = key_for(membership.team, key_id)
    api_key_revoke(key=key, actor=Actor.of(request))
    messages.success(request, f"Key “{key.name}” ({key.prefix}…) is revoked: it no longer authenticates.")
    return redirect("console:keys")


@require_POST
@team_view(Action.MANAGE_KEYS)
def key_rename(request: HttpRequest, membership: Membership, key_id: str) -> HttpResponse:
    key = key_for(membership.team, key_id)
    form = KeyRenameForm(request.POST)
    if form.is_valid():
        api_key_rename(key=key, name=form.cleaned_data["name"], actor=Actor.of(request))
        messages.success(request, f"Key {key.prefix}… is now “{form.cleaned_data['name']}”.")
    else:
        messages.error(request, "A key's name is 1 to 100 characters.")
    return redirect("console:keys")


@never_cache
@require_POST
@team_view(Action.MANAGE_KEYS)
def key_rotate(request: HttpRequest, membership: Membership, key_id: str) -> HttpResponse:
    key = key_for(membership.team, key_id)
    try:
        new = api_key_rotate(key=key, actor=Actor.of(request))
    except Refused as error:
        messages.error(request, f"{key.name}: {error.message}.")
        return redirect("console:keys")
    return _shown_once(request, new.key, new.secret, rotated=True)


@require_POST
@team_view(Action.MANAGE_KEYS)
def key_delete(request: HttpRequest, membership: Membership, key_id: str) -> HttpResponse:
    key = key_for(membership.team, key_id)
    api_key_delete(key=key, actor=Actor.of(request))
    messages.success(request, f"Key “{key.name}” ({key.prefix}…) is deleted.")
    return redirect("console:keys")


# --- members and invitations -----------------------------------------------------------------


def _manages(acting: Membership, member: Membership) -> bool:
    """Whether the page offers ``acting`` to change or remove ``member`` (the services decide)."""
    if member.pk == acting.pk or not acting.can(Role.ADMIN):
        return False
    return member.role != Role.OWNER or acting.can(Role.OWNER)


@team_view()
def member_list(request: HttpRequest, membership: Membership) -> HttpResponse:
    context = {
        "members": [(member, _manages(membership, member)) for member in members_of(membership.team)],
        "invitations": open_invitations(membership.team) if membership.can(Role.ADMIN) else [],
        "roles": grantable_roles(membership),
    }
    return render(request, "console/member_list.html", context)


@require_POST
@team_view(Action.MANAGE_MEMBERS)
def member_role(request: HttpRequest, membership: Membership, membership_id: int) -> HttpResponse:
    member = membership_for(membership.team, membership_id)
    form = RoleForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Choose a role: member, admin or owner.")
        return redirect("console:members")
    try:
        membership_set_role(membership=member, role=form.cleaned_data["role"], acting=membership, actor=Actor.of(request))
    except Refused as error:
        messages.error(request, f"{member.user.username}: {error.message}.")
    else:
        messages.success(request, f"{member.user.username} is now {member.get_role_display().lower()}.")
    return redirect("console:members")


@require_POST
@team_view()  # anyone may leave; removing others is checked by the service
def member_remove(request: HttpRequest, membership: Membership, membership_id: int) -> HttpResponse:
    member = membership_for(membership.team, membership_id)
    try:
        membership_remove(membership=member, acting=membership, actor=Actor.of(request))
    except Refused as error:
        messages.error(request, f"{member.user.username}: {error.message}.")
        return redirect("console:members")
    if member.pk == membership.pk:
        forget_team_context(request)
        messages.success(request, f"You left {membership.team.name}.")
        return redirect("console:overview")
    messages.success(request, f"{member.user.username} is no longer a member of {membership.team.name}.")
    return redirect("console:members")


@team_view(Action.MANAGE_MEMBERS)
def invite(request: HttpRequest, membership: Membership) -> HttpResponse:
    form = InviteForm(request.POST if request.method == "POST" else None, acting=membership)
    if form.is_valid():
        try:
            invitation = invitation_create(
                acting=membership,
                email=form.cleaned_data["email"],
                role=form.cleaned_data["role"],
                link_for=_link_for(request),
                actor=Actor.of(request),
            )
        except Refused as error:
            form.add_error(error.field if error.field in form.fields else None, error.message)
        else:
            link = _link_for(request)(invitation)
            messages.success(request, f"Invitation for {invitation.email} made and e-mailed. Its link: {link}")
            return redirect("console:members")
    return render(request, "console/invite_form.html", {"form": form})


def _link_for(request: HttpRequest) -> Callable[[Invitation], str]:
    return lambda invitation: request.build_absolute_uri(reverse("console:invitation", args=[invitation.token]))


@require_POST
@team_view(Action.MANAGE_MEMBERS)
def invitation_revoke_view(request: HttpRequest, membership: Membership, invitation_id: int) -> HttpResponse:
    try:
        invitation = invitation_revoke(acting=membership, invitation_id=invitation_id, actor=Actor.of(request))
    except Refused as error:
        messages.error(request, error.message)
    else:
        messages.success(request, f"The invitation for {invitation.email} is revoked: its link no longer works.")
    return redirect("console:members")


@require_POST
@team_view(Action.MANAGE_MEMBERS)
def invitation_resend_view(request: HttpRequest, membership: Membership, invitation_id: int) -> HttpResponse:
    try:
        invitation = invitation_resend(
            acting=membership, invitation_id=invitation_id, link_for=_link_for(request), actor=Actor.of(request)
        )
    except Refused as error:
        messages.error(request, error.message)
    else:
        messages.success(request, f"The invitation for {invitation.email} is e-mailed again, valid until {invitation.expires_at:%Y-%m-%d %H:%M} UTC.")
    return redirect("console:members")
