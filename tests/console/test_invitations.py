"""Invitations: an admin makes a link; a new user signs up through it, or a signed-in one accepts."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from console.models import Invitation, Membership, Role
from console.selectors import SESSION_TEAM
from tests.console.conftest import PASSWORD, World, client_for

pytestmark = pytest.mark.django_db


def invite(admin_client: Client, email: str, role: str = Role.MEMBER) -> str:
    response = admin_client.post(reverse("console:invite"), {"email": email, "role": role}, follow=True)
    invitation = Invitation.objects.get(email__iexact=email)
    link = reverse("console:invitation", args=[invitation.token])
    assert link in response.content.decode()  # the admin is given the link to send
    return link


def test_a_new_user_signs_up_through_the_link(admin_client: Client, world: World) -> None:
    link = invite(admin_client, "Newbie@Example.com", Role.ADMIN)
    assert link in admin_client.get(reverse("console:members")).content.decode()  # listed while open
    visitor = Client()
    page = visitor.get(link)
    assert page.status_code == 200 and b"Join Team A" in page.content and b"newbie@example.com" in page.content
    mismatch = visitor.post(link, {"username": "newbie", "password1": PASSWORD, "password2": PASSWORD + "x"})
    assert mismatch.status_code == 200 and b'id="id_password2_errors"' in mismatch.content
    weak = visitor.post(link, {"username": "newbie", "password1": "short", "password2": "short"})
    assert b"too short" in weak.content
    taken = visitor.post(link, {"username": "mel", "password1": PASSWORD, "password2": PASSWORD})
    assert b'id="id_username_errors"' in taken.content
    assert not User.objects.filter(username="newbie").exists()
    joined = visitor.post(link, {"username": "newbie", "password1": PASSWORD, "password2": PASSWORD})
    assert joined.status_code == 302 and joined["Location"] == "/"
    user = User.objects.get(username="newbie")
    assert user.email == "newbie@example.com"
    assert Membership.objects.get(user=user, team=world.team_a).role == Role.ADMIN
    assert visitor.session[SESSION_TEAM] == world.team_a.id
    assert visitor.get(reverse("console:keys")).status_code == 200  # signed in, in the team
    assert visitor.get(reverse("console:key-new")).status_code == 200  # with the invited role
    assert Client().get(link).status_code == 404  # used: gone


def test_a_signed_in_user_accepts(admin_client: Client, world: World) -> None:
    link = invite(admin_client, world.stranger.email)
    client = client_for(world.stranger)
    assert b"Accept and join" in client.get(link).content
    assert client.post(link).status_code == 302
    assert Membership.objects.get(user=world.stranger, team=world.team_a).role == Role.MEMBER
    assert client.session[SESSION_TEAM] == world.team_a.id  # they land in the team they joined
    assert b"Team A" in client.get(reverse("console:overview")).content


def test_unknown_and_expired_links_say_so(admin_client: Client, world: World) -> None:
    assert Client().get(reverse("console:invitation", args=["nope"])).status_code == 404
    link = invite(admin_client, "late@example.com")
    Invitation.objects.filter(email="late@example.com").update(expires_at=timezone.now() - timedelta(seconds=1))
    response = Client().post(link, {"username": "late", "password1": PASSWORD, "password2": PASSWORD})
    assert response.status_code == 404 and b"does not work" in response.content
    assert not User.objects.filter(username="late").exists()
