"""Forms validate, and say what is wrong next to the field that is wrong."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import reverse

from sandboxes.models import NetworkPolicy
from tests.console.conftest import World

pytestmark = pytest.mark.django_db


def field_errors(html: str, field_id: str) -> str:
    """The error list rendered right under a field (see console/_field.html)."""
    match = re.search(rf'id="{field_id}".*?<ul class="errorlist" id="{field_id}_errors"[^>]*>(.*?)</ul>', html, re.S)
    assert match, f"no errors shown under {field_id}"
    return match.group(1)


def test_a_bad_network_is_shown_at_the_rules(admin_client: Client, world: World) -> None:
    response = admin_client.post(
        reverse("console:policy-new"),
        {"name": "bad", "egress": "pypi.org 443\n10.0.0.300/8 443\nexample.com 70000\nhost.example udp2"},
    )
    assert response.status_code == 200
    errors = field_errors(response.content.decode(), "id_egress")
    assert "Line 2: &#x27;10.0.0.300/8&#x27; is neither a network (CIDR) nor a host name" in errors
    assert "Line 3: ports are 1 to 65535" in errors
    assert "Line 4" in errors
    assert not NetworkPolicy.objects.filter(team=world.team_a).exists()


def test_a_policy_is_created_edited_and_deleted(admin_client: Client, world: World) -> None:
    response = admin_client.post(
        reverse("console:policy-new"),
        {"name": "deps", "description": "package indexes", "egress": "pypi.org 443\n10.1.2.3/8 53 udp\n# a comment\n"},
    )
    assert response.status_code == 302
    policy = NetworkPolicy.objects.get(team=world.team_a, name="deps")
    assert policy.egress == [
        {"cidr": None, "host": "pypi.org", "ports": [443], "protocol": "tcp"},
        {"cidr": "10.0.0.0/8", "host": None, "ports": [53], "protocol": "udp"},
    ]
    edit = admin_client.get(reverse("console:policy-edit", args=[policy.id])).content.decode()
    assert "pypi.org 443 tcp\n10.0.0.0/8 53 udp" in edit  # the rules, written back as typed
    admin_client.post(reverse("console:policy-edit", args=[policy.id]), {"name": "deps", "egress": "files.example.org"})
    policy.refresh_from_db()
    assert policy.egress == [{"cidr": None, "host": "files.example.org", "ports": [], "protocol": "tcp"}]
    assert admin_client.post(reverse("console:policy-delete", args=[policy.id])).status_code == 302
    assert not NetworkPolicy.objects.filter(pk=policy.pk).exists()


def test_a_taken_policy_name_is_shown_at_the_name(admin_client: Client, world: World, make_policy) -> None:
    make_policy(world.team_a, name="pypi")
    response = admin_client.post(reverse("console:policy-new"), {"name": "pypi", "egress": ""})
    assert "a network policy named &#x27;pypi&#x27; exists" in field_errors(response.content.decode(), "id_name")


def test_a_policy_in_use_is_not_deleted(admin_client: Client, world: World, make_policy, make_sandbox) -> None:
    policy = make_policy(world.team_a)
    make_sandbox(world.key_a, network_policy=policy, state="running")
    response = admin_client.post(reverse("console:policy-delete", args=[policy.id]), follow=True)
    assert b"sandboxes still run under this policy" in response.content
    assert NetworkPolicy.objects.filter(pk=policy.pk).exists()


def test_an_empty_key_name_is_shown_at_the_name(admin_client: Client) -> None:
    response = admin_client.post(reverse("console:key-new"), {"name": "  ", "role": "member"})
    assert response.status_code == 200
    assert "This field is required." in field_errors(response.content.decode(), "id_name")
    response = admin_client.post(reverse("console:key-new"), {"name": "ci", "role": "owner", "expires_in_days": "0"})
    html = response.content.decode()
    assert "Select a valid choice" in field_errors(html, "id_role")
    assert "greater than or equal to 1" in field_errors(html, "id_expires_in_days")


def test_an_invitation_needs_a_real_email(admin_client: Client, world: World) -> None:
    response = admin_client.post(reverse("console:invite"), {"email": "not-an-email", "role": "member"})
    assert "Enter a valid email address." in field_errors(response.content.decode(), "id_email")
    response = admin_client.post(reverse("console:invite"), {"email": world.member.email, "role": "member"})
    assert "already a member" in field_errors(response.content.decode(), "id_email")


def test_an_empty_command_is_shown_at_the_command(member_client: Client, world: World, make_sandbox) -> None:
    sandbox = make_sandbox(world.key_a, state="running", engine_id="e1")
    url = reverse("console:sandbox-exec", args=[sandbox.id])
    response = member_client.post(url, {"cmd": "   ", "timeout_s": "1000"}, headers={"HX-Request": "true"})
    html = response.content.decode()
    assert response.status_code == 200 and not html.startswith("<!doctype")  # the partial only
    assert "Type a command to run." in field_errors(html, "id_cmd")
    assert "less than or equal to 120" in field_errors(html, "id_timeout_s")


def test_bad_list_filters_are_shown_and_ignored(member_client: Client, world: World, make_sandbox) -> None:
    sandbox = make_sandbox(world.key_a)
    response = member_client.get(reverse("console:sandboxes"), {"state": "sleeping", "label": "a__b=1", "cursor": "junk|x"})
    html = response.content.decode()
    assert response.status_code == 200 and sandbox.id in html
    assert "Select a valid choice" in field_errors(html, "id_state")
    assert "no double underscore" in field_errors(html, "id_label")
