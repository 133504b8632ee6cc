"""Lists stay fast with many sandboxes: keyset pages, counts in the database, constant queries."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from sandboxes.models import Sandbox
from tests.console.conftest import World

pytestmark = pytest.mark.django_db
ROWS = 2000


@pytest.fixture
def many(world: World) -> list[str]:
    """2,000 sandboxes in team A, a millisecond apart; every tenth failed, labelled by shard."""
    start = timezone.now()
    rows = [
        Sandbox(
            team=world.team_a,
            api_key=world.key_a,
            template="base",
            size="tiny",
            cpu=1.0,
            memory_mib=128,
            ttl_s=600,
            state=Sandbox.State.FAILED if index % 10 == 0 else Sandbox.State.RUNNING,
            labels={"shard": str(index % 4)},
            created_at=start - timedelta(milliseconds=index),
        )
        for index in range(ROWS)
    ]
    Sandbox.objects.bulk_create(rows, batch_size=500)
    return [row.id for row in rows]  # newest first


def sandbox_ids(html: str) -> list[str]:
    return re.findall(r'<a class="mono" href="/sandboxes/(sb_[0-9a-f]+)/">', html)


def next_link(html: str) -> str | None:
    match = re.search(r'<a rel="next" href="([^"]+)"', html)
    return match.group(1).replace("&amp;", "&") if match else None


def test_the_list_pages_with_constant_queries(member_client: Client, many: list[str], django_assert_max_num_queries) -> None:
    url = reverse("console:sandboxes") + "?state=all"
    with django_assert_max_num_queries(8) as first_queries:
        first = member_client.get(url).content.decode()
    assert sandbox_ids(first) == many[:50]
    assert "2,000</strong>" in first  # the count comes from the database, not from the rows
    link = next_link(first)
    assert link and "cursor=" in link
    with django_assert_max_num_queries(len(first_queries.captured_queries)):
        second = member_client.get(reverse("console:sandboxes") + link).content.decode()
    assert sandbox_ids(second) == many[50:100]
    # The last page has no next link.
    last, pages = first, 1
    while (link := next_link(last)) is not None:
        last, pages = member_client.get(reverse("console:sandboxes") + link).content.decode(), pages + 1
    assert pages == ROWS // 50 and sandbox_ids(last) == many[-50:]


def test_ended_sandboxes_are_hidden_unless_asked_and_one_is_found_by_id(member_client: Client, many: list[str]) -> None:
    url = reverse("console:sandboxes")
    live = member_client.get(url).content.decode()
    failed = set(many[0::10])
    assert sandbox_ids(live) == [sandbox_id for sandbox_id in many if sandbox_id not in failed][:50]
    assert "1,800 matching" in live and "200 ended not shown" in live
    ended = many[10]
    found = member_client.get(url, {"q": ended})  # an exact id goes to its page, ended or not
    assert found.status_code == 302 and found["Location"] == reverse("console:sandbox", args=[ended])
    prefix = member_client.get(url, {"q": ended[:-2], "state": "all"}).content.decode()
    assert ended in sandbox_ids(prefix) and len(sandbox_ids(prefix)) < 50
    assert "id starts with" in member_client.get(url, {"q": "sb_nobody"}).content.decode()


def test_filters_by_state_and_label(member_client: Client, many: list[str]) -> None:
    url = reverse("console:sandboxes")
    failed = member_client.get(url, {"state": "failed"}).content.decode()
    assert sandbox_ids(failed) == many[0:500:10][:50]
    assert "200 matching" in failed
    labelled = member_client.get(url, {"label": "shard=1", "state": "all"}).content.decode()
    assert sandbox_ids(labelled) == many[1::4][:50]
    assert "500 matching" in labelled
    assert "label=shard%3D1" in (next_link(labelled) or "")  # the filter carries over to the next page


def test_htmx_asks_get_only_the_table(member_client: Client, many: list[str]) -> None:
    response = member_client.get(reverse("console:sandboxes"), {"state": "running"}, headers={"HX-Request": "true"})
    html = response.content.decode()
    assert html.lstrip().startswith('<section id="sandbox-table"') and "<html" not in html
    assert 'hx-trigger="every 5s"' in html and "HX-Request" in response["Vary"]
    assert len(sandbox_ids(html)) == 50


def test_a_launch_lists_its_sandboxes_by_page(member_client: Client, world: World, make_launch) -> None:
    launch = make_launch(world.key_a, count=120)
    url = reverse("console:launch", args=[launch.id])
    html = member_client.get(url).content.decode()
    assert len(sandbox_ids(html)) == 50 and "120" in html
    second = member_client.get(url + next_link(html)).content.decode()
    assert len(sandbox_ids(second)) == 50 and not set(sandbox_ids(second)) & set(sandbox_ids(html))
    third = member_client.get(url + next_link(second)).content.decode()
    assert len(sandbox_ids(third)) == 20 and next_link(third) is None
    progress = member_client.get(url, {"part": "progress"}, headers={"HX-Request": "true"}).content.decode()
    assert progress.lstrip().startswith('<section id="launch-progress"') and "every 2s" in progress
    members = member_client.get(url, {"part": "members"}, headers={"HX-Request": "true"}).content.decode()
    assert members.lstrip().startswith('<section id="launch-members"') and "every 2s" in members  # listed as they come
    assert len(sandbox_ids(members)) == 50


def test_launches_show_running_counts_without_a_query_a_row(
    member_client: Client, world: World, make_launch, django_assert_max_num_queries
) -> None:
    for _ in range(5):
        make_launch(world.key_a, count=4)
    Sandbox.objects.filter(team=world.team_a, launch_index__lt=3).update(state="running")
    with django_assert_max_num_queries(6):
        html = member_client.get(reverse("console:launches")).content.decode()
    assert html.count('<td class="num">3</td>') == 5


def test_the_overview_counts_in_the_database(member_client: Client, world: World, make_launch, make_sandbox) -> None:
    make_launch(world.key_a, count=5)
    make_sandbox(world.key_a, state="running")
    make_sandbox(world.key_a, state="running")
    make_sandbox(world.key_a, state="destroyed")
    html = member_client.get(reverse("console:overview")).content.decode()
    running = re.search(r'Running now</div><div class="value">(\d+)</div>', html)
    launches = re.search(r'Launches today</div><div class="value">(\d+)</div>', html)
    assert running and running.group(1) == "2"
    assert launches and launches.group(1) == "1"
    assert "7 live in all" in html  # 5 queued in the launch and 2 running; the destroyed one is not live
