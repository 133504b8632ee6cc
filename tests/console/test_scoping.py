"""A team sees only its own objects: another team's are not found, and never listed."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from console.models import ApiKey, Membership, Role
from sandboxes.models import ExposedPort, Sandbox
from tests.console.conftest import World, client_for

pytestmark = pytest.mark.django_db


@pytest.fixture
def theirs(world: World, make_sandbox, make_launch, make_policy) -> dict[str, str]:
    """Team B's objects, with names that must never show on team A's pages."""
    return {
        "sandbox": make_sandbox(world.key_b, labels={"secret": "team-b-label"}).id,
        "launch": make_launch(world.key_b, count=2, labels={"secret": "team-b-launch"}).id,
        "policy": make_policy(world.team_b, name="team-b-policy").id,
        "key": world.key_b.id,
    }


def test_another_teams_objects_are_not_found(member_client: Client, admin_client: Client, theirs: dict[str, str]) -> None:
    for name, object_id in [("sandbox", theirs["sandbox"]), ("launch", theirs["launch"])]:
        assert member_client.get(reverse(f"console:{name}", args=[object_id])).status_code == 404, name
    assert member_client.post(reverse("console:sandbox-exec", args=[theirs["sandbox"]]), {"cmd": "id"}).status_code == 404
    assert member_client.post(reverse("console:sandbox-kill", args=[theirs["sandbox"]])).status_code == 404
    assert member_client.get(reverse("console:sandbox-desktop", args=[theirs["sandbox"]])).status_code == 404
    view = reverse("console:sandbox-desktop-view", args=[theirs["sandbox"]])
    assert member_client.post(view, {"mode": "control"}).status_code == 404
    for name in ("policy-edit", "policy-delete"):
        assert admin_client.get(reverse(f"console:{name}", args=[theirs["policy"]])).status_code == 404, name
    assert admin_client.post(reverse("console:policy-delete", args=[theirs["policy"]])).status_code == 404
    assert admin_client.post(reverse("console:key-revoke", args=[theirs["key"]])).status_code == 404
    # Nothing changed on team B's side.
    assert Sandbox.objects.get(pk=theirs["sandbox"]).state == Sandbox.State.QUEUED
    assert ApiKey.objects.get(pk=theirs["key"]).revoked_at is None


def test_another_teams_members_cannot_be_touched(owner_client: Client, world: World) -> None:
    stranger = Membership.objects.get(user=world.stranger)
    assert owner_client.post(reverse("console:member-role", args=[stranger.pk]), {"role": Role.MEMBER}).status_code == 404
    assert owner_client.post(reverse("console:member-remove", args=[stranger.pk])).status_code == 404
    assert Membership.objects.get(pk=stranger.pk).role == Role.OWNER


def test_lists_show_only_the_teams_own(member_client: Client, world: World, theirs: dict[str, str], make_sandbox) -> None:
    mine = make_sandbox(world.key_a)
    pages = {
        name: member_client.get(reverse(f"console:{name}")).content.decode()
        for name in ("overview", "sandboxes", "launches", "policies", "keys", "members", "usage")
    }
    assert mine.id in pages["sandboxes"]
    leaks = [
        theirs["sandbox"],
        theirs["launch"],
        theirs["policy"],
        "team-b-policy",
        "team-b-label",
        "team-b-launch",
        world.key_b.prefix,
        "other-trainer",
        world.stranger.username,
        "Team B",
    ]
    for name, content in pages.items():
        for leak in leaks:
            assert leak not in content, (name, leak)


def test_the_team_switcher_changes_team_only_to_ones_you_belong_to(world: World, make_sandbox) -> None:
    Membership.objects.create(team=world.team_b, user=world.member, role=Role.MEMBER)
    theirs = make_sandbox(world.key_b)
    client = client_for(world.member)
    first = client.get(reverse("console:sandboxes")).content.decode()
    assert 'id="team-select"' in first and theirs.id not in first  # team A is the default (by name)
    assert client.post(reverse("console:switch-team"), {"team": world.team_b.id}).status_code == 302
    assert theirs.id in client.get(reverse("console:sandboxes")).content.decode()
    assert client.get(reverse("console:sandbox", args=[theirs.id])).status_code == 200
    # A team one does not belong to cannot be switched to.
    outsider = client_for(world.stranger)
    response = outsider.post(reverse("console:switch-team"), {"team": world.team_a.id}, follow=True)
    assert b"not a member of that team" in response.content
    assert b"Team A" not in outsider.get(reverse("console:overview")).content


def test_a_desktop_view_of_an_unknown_mode_is_refused(member_client: Client, world: World, make_sandbox) -> None:
    ours = make_sandbox(world.key_a).id
    refused = member_client.post(reverse("console:sandbox-desktop-view", args=[ours]), {"mode": "everything"})
    assert refused.status_code == 400 and b"mode is one of view, control" in refused.content
    # Not running (queued): no desktop to show, said, and no port exposed for it.
    idle = member_client.post(reverse("console:sandbox-desktop-view", args=[ours]), {"mode": "view"})
    assert idle.status_code == 409 and b"No desktop runs" in idle.content
    assert not ExposedPort.objects.filter(sandbox_id=ours).exists()
    assert member_client.get(reverse("console:sandbox-desktop", args=[ours])).content.count(b"Watch live") == 0
