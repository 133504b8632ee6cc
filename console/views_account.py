"""The console's pages about the team itself: API keys, members and invitations."""

from __future__ import annotations

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from .access import forget_team_context, team_view
from .forms import ApiKeyForm, InviteForm, RoleForm, grantable_roles
from .keys import api_key_create, api_key_revoke
from .models import Membership, Role
from .selectors import key_in, keys_of, members_of, membership_in, open_invitations
from .services import AccountError, invitation_create, membership_remove, membership_set_role

# --- API keys -------------------------------------------------------------------------------


@team_view()
def key_list(request: HttpRequest, membership: Membership) -> HttpResponse:
    return render(request, "console/key_list.html", {"keys": keys_of(membership.team)})


@never_cache  # the one response that carries the secret: no cache may keep it
@team_view(Role.ADMIN, "manage API keys")
def key_new(request: HttpRequest, membership: Membership) -> HttpResponse:
    form = ApiKeyForm(request.POST if request.method == "POST" else None)
    if form.is_valid():
        new = api_key_create(
            team=membership.team,
            name=form.cleaned_data["name"],
            role=form.cleaned_data["role"],
            created_by=request.user if request.user.is_authenticated else None,  # always is: team_view signs in
            expires_at=form.expires_at(),
        )
        # Rendered, not redirected: the secret exists only in this response.
        return render(request, "console/key_created.html", {"key": new.key, "secret": new.secret})
    return render(request, "console/key_form.html", {"form": form})


@require_POST
@team_view(Role.ADMIN, "manage API keys")
def key_revoke(request: HttpRequest, membership: Membership, key_id: str) -> HttpResponse:
    key = key_in(membership.team, key_id)
    if key is None:
        raise Http404("No such key in this team.")
    api_key_revoke(key=key)
    messages.success(request, f"Key “{key.name}” ({key.prefix}…) is revoked: it no longer authenticates.")
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


def _member_or_404(acting: Membership, membership_id: int) -> Membership:
    member = membership_in(acting.team, membership_id)
    if member is None:
        raise Http404("No such member in this team.")
    return member


@require_POST
@team_view(Role.ADMIN, "change roles")
def member_role(request: HttpRequest, membership: Membership, membership_id: int) -> HttpResponse:
    member = _member_or_404(membership, membership_id)
    form = RoleForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Choose a role: member, admin or owner.")
        return redirect("console:members")
    try:
        membership_set_role(membership=member, role=form.cleaned_data["role"], acting=membership)
    except AccountError as error:
        messages.error(request, f"{member.user.username}: {error.message}.")
    else:
        messages.success(request, f"{member.user.username} is now {member.get_role_display().lower()}.")
    return redirect("console:members")


@require_POST
@team_view()  # anyone may leave; removing others is checked by the service
def member_remove(request: HttpRequest, membership: Membership, membership_id: int) -> HttpResponse:
    member = _member_or_404(membership, membership_id)
    try:
        membership_remove(membership=member, acting=membership)
    except AccountError as error:
        messages.error(request, f"{member.user.username}: {error.message}.")
        return redirect("console:members")
    if member.pk == membership.pk:
        forget_team_context(request)
        messages.success(request, f"You left {membership.team.name}.")
        return redirect("console:overview")
    messages.success(request, f"{member.user.username} is no longer a member of {membership.team.name}.")
    return redirect("console:members")


@team_view(Role.ADMIN, "invite members")
def invite(request: HttpRequest, membership: Membership) -> HttpResponse:
    form = InviteForm(request.POST if request.method == "POST" else None, acting=membership)
    if form.is_valid():
        try:
            invitation = invitation_create(acting=membership, email=form.cleaned_data["email"], role=form.cleaned_data["role"])
        except AccountError as error:
            form.add_error(error.field if error.field in form.fields else None, error.message)
        else:
            link = request.build_absolute_uri(reverse("console:invitation", args=[invitation.token]))
            messages.success(request, f"Invitation for {invitation.email} made. Send them this link: {link}")
            return redirect("console:members")
    return render(request, "console/invite_form.html", {"form": form})
