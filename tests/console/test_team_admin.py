"""Team admin in the console: invitations revoked and resent, keys renamed, rotated and deleted with
their scopes, budgets set, the limits page, and an audit entry for every one of those changes, which
the audit page lists and filters for admins only."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.core import mail
from django.test import Client
from django.urls import reverse

from billing.models import Budget
from console.keys import api_key_authenticate
from console.models import ApiKey, AuditEntry, Invitation, Membership, Role
from sandboxes.models import NetworkPolicy
from tests.console.conftest import World, client_for

pytestmark = pytest.mark.django_db(transaction=True)  # mail goes out once a change commits


def actions(world: World) -> list[str]:
    """What members did to team A (the fixture's own keys, made by no one, left out)."""
    rows = AuditEntry.objects.filter(team=world.team_a).exclude(actor="forkyard").order_by("at", "id")
    return list(rows.values_list("action", flat=True))


def table(html: str) -> str:
    found = re.search(r'<table id="audit">.*?</table>', html, re.S)
    return found.group(0) if found else ""


def test_an_invitation_is_revoked_and_resent(admin_client: Client, world: World) -> None:
    mail.outbox.clear()
    admin_client.post(reverse("console:invite"), {"email": "newbie@example.com", "role": "member"})
    invitation = Invitation.objects.get(email="newbie@example.com")
    assert len(mail.outbox) == 1 and invitation.token in mail.outbox[0].body, "the link is e-mailed"
    before = invitation.expires_at
    resent = admin_client.post(reverse("console:invitation-resend", args=[invitation.pk]), follow=True)
    assert b"e-mailed again" in resent.content
    assert len(mail.outbox) == 2 and Invitation.objects.get(pk=invitation.pk).expires_at > before
    link = reverse("console:invitation", args=[invitation.token])
    assert Client().get(link).status_code == 200
    revoked = admin_client.post(reverse("console:invitation-revoke", args=[invitation.pk]), follow=True)
    assert b"is revoked" in revoked.content
    assert Client().get(link).status_code == 404, "a revoked invitation's link no longer works"
    assert not Invitation.objects.filter(pk=invitation.pk).exists()
    assert actions(world) == ["member.invited", "invitation.resent", "invitation.revoked"]
    entry = AuditEntry.objects.get(action="invitation.revoked")
    assert (entry.actor, entry.target, entry.address) == ("user adam", "newbie@example.com", "127.0.0.1")
    # A member cannot revoke one, nor resend it.
    other = Invitation.objects.create(team=world.team_a, email="x@example.com", role=Role.MEMBER)
    member = client_for(world.member)
    assert member.post(reverse("console:invitation-revoke", args=[other.pk])).status_code == 403
    assert Invitation.objects.filter(pk=other.pk).exists()


def test_a_key_is_scoped_renamed_rotated_and_deleted(admin_client: Client, world: World) -> None:
    made = admin_client.post(
        reverse("console:key-new"), {"name": "evaluator", "role": "member", "access": "read_only", "label_limit": "project=rl"}
    )
    secret = re.search(r'id="new-secret">(fy_[A-Za-z0-9_-]+)<', made.content.decode())
    assert secret and b'data-copy="new-secret"' in made.content, "a copy button beside the secret"
    key = ApiKey.objects.get(name="evaluator")
    assert (key.scopes, key.label_limit) == (["*:read"], {"project": "rl"})
    listing = admin_client.get(reverse("console:keys")).content.decode()
    assert "everything (read-only)" in listing and "project=rl" in listing
    admin_client.post(reverse("console:key-rename", args=[key.pk]), {"name": "judge"})
    assert ApiKey.objects.get(pk=key.pk).name == "judge"
    rotated = admin_client.post(reverse("console:key-rotate", args=[key.pk]))
    new_secret = re.search(r'id="new-secret">(fy_[A-Za-z0-9_-]+)<', rotated.content.decode())
    assert new_secret and "no-store" in rotated["Cache-Control"]
    assert api_key_authenticate(secret.group(1)) is None and api_key_authenticate(new_secret.group(1)).pk == key.pk
    admin_client.post(reverse("console:key-delete", args=[key.pk]))
    assert not ApiKey.objects.filter(pk=key.pk).exists()
    assert actions(world) == ["key.created", "key.renamed", "key.rotated", "key.deleted"]


def test_members_roles_and_policies_are_audited(owner_client: Client, admin_client: Client, world: World) -> None:
    mel = Membership.objects.get(user=world.member)
    owner_client.post(reverse("console:member-role", args=[mel.pk]), {"role": "admin"})
    owner_client.post(reverse("console:member-remove", args=[mel.pk]))
    admin_client.post(reverse("console:policy-new"), {"name": "pypi", "description": "", "egress": "pypi.org 443"})
    policy = NetworkPolicy.objects.get(team=world.team_a, name="pypi")
    admin_client.post(reverse("console:policy-edit", args=[policy.id]), {"name": "pypi", "description": "", "egress": "pypi.org 80,443"})
    admin_client.post(reverse("console:policy-delete", args=[policy.id]))
    assert actions(world) == ["member.role_changed", "member.removed", "policy.created", "policy.changed", "policy.deleted"]
    changed = AuditEntry.objects.get(action="policy.changed")
    assert changed.details["egress"]["to"][0]["ports"] == [80, 443]
    assert AuditEntry.objects.get(action="member.role_changed").details == {"from": "member", "to": "admin"}


def test_budgets_are_set_from_the_console_and_audited(admin_client: Client, member_client: Client, world: World) -> None:
    form = {"scope": "team", "monthly_limit": "25.00", "alert_percents": "50, 90", "over_limit": "pause", "grace_minutes": "30"}
    assert member_client.post(reverse("console:budget-new"), form).status_code == 403
    assert admin_client.post(reverse("console:budget-new"), form).status_code == 302
    budget = Budget.objects.get(team=world.team_a)
    assert (budget.monthly_limit, budget.alert_percents, budget.grace_s) == (25, [50, 90], 1800)
    page = member_client.get(reverse("console:budgets")).content.decode()
    assert "$25.00" in page and "50%, 90%, 100%" in page
    limits = member_client.get(reverse("console:limits")).content.decode()
    assert "Budget: team" in limits and "Sandboxes at once" in limits and "Requests per second" in limits
    admin_client.post(reverse("console:budget-edit", args=[budget.pk]), {**form, "monthly_limit": "30.00"})
    admin_client.post(reverse("console:budget-delete", args=[budget.pk]))
    assert actions(world) == ["budget.created", "budget.changed", "budget.deleted"]
    assert AuditEntry.objects.get(action="budget.changed").details == {"monthly_limit": {"from": "25.00", "to": "30.00"}}


def test_the_audit_page_filters_and_is_for_admins(admin_client: Client, member_client: Client, world: World) -> None:
    admin_client.post(reverse("console:key-new"), {"name": "ci", "role": "member"})
    admin_client.post(reverse("console:invite"), {"email": "z@example.com", "role": "member"})
    assert member_client.get(reverse("console:audit")).status_code == 403
    everything = table(admin_client.get(reverse("console:audit")).content.decode())
    assert "key.created" in everything and "member.invited" in everything
    keys_only = table(admin_client.get(reverse("console:audit"), {"action": "key"}).content.decode())
    assert "key.created" in keys_only and "member.invited" not in keys_only
    by_target = table(admin_client.get(reverse("console:audit"), {"target": "z@example"}).content.decode())
    assert "member.invited" in by_target and "key.created" not in by_target
    nobody = admin_client.get(reverse("console:audit"), {"actor": "nobody-at-all"}).content.decode()
    assert "Nothing matches" in nobody
    stranger = table(client_for(world.stranger).get(reverse("console:audit")).content.decode())
    assert "ci</strong>" not in stranger and "z@example.com" not in stranger, "another team's log shows none of this team's"
    assert "other-trainer" in stranger, "its own entries, though"


def test_a_statement_prints_and_downloads(member_client: Client, world: World, settings: Any) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from tests.console.conftest import usage_period

    now = timezone.now()
    usage_period(world, now - timedelta(hours=2), now - timedelta(hours=1))
    page = member_client.get(reverse("console:statement"))
    assert page.status_code == 200 and b'id="statement-total"' in page.content and b"data-print" in page.content
    exported = member_client.get(reverse("console:statement-csv"))
    assert exported["Content-Type"].startswith("text/csv") and b"total" in exported.content
    assert b"Running sandboxes" in page.content
