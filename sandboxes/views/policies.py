"""Network policies in the console: the list, and the form that makes, edits or deletes one."""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from console.access import team_view
from console.audit import Actor
from console.errors import Refused
from console.models import Membership
from console.permissions import Action

from .. import selectors
from ..forms import PolicyForm, egress_text
from ..models import NetworkPolicy
from ..services.policies import policy_apply, policy_delete, policy_save

PAGE_SIZE = 100


@team_view()
def policy_list(request: HttpRequest, membership: Membership) -> HttpResponse:
    page = selectors.policies_page(membership.team, cursor=request.GET.get("cursor"), limit=PAGE_SIZE, strict=False)
    return render(request, "sandboxes/policy_list.html", {"page": page})


def _save_policy(request: HttpRequest, membership: Membership, policy: NetworkPolicy | None) -> HttpResponse:
    initial = {}
    if policy is not None:
        initial = {
            "name": policy.name,
            "description": policy.description,
            "egress": egress_text(policy.egress),
            "same_launch": policy.same_launch,
        }
    form = PolicyForm(request.POST if request.method == "POST" else None, initial=initial)
    if form.is_valid():
        try:
            saved = policy_save(team=membership.team, policy=policy, actor=Actor.of(request), **form.cleaned_data)
        except Refused as error:
            # The service has the last word (a name taken meanwhile): shown at its field.
            field = (error.field or "").split(".")[0]
            form.add_error(field if field in form.fields else None, error.message)
        else:
            applied = policy_apply(policy=saved) if policy is not None else None
            if applied and applied.failed:
                messages.warning(
                    request, f"{len(applied.failed)} sandboxes keep the old rules: their host did not take the new ones."
                )
            messages.success(request, f"Network policy “{saved.name}” saved.")
            return redirect("console:policies")
    return render(request, "sandboxes/policy_form.html", {"form": form, "policy": policy})


@team_view(Action.MANAGE_POLICIES)
def policy_new(request: HttpRequest, membership: Membership) -> HttpResponse:
    return _save_policy(request, membership, None)


@team_view(Action.MANAGE_POLICIES)
def policy_edit(request: HttpRequest, membership: Membership, policy_id: str) -> HttpResponse:
    return _save_policy(request, membership, selectors.policy_for(membership.team, policy_id))


@team_view(Action.MANAGE_POLICIES)
def policy_delete_view(request: HttpRequest, membership: Membership, policy_id: str) -> HttpResponse:
    policy = selectors.policy_for(membership.team, policy_id)
    if request.method != "POST":
        return render(request, "sandboxes/policy_delete.html", {"policy": policy})
    try:
        policy_delete(policy=policy, actor=Actor.of(request))
    except Refused as error:
        messages.error(request, error.message)
    else:
        messages.success(request, f"Network policy “{policy.name}” deleted.")
    return redirect("console:policies")
