"""Members view and run commands; admins manage keys, policies, invitations and members;
only owners make owners."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from console.models import ApiKey, Invitation, Membership, Role
from sandboxes.models import NetworkPolicy
from tests.console.conftest import World

pytestmark = pytest.mark.django_db

POLICY = {"name": "pypi", "description": "", "egress": "pypi.org 443"}


def test_a_member_cannot_manage_keys_policies_or_invitations(member_client: Client, world: World, make_policy) -> None:
    policy = make_policy(world.team_a, name="existing")
    forbidden = [
        ("get", reverse("console:key-new"), {}),
        ("post", reverse("console:key-new"), {"name": "mine", "role": "member"}),
        ("post", reverse("console:key-revoke", args=[world.key_a.id]), {}),
        ("get", reverse("console:policy-new"), {}),
        ("post", reverse("console:policy-new"), POLICY),
        ("post", reverse("console:policy-edit", args=[policy.id]), {**POLICY, "name": "renamed"}),
        ("post", reverse("console:policy-delete", args=[policy.id]), {}),
        ("get", reverse("console:invite"), {}),
        ("post", reverse("console:invite"), {"email": "new@example.com", "role": "member"}),
    ]
    for method, url, data in forbidden:
        response = getattr(member_client, method)(url, data)
        assert response.status_code == 403, (method, url)
        assert b"Only admins and owners can" in response.content, url  # a sentence, not a bare code
    assert ApiKey.objects.filter(team=world.team_a).count() == 1
    assert list(NetworkPolicy.objects.filter(team=world.team_a).values_list("name", flat=True)) == ["existing"]
    assert not Invitation.objects.exists()
    assert ApiKey.objects.get(pk=world.key_a.pk).revoked_at is None


def test_a_member_sees_no_management_buttons(member_client: Client, admin_client: Client) -> None:
    for url, button in [("console:keys", "New key"), ("console:policies", "New policy"), ("console:members", "Invite")]:
        assert button not in member_client.get(reverse(url)).content.decode(), url
        assert button in admin_client.get(reverse(url)).content.decode(), url


def test_an_admin_can_manage_keys_policies_and_invitations(admin_client: Client, world: World) -> None:
    assert admin_client.post(reverse("console:key-new"), {"name": "ci", "role": "member"}).status_code == 200
    assert ApiKey.objects.filter(team=world.team_a, name="ci").exists()
    assert admin_client.post(reverse("console:policy-new"), POLICY).status_code == 302
    assert NetworkPolicy.objects.filter(team=world.team_a, name="pypi").exists()
    assert admin_client.post(reverse("console:invite"), {"email": "new@example.com", "role": "admin"}).status_code == 302
    assert Invitation.objects.get(email="new@example.com").role == Role.ADMIN


def _role(user) -> str:
    return Membership.objects.get(user=user).role


def test_admins_manage_members_but_only_owners_make_or_unmake_owners(
    admin_client: Client, owner_client: Client, world: World
) -> None:
    member = Membership.objects.get(user=world.member)
    owner = Membership.objects.get(user=world.owner)
    admin_client.post(reverse("console:member-role", args=[member.pk]), {"role": Role.ADMIN})
    assert _role(world.member) == Role.ADMIN
    response = admin_client.post(reverse("console:member-role", args=[member.pk]), {"role": Role.OWNER}, follow=True)
    assert b"only owners make owners" in response.content and _role(world.member) == Role.ADMIN
    admin_client.post(reverse("console:member-role", args=[owner.pk]), {"role": Role.MEMBER})
    assert _role(world.owner) == Role.OWNER  # an admin cannot demote an owner
    admin_client.post(reverse("console:member-remove", args=[owner.pk]))
    assert Membership.objects.filter(pk=owner.pk).exists()  # nor remove one
    # An admin may not invite an owner either: the role is not offered, and refused if sent.
    assert b'value="owner"' not in admin_client.get(reverse("console:invite")).content
    response = admin_client.post(reverse("console:invite"), {"email": "boss@example.com", "role": Role.OWNER})
    assert response.status_code == 200 and b"errorlist" in response.content
    assert not Invitation.objects.filter(email="boss@example.com").exists()
    # The owner can.
    owner_client.post(reverse("console:member-role", args=[member.pk]), {"role": Role.OWNER})
    assert _role(world.member) == Role.OWNER


def test_a_team_keeps_one_owner(owner_client: Client, world: World) -> None:
    owner = Membership.objects.get(user=world.owner)
    response = owner_client.post(reverse("console:member-remove", args=[owner.pk]), follow=True)
    assert b"at least one owner" in response.content
    response = owner_client.post(reverse("console:member-role", args=[owner.pk]), {"role": Role.MEMBER}, follow=True)
    assert b"at least one owner" in response.content
    assert _role(world.owner) == Role.OWNER


def test_anyone_may_leave_and_admins_remove_members(member_client: Client, admin_client: Client, world: World) -> None:
    admin = Membership.objects.get(user=world.admin)
    member = Membership.objects.get(user=world.member)
    assert member_client.post(reverse("console:member-remove", args=[admin.pk])).status_code == 302
    assert Membership.objects.filter(pk=admin.pk).exists()  # a member removes no one else
    admin_client.post(reverse("console:member-remove", args=[member.pk]))
    assert not Membership.objects.filter(pk=member.pk).exists()
    assert admin_client.post(reverse("console:member-remove", args=[admin.pk])).status_code == 302
    assert not Membership.objects.filter(pk=admin.pk).exists()
    assert admin_client.get(reverse("console:overview")).status_code == 403  # no team left


def test_members_can_run_commands_and_kill(member_client: Client, world: World, make_sandbox) -> None:
    sandbox = make_sandbox(world.key_a)
    url = reverse("console:sandbox-exec", args=[sandbox.id])
    for headers in ({}, {"HX-Request": "true"}):  # a plain form post, and htmx's
        response = member_client.post(url, {"cmd": "id", "timeout_s": "5"}, headers=headers)
        assert response.status_code == 200 and b"This sandbox is queued: commands run only while it runs" in response.content
    assert member_client.post(reverse("console:sandbox-kill", args=[sandbox.id])).status_code == 302
    sandbox.refresh_from_db()
    assert sandbox.state == "destroyed"  # it never reached a host: gone at once
