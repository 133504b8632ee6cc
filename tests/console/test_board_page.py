"""The board's page: the board's own launches unless another is picked, the first frame in the page,
presets over the team's limits shown as such, Tear down in place naming whose launch."""

from __future__ import annotations

import base64
import json
import re

import pytest
from django.test import Client
from django.urls import reverse

from console.audit import Actor, audit_record
from console.models import TeamLimits
from sandboxes.board import protocol as wire
from tests.console.conftest import World

pytestmark = pytest.mark.django_db


def config(html: str) -> dict:
    found = re.search(r'<script id="board-config" type="application/json">(.*?)</script>', html, re.S)
    assert found
    return json.loads(found.group(1))


def test_the_board_opens_its_own_launches_unless_another_is_picked(member_client: Client, world: World, make_launch) -> None:
    own = make_launch(world.key_a, count=6, labels={"board": "small", "board_text": "forkyard"})
    training = make_launch(world.key_a, count=4)  # a teammate's training run, newer
    assert training.created_at >= own.created_at
    page = member_client.get(reverse("console:board")).content.decode()
    assert config(page)["launch"] == own.id and training.id not in page
    picked = member_client.get(reverse("console:board"), {"launch": training.id}).content.decode()
    assert config(picked)["launch"] == training.id


def test_the_first_frame_is_in_the_page(member_client: Client, world: World, make_launch) -> None:
    launch = make_launch(world.key_a, count=6, labels={"board": "small"})
    frame = config(member_client.get(reverse("console:board")).content.decode())["first_frame"]
    layout, snapshot = (wire.parse(base64.b64decode(frame[name])) for name in ("layout", "snapshot"))
    assert layout["kind"] == "L" and layout["sections"][0]["launch"] == launch.id
    [section] = snapshot["sections"]
    assert section["launch"] == launch.id and len(section["states"]) == 6 and section["counters"].requested == 6


def test_presets_over_the_teams_limits_are_shown_as_such(member_client: Client, world: World) -> None:
    TeamLimits.objects.filter(team=world.team_a).update(max_launch_count=1000, max_sandboxes=600)
    page = member_client.get(reverse("console:board")).content.decode()
    options = dict(re.findall(r'<option value="(\w+)"( disabled)?', page))
    assert options == {"small": "", "medium": " disabled", "full": " disabled"}
    assert "medium: 4,096 sandboxes, over the team&#x27;s limit of 1,000 sandboxes per launch" in page
    TeamLimits.objects.filter(team=world.team_a).update(max_launch_count=40000, max_sandboxes=600)
    page = member_client.get(reverse("console:board")).content.decode()
    assert "medium: 4,096 sandboxes, over the team&#x27;s limit of 600 sandboxes at once (0 live)" in page
    assert '<option value="small">' in page


def test_tear_down_names_whose_launch_and_answers_in_place(member_client: Client, world: World, make_launch) -> None:
    launch = make_launch(world.key_a, count=3, labels={"board": "small"})
    audit_record(team=world.team_a, actor=Actor(user=world.admin), action="launch.started", target_type="launch", target_id=launch.id)
    page = member_client.get(reverse("console:board")).content.decode()
    assert f"Tear down {launch.id}, started by adam?" in page
    answer = member_client.post(reverse("console:board-teardown", args=[launch.id]), headers={"X-Requested-With": "fetch"})
    assert answer.status_code == 200 and answer.json()["state"] in ("stopping", "stopped")
