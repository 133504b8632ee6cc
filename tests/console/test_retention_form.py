"""The Inference page's form: what a team keeps of prompts and outputs, and whether it requires zero
retention from providers; a team's admins change it, for their team alone, and a wrong value changes nothing
and says why."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from console.models import AuditEntry, Team
from grading.models import TeamInference
from tests.console.conftest import World, client_for

pytestmark = pytest.mark.django_db


def kept(team: Team) -> tuple[int, bool]:
    settings = TeamInference.objects.filter(team=team).first()
    return Team.objects.get(pk=team.pk).retain_content_days, bool(settings and settings.zero_retention)


def test_an_admin_turns_retention_and_zero_retention_on_then_off(admin_client: Client, world: World) -> None:
    page = admin_client.post(reverse("console:retention"), {"retain_days": "30", "zero_retention": "on"}, follow=True)
    assert kept(world.team_a) == (30, True)
    assert "Saved: content is kept 30 days; calls go only to providers that keep nothing." in page.content.decode()
    assert "kept <strong>30 days</strong>" in page.content.decode()
    assert kept(world.team_b) == (0, False), "another team's setting is its own"
    admin_client.post(reverse("console:retention"), {"retain_days": "0"})
    assert kept(world.team_a) == (0, False), "an unticked box turns zero retention off"
    # Each change is in the team's audit log, with who made it and each setting from and to.
    entries = AuditEntry.objects.filter(team=world.team_a, action="retention.changed").order_by("at", "id")
    assert [(entry.actor, entry.details) for entry in entries] == [
        ("user adam", {"retain_days": {"from": 0, "to": 30}, "zero_retention": {"from": False, "to": True}}),
        ("user adam", {"retain_days": {"from": 30, "to": 0}, "zero_retention": {"from": True, "to": False}}),
    ]
    admin_client.post(reverse("console:retention"), {"retain_days": "0"})
    assert entries.count() == 2, "a save that changes nothing is not a change"


@pytest.mark.parametrize(
    "form",
    [{"retain_days": "31"}, {"retain_days": "abc"}, {"retain_days": "-1"}, {"retain_days": "30", "keep_forever": "on"}],
    ids=["over-30", "not-a-number", "negative", "unknown-field"],
)
def test_a_wrong_value_changes_nothing_and_says_why(admin_client: Client, world: World, form: dict[str, str]) -> None:
    admin_client.post(reverse("console:retention"), {"retain_days": "30", "zero_retention": "on"})
    page = admin_client.post(reverse("console:retention"), form, follow=True)
    assert page.status_code == 200
    assert "Nothing changed:" in page.content.decode()
    assert kept(world.team_a) == (30, True)
    assert AuditEntry.objects.filter(team=world.team_a, action="retention.changed").count() == 1, "only the first save"


def test_a_member_cannot_change_it(world: World) -> None:
    answer = client_for(world.member).post(reverse("console:retention"), {"retain_days": "30", "zero_retention": "on"})
    assert answer.status_code == 403
    assert kept(world.team_a) == (0, False)
    page = client_for(world.member).get(reverse("console:inference")).content.decode()
    assert 'action="/inference/retention/"' not in page, "the form is shown only to those who may use it"
