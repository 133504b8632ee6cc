"""Templates in the console: the list, a team template's page with its last build, refreshing while it runs."""

from __future__ import annotations

import html

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from sandboxes.models import Template, TemplateBuild
from tests.console.conftest import World
from tests.console.test_snapshots import make_snapshot

STEPS = [
    {"name": "apt install git", "kind": "apt", "state": "done", "seconds": 12.5, "snapshot": None},
    {"name": "run make", "kind": "run", "state": "running", "seconds": None, "snapshot": None},
]


@pytest.mark.django_db
def test_a_team_templates_page_shows_its_build_and_refreshes_while_it_runs(member_client: Client, world: World) -> None:
    snapshot = make_snapshot(world, name="step")
    STEPS[0]["snapshot"] = snapshot.id
    template = Template.objects.create(team=world.team_a, name="my-env", state="building", description="for the tests")
    build = TemplateBuild.objects.create(
        team=world.team_a, template=template, state="building", steps=STEPS, log="compiling <x>\n"
    )
    listing = html.unescape(member_client.get(reverse("console:templates")).content.decode())
    assert reverse("console:template", args=["my-env"]) in listing and "building" in listing and "this team" in listing

    page = html.unescape(member_client.get(reverse("console:template", args=["my-env"])).content.decode())
    assert build.id in page and "apt install git" in page and "12.50" in page and snapshot.id in page
    assert 'hx-trigger="every 1s"' in page and "compiling <x>" in page
    partial = member_client.get(reverse("console:template", args=["my-env"]), headers={"HX-Request": "true"}).content.decode()
    assert partial.lstrip().startswith('<section id="template-build"') and "&lt;x&gt;" in partial, "the log is escaped"

    TemplateBuild.objects.filter(pk=build.pk).update(
        state="failed", error_code="step_failed", error="step 2 (run make): it exited with 2", error_output="make: *** [all] Error 2",
        ended_at=timezone.now(),
    )  # fmt: skip
    failed = html.unescape(
        member_client.get(reverse("console:template", args=["my-env"]), headers={"HX-Request": "true"}).content.decode()
    )
    assert "every 1s" not in failed and "step_failed" in failed and "make: *** [all] Error 2" in failed


@pytest.mark.django_db
def test_a_global_template_has_a_page_and_another_teams_is_not_found(member_client: Client, world: World) -> None:
    Template.objects.get_or_create(team=None, name="base")
    assert "serves every team" in member_client.get(reverse("console:template", args=["base"])).content.decode()
    Template.objects.create(team=world.team_b, name="theirs")
    assert member_client.get(reverse("console:template", args=["theirs"])).status_code == 404
