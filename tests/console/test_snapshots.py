"""Snapshots in the console: the detail page, deleting (and its refusal), launching forks, taking one, pause and resume."""

from __future__ import annotations

import html
import time
from decimal import Decimal
from typing import Any

import httpx
import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from billing.models import UsagePeriod
from billing.services import saved_state_transition
from sandboxes.models import Launch, Sandbox, Snapshot
from tests.console.conftest import World
from tests.console.test_exec import browser  # noqa: F401 - the signed-in fixture, for the stack test
from tests.support.stack import Stack

WEB = {"name": "web", "command": "httpd -f -p 8080 -h /srv", "ready": {"tcp": 8080}, "timeout_s": 30.0}


def make_snapshot(world: World, team: Any = None, **fields: Any) -> Snapshot:
    values: dict[str, Any] = {"name": "deps", "template": "base", "state": "ready", "size_bytes": 3 * 2**20, "services": [WEB]}
    values.update(fields)
    snapshot = Snapshot.objects.create(team=team or world.team_a, **values)
    if snapshot.state == Snapshot.State.READY:
        saved_state_transition(snapshot=snapshot, gib=Decimal("0.003"), at=timezone.now())
    return snapshot


def messages_of(response: Any) -> str:
    return html.unescape(response.content.decode())


# --- without an engine ------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_detail_page_shows_size_parent_forks_and_services(member_client: Client, world: World, make_sandbox) -> None:
    parent = make_snapshot(world, name="base-env")
    snapshot = make_snapshot(world, name="with-deps", parent=parent, layer_id="sha256:abc", total_bytes=9 * 2**20, paused_ms=4.5)
    make_sandbox(world.key_a, snapshot=snapshot, state="running")
    make_sandbox(world.key_a, snapshot=snapshot, state="destroyed")
    page = member_client.get(reverse("console:snapshot", args=[snapshot.id]))
    assert page.status_code == 200
    text = messages_of(page)
    assert "with-deps" in text and "3.0\xa0MB" in text and "9.0\xa0MB" in text and "4.5 ms" in text
    assert reverse("console:snapshot", args=[parent.id]) in text  # the parent, linked
    assert "1 live forks" in text and "httpd -f -p 8080 -h /srv" in text and "TCP port 8080 answers" in text
    assert 'action="' + reverse("console:snapshot-launch", args=[snapshot.id]) in text
    listed = member_client.get(reverse("console:snapshots")).content.decode()
    assert reverse("console:snapshot", args=[snapshot.id]) in listed
    parent_page = messages_of(member_client.get(reverse("console:snapshot", args=[parent.id])))
    assert reverse("console:snapshot", args=[snapshot.id]) in parent_page  # its child, listed


@pytest.mark.django_db
def test_a_snapshot_being_taken_refreshes_itself(member_client: Client, world: World) -> None:
    snapshot = make_snapshot(world, state="creating", size_bytes=0)
    page = member_client.get(reverse("console:snapshot", args=[snapshot.id])).content.decode()
    assert 'hx-trigger="every 1s"' in page and "Forks can be made once it is ready" in page
    partial = member_client.get(reverse("console:snapshot", args=[snapshot.id]), headers={"HX-Request": "true"})
    assert partial.content.decode().lstrip().startswith('<section id="snapshot-state"')
    Snapshot.objects.filter(pk=snapshot.pk).update(state="failed", error_code="too_large", error="the layer is too big")
    failed = member_client.get(reverse("console:snapshot", args=[snapshot.id]), headers={"HX-Request": "true"}).content.decode()
    assert "every 1s" not in failed and "too_large" in failed and "the layer is too big" in failed


@pytest.mark.django_db
def test_delete_is_refused_while_forks_live_then_done(member_client: Client, world: World, make_sandbox) -> None:
    snapshot = make_snapshot(world)
    fork = make_sandbox(world.key_a, snapshot=snapshot, state="running")
    refused = member_client.post(reverse("console:snapshot-delete", args=[snapshot.id]), follow=True)
    assert refused.redirect_chain[-1][0] == reverse("console:snapshot", args=[snapshot.id])
    assert "in use by 1 live sandboxes" in messages_of(refused)
    assert Snapshot.objects.get(pk=snapshot.pk).state == "ready"

    Sandbox.objects.filter(pk=fork.pk).update(state="destroyed")
    deleted = member_client.post(reverse("console:snapshot-delete", args=[snapshot.id]), follow=True)
    assert deleted.redirect_chain[-1][0] == reverse("console:snapshots")
    assert "deleted; its saved-state billing has ended" in messages_of(deleted)
    assert Snapshot.objects.get(pk=snapshot.pk).state == "deleted"
    assert UsagePeriod.objects.get(snapshot=snapshot).ended_at is not None
    assert member_client.get(reverse("console:snapshot", args=[snapshot.id])).status_code == 404


@pytest.mark.django_db
def test_launch_from_the_snapshot_page(member_client: Client, world: World, host) -> None:
    snapshot = make_snapshot(world)
    launched = member_client.post(
        reverse("console:snapshot-launch", args=[snapshot.id]), {"count": "3", "size": "tiny", "ttl_s": "600"}
    )
    launch = Launch.objects.get(team=world.team_a)
    assert launched.status_code == 302 and launched["Location"] == reverse("console:launch", args=[launch.id])
    assert (launch.snapshot_id, launch.count, launch.template, launch.api_key) == (snapshot.id, 3, "base", None)

    zero = member_client.post(
        reverse("console:snapshot-launch", args=[snapshot.id]), {"count": "0", "size": "tiny", "ttl_s": "600"}
    )
    assert zero.status_code == 400 and "greater than or equal to 1" in messages_of(zero)
    too_many = member_client.post(
        reverse("console:snapshot-launch", args=[snapshot.id]), {"count": "5000", "size": "tiny", "ttl_s": "600"}, follow=True
    )
    assert "the team may run 1000 sandboxes at once" in messages_of(too_many)
    assert Launch.objects.filter(team=world.team_a).count() == 1


@pytest.mark.django_db
def test_taking_a_snapshot_from_the_sandbox_page(member_client: Client, world: World, host, make_sandbox) -> None:
    sandbox = make_sandbox(world.key_a, host=host, state="running", engine_id="sb-engine")
    page = member_client.get(reverse("console:sandbox", args=[sandbox.id])).content.decode()
    assert 'action="' + reverse("console:sandbox-snapshot", args=[sandbox.id]) in page
    assert 'action="' + reverse("console:sandbox-pause", args=[sandbox.id]) in page

    form: dict[str, str] = {"name": "from-console", "services-TOTAL_FORMS": "2", "services-INITIAL_FORMS": "0"}
    form.update(
        {
            "services-0-name": "web",
            "services-0-command": WEB["command"],
            "services-0-ready": "http",
            "services-0-check": "8080/health",
            "services-0-timeout_s": "20",
        }
    )
    form.update(
        {
            "services-1-name": "",
            "services-1-command": "",
            "services-1-ready": "tcp",
            "services-1-check": "",
            "services-1-timeout_s": "30",
        }
    )
    taken = member_client.post(reverse("console:sandbox-snapshot", args=[sandbox.id]), form)
    snapshot = Snapshot.objects.get(team=world.team_a)
    assert taken.status_code == 302 and taken["Location"] == reverse("console:snapshot", args=[snapshot.id])
    assert (snapshot.name, snapshot.state, snapshot.source_sandbox_id, snapshot.host_id) == (
        "from-console",
        "creating",
        sandbox.id,
        host.id,
    )
    assert snapshot.services == [
        {"name": "web", "command": WEB["command"], "ready": {"http": {"port": 8080, "path": "/health"}}, "timeout_s": 20.0}
    ]

    bad = dict(form, **{"services-0-name": "Web Server", "services-0-ready": "tcp", "services-0-check": "eighty"})
    refused = member_client.post(reverse("console:sandbox-snapshot", args=[sandbox.id]), bad)
    assert refused.status_code == 400 and "A port number" in messages_of(refused)
    bad_name = dict(form, **{"services-0-name": "Web Server"})
    refused = member_client.post(reverse("console:sandbox-snapshot", args=[sandbox.id]), bad_name)
    assert refused.status_code == 400 and "should match pattern" in messages_of(refused)
    assert Snapshot.objects.filter(team=world.team_a).count() == 1

    stopped = make_sandbox(world.key_a, host=host, state="destroyed")
    late = member_client.post(reverse("console:sandbox-snapshot", args=[stopped.id]), {**form, "name": "late"})
    assert late.status_code == 400 and "only a running or paused sandbox can be snapshotted" in messages_of(late)


@pytest.mark.django_db
def test_pause_on_an_unreachable_host_is_a_message(member_client: Client, world: World, host, make_sandbox) -> None:
    sandbox = make_sandbox(world.key_a, host=host, state="running", engine_id="gone")
    response = member_client.post(reverse("console:sandbox-pause", args=[sandbox.id]), follow=True)
    assert "host is not answering" in messages_of(response)
    assert Sandbox.objects.get(pk=sandbox.pk).state == "running"
    queued = make_sandbox(world.key_a)
    response = member_client.post(reverse("console:sandbox-resume", args=[queued.id]), follow=True)
    assert f"sandbox {queued.id} is queued" in messages_of(response)


@pytest.mark.django_db
def test_another_teams_snapshots_and_sandboxes_are_not_found(
    client: Client, member_client: Client, world: World, make_sandbox
) -> None:
    theirs = make_snapshot(world, team=world.team_b)
    their_sandbox = make_sandbox(world.key_b, state="running")
    for method, url in [
        ("get", reverse("console:snapshot", args=[theirs.id])),
        ("post", reverse("console:snapshot-delete", args=[theirs.id])),
        ("post", reverse("console:snapshot-launch", args=[theirs.id])),
        ("post", reverse("console:sandbox-snapshot", args=[their_sandbox.id])),
        ("post", reverse("console:sandbox-pause", args=[their_sandbox.id])),
        ("post", reverse("console:sandbox-resume", args=[their_sandbox.id])),
    ]:
        assert getattr(member_client, method)(url).status_code == 404, url
        assert getattr(client, method)(url).status_code == 302, url  # anonymous: sign in first
    assert Snapshot.objects.get(pk=theirs.pk).state == "ready"


# --- against the real stack ----------------------------------------------------------------------


def post(signed_in: httpx.Client, url: str, data: dict[str, str]) -> httpx.Response:
    return signed_in.post(url, data={**data, "csrfmiddlewaretoken": signed_in.cookies["csrftoken"]})


@pytest.mark.root
def test_pause_snapshot_and_launch_from_the_console(stack: Stack, browser: httpx.Client) -> None:  # noqa: F811
    with stack.client() as api:
        sandbox = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 300}).json()["id"]
        api.post(f"/api/v1/sandboxes/{sandbox}/exec", json={"cmd": "mkdir -p /srv && echo console-page > /srv/index.html"})
        try:
            assert post(browser, f"/sandboxes/{sandbox}/pause/", {}).status_code == 302
            assert api.get(f"/api/v1/sandboxes/{sandbox}").json()["state"] == "paused"
            assert 'action="/sandboxes/' + sandbox + '/resume/"' in browser.get(f"/sandboxes/{sandbox}/").text
            assert post(browser, f"/sandboxes/{sandbox}/resume/", {}).status_code == 302
            assert api.get(f"/api/v1/sandboxes/{sandbox}").json()["state"] == "running"

            form = {
                "name": "console-web",
                "services-TOTAL_FORMS": "1",
                "services-INITIAL_FORMS": "0",
                "services-0-name": "web",
                "services-0-command": "httpd -f -p 8080 -h /srv",
                "services-0-ready": "tcp",
                "services-0-check": "8080",
                "services-0-timeout_s": "20",
            }
            taken = post(browser, f"/sandboxes/{sandbox}/snapshot/", form)
            assert taken.status_code == 302, taken.text[:2000]
            snapshot = taken.headers["location"].strip("/").split("/")[-1]
            deadline = time.monotonic() + 60
            while "every 1s" in browser.get(f"/snapshots/{snapshot}/").text and time.monotonic() < deadline:
                time.sleep(0.2)
            page = browser.get(f"/snapshots/{snapshot}/").text
            assert "state-ready" in page and "Launch from this snapshot" in page

            launched = post(browser, f"/snapshots/{snapshot}/launch/", {"count": "2", "size": "tiny", "ttl_s": "120"})
            assert launched.status_code == 302 and launched.headers["location"].startswith("/launches/launch_")
            launch = launched.headers["location"].strip("/").split("/")[-1]
            deadline = time.monotonic() + 60
            while api.get(f"/api/v1/launches/{launch}").json()["progress"]["running"] < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            forks = api.get(f"/api/v1/launches/{launch}/sandboxes").json()["sandboxes"]
            for fork in forks:
                result = api.post(f"/api/v1/sandboxes/{fork['id']}/exec", json={"cmd": "wget -qO- http://127.0.0.1:8080/"}).json()
                assert result["stdout"] == "console-page\n"

            refused = post(browser, f"/snapshots/{snapshot}/delete/", {})
            assert refused.headers["location"] == f"/snapshots/{snapshot}/"
            assert "in use by 2 live sandboxes" in html.unescape(browser.get(f"/snapshots/{snapshot}/").text)
            api.delete(f"/api/v1/launches/{launch}")
            deadline = time.monotonic() + 60
            while api.get(f"/api/v1/snapshots/{snapshot}").json()["forks_alive"] and time.monotonic() < deadline:
                time.sleep(0.2)
            assert post(browser, f"/snapshots/{snapshot}/delete/", {}).headers["location"] == "/snapshots/"
            assert api.get(f"/api/v1/snapshots/{snapshot}").status_code == 404
        finally:
            api.delete(f"/api/v1/sandboxes/{sandbox}")
