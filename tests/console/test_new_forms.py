"""New sandbox and New launch from the console: the API's own checks, shown at their fields; what
they make is recorded as the API's creates are (queued on a host, its command sent)."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from console.models import AuditEntry, TeamLimits
from sandboxes.models import Host, Launch, Sandbox, Template
from tests.console.conftest import World

pytestmark = pytest.mark.django_db


@pytest.fixture
def live_host(db: Any) -> Host:
    host = Host.objects.create(
        name="form-host", queue="host.form", engine_socket="/nonexistent/engine.sock", region="local",
        max_sandboxes=100, cpus=2, memory_mib=8192, last_heartbeat=timezone.now(),
    )
    template, _ = Template.objects.get_or_create(name="base", team=None)
    template.hosts.add(host)
    return host


def test_a_new_sandbox_from_the_console(member_client: Client, world: World, live_host: Host) -> None:
    page = member_client.get(reverse("console:sandbox-new")).content.decode()
    assert 'name="template"' in page and '<option value="base">' in page and 'name="labels"' in page
    too_long = member_client.post(reverse("console:sandbox-new"), {"template": "base", "size": "tiny", "ttl_s": "999999"})
    assert too_long.status_code == 200 and b'id="id_ttl_s_errors"' in too_long.content
    bad_label = member_client.post(reverse("console:sandbox-new"), {"template": "base", "size": "tiny", "ttl_s": "60", "labels": "a b"})
    assert b'id="id_labels_errors"' in bad_label.content
    made = member_client.post(reverse("console:sandbox-new"), {"template": "base", "size": "tiny", "ttl_s": "60", "labels": "project=rl"})
    sandbox = Sandbox.objects.get(team=world.team_a)
    assert made.status_code == 302 and made["Location"] == reverse("console:sandbox", args=[sandbox.id])
    assert (sandbox.labels, sandbox.api_key_id, sandbox.host_id) == ({"project": "rl"}, None, live_host.pk)


def test_a_new_launch_from_the_console(member_client: Client, world: World, live_host: Host) -> None:
    TeamLimits.objects.filter(team=world.team_a).update(max_launch_count=50)
    over = member_client.post(reverse("console:launch-new"), {"count": "51", "template": "base", "size": "tiny", "ttl_s": "60"})
    assert b'id="id_count_errors"' in over.content and b"at most 50" in over.content
    made = member_client.post(reverse("console:launch-new"), {"count": "7", "template": "base", "size": "tiny", "ttl_s": "60"})
    launch = Launch.objects.get(team=world.team_a)
    assert made.status_code == 302 and made["Location"] == reverse("console:launch", args=[launch.id]) and launch.count == 7
    started = AuditEntry.objects.get(action="launch.started", target_id=launch.id)
    assert started.actor == "user mel"
    page = member_client.get(reverse("console:launch", args=[launch.id])).content.decode()
    assert 'id="launch-teardown"' in page and "started by user mel" in page
    member_client.post(reverse("console:launch-teardown", args=[launch.id]))
    assert Launch.objects.get(pk=launch.pk).state in (Launch.State.STOPPING, Launch.State.STOPPED)
    assert AuditEntry.objects.filter(action="launch.torn_down", target_id=launch.id).count() == 1


def test_the_metrics_panel_refreshes_itself(member_client: Client, world: World, make_sandbox) -> None:
    sandbox = make_sandbox(world.key_a, state="running", engine_id="e1")
    panel = member_client.get(reverse("console:sandbox-metrics", args=[sandbox.id])).content.decode()
    assert panel.lstrip().startswith('<section id="metrics-panel"') and 'hx-trigger="every 3s"' in panel
    ended = make_sandbox(world.key_a, state="destroyed")
    assert "hx-trigger" not in member_client.get(reverse("console:sandbox-metrics", args=[ended.id])).content.decode()
