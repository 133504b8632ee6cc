"""Hosts as the control plane sees them: what a sandbox costs one (admission and placement), and a host that
stops answering (the fleet's watch: offline, its unstarted sandboxes placed again, its started ones lost after
a while), against recording fake engines.  The same with real engines: tests/api/test_fleet.py."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from billing.models import UsagePeriod
from console.errors import BeyondCapacity, Unavailable
from sandboxes import placement, transitions
from sandboxes.commands import Command
from sandboxes.models import Host, Launch, Sandbox
from sandboxes.schemas import SandboxCreate
from sandboxes.services.launches import launch_create
from sandboxes.services.sandboxes import sandbox_create
from sandboxes.worker import bring_up, dispatch, fleet, heartbeat, reconcile

pytestmark = pytest.mark.django_db(transaction=True)
S = Sandbox.State
TINY = {"template": "base", "size": "tiny", "ttl_s": 600}


def _spec(**fields: Any) -> SandboxCreate:
    return SandboxCreate.model_validate({**TINY, **fields})


def _stale(host: Host, seconds: float) -> None:
    Host.objects.filter(pk=host.pk).update(last_heartbeat=timezone.now() - timedelta(seconds=seconds))


# --- what a sandbox costs a host ---------------------------------------------------------------


def test_a_hosts_room_counts_its_kernel_limits_and_what_each_sandbox_costs_its_memory(cluster: Any, settings: Any) -> None:
    settings.FORKYARD_MEMORY_OVERCOMMIT = 8
    settings.FORKYARD_HOST_MEMORY_RESERVE_MIB = 1024
    host = cluster.add_host("h1", max_sandboxes=40_000)
    # 4 GiB for sandboxes; a tiny one costs 1,024 KiB of kernel memory + 128 MiB / 8 = 17 MiB.
    Host.objects.filter(pk=host.pk).update(memory_mib=5 * 1024, sandbox_overhead_kib=1024)
    host.refresh_from_db()
    assert placement.rooms([host], 128)[host.pk] == placement.Room(host, now=4096 // 17, empty=4096 // 17)
    # What it holds and what is on its way to it take their share.
    Host.objects.filter(pk=host.pk).update(engine_sandboxes=100, committed_memory_mib=100 * 128)
    host.refresh_from_db()
    assert placement.rooms([host], 128)[host.pk].now == 4096 // 17 - 100
    # Its kernel's limits (its preflight's fits) bound it below max_sandboxes and below its memory.
    Host.objects.filter(pk=host.pk).update(kernel_max_sandboxes=150)
    host.refresh_from_db()
    assert placement.rooms([host], 128)[host.pk] == placement.Room(host, now=50, empty=150)
    # An overcommit of 1 counts limits whole: 4 GiB holds 31 sandboxes of 128 MiB and 1 MiB each.
    settings.FORKYARD_MEMORY_OVERCOMMIT = 1
    assert placement.rooms([host], 128)[host.pk].empty == 4096 * 1024 // (128 * 1024 + 1024)


def test_a_launch_larger_than_the_fleet_could_hold_is_refused_with_what_fits(cluster: Any, team: Any, sent: Any) -> None:
    cluster.add_host("h1", max_sandboxes=30)
    cluster.add_host("h2", max_sandboxes=20)
    with pytest.raises(BeyondCapacity) as refused:
        launch_create(team=team, key=None, spec=_spec(), count=51)
    assert (refused.value.code, refused.value.field) == ("beyond_capacity", "count")
    assert refused.value.details == {"fits": 50, "count": 51, "hosts": 2}
    assert not Launch.objects.exists() and not sent.commands, "refused before anything is recorded or queued"
    launch, _ = launch_create(team=team, key=None, spec=_spec(), count=50)
    assert launch.count == 50


def test_one_that_does_not_fit_now_is_told_to_come_back(cluster: Any, team: Any, make_row: Any, sent: Any) -> None:
    host = cluster.add_host("h1", max_sandboxes=30)
    Host.objects.filter(pk=host.pk).update(engine_sandboxes=20)  # as its engine last said
    make_row(S.QUEUED, host=host)  # and one on its way
    with pytest.raises(Unavailable) as refused:
        launch_create(team=team, key=None, spec=_spec(), count=10)
    assert refused.value.code == "no_capacity" and refused.value.retry_after_s == 10
    assert refused.value.details == {"fits": 30, "fits_now": 9, "count": 10, "hosts": 1}
    with pytest.raises(Unavailable):
        Host.objects.filter(pk=host.pk).update(engine_sandboxes=29)
        sandbox_create(team=team, key=None, spec=_spec())
    assert not Sandbox.objects.exclude(state=S.QUEUED).exists()


def test_what_ended_since_the_hosts_last_report_gives_its_room_back_at_once(cluster: Any, team: Any, make_row: Any) -> None:
    """Issue: a launch asked for right behind a teardown of 1,000 was refused no_capacity: the host's
    room came from its last heartbeat, which still counted the sandboxes just destroyed."""
    host = cluster.add_host("h1", max_sandboxes=30)
    reported = timezone.now() - timedelta(seconds=3)
    Host.objects.filter(pk=host.pk).update(engine_sandboxes=25, committed_memory_mib=25 * 128, last_heartbeat=reported)
    before = reported - timedelta(seconds=60)
    ran = [make_row(S.RUNNING, host=host, engine_id=f"sb_e{index}", ready_at=before) for index in range(25)]
    host.refresh_from_db()
    assert placement.rooms([host], 128)[host.pk].now == 5
    transitions.sandboxes_destroyed([(row, timezone.now()) for row in ran[:20]])
    # Ended before the report (the engine had left them out already), or never on the engine: no room twice.
    make_row(S.DESTROYED, host=host, engine_id="sb_old", ready_at=before, ended_at=reported - timedelta(seconds=1))
    make_row(S.DESTROYED, host=host, ready_at=None, ended_at=timezone.now())
    assert placement.rooms([host], 128)[host.pk].now == 25
    launch, _ = launch_create(team=team, key=None, spec=_spec(), count=25)
    assert launch.count == 25


def test_the_hosts_kernel_limits_and_overhead_come_with_its_heartbeat(cluster: Any, settings: Any) -> None:
    host = cluster.add_host("h1", max_sandboxes=1000)
    engine = cluster.engine(host)
    engine.kernel_fits, engine.overhead_kib = 700, 910
    settings.FORKYARD_ENGINE_ADDRESS = host.engine_socket
    Host.objects.filter(pk=host.pk).update(state=Host.State.OFFLINE)
    heartbeat.host_heartbeat("h1", host.engine_socket)
    host.refresh_from_db()
    assert (host.kernel_max_sandboxes, host.sandbox_overhead_kib, host.state) == (700, 910, Host.State.ONLINE)
    assert placement.capacity_of(host) == 700
    Host.objects.filter(pk=host.pk).update(state=Host.State.DRAINING)
    heartbeat.host_heartbeat("h1", host.engine_socket)
    assert Host.objects.get(pk=host.pk).state == Host.State.DRAINING, "a drained host stays drained"
    engine.kernel_fits = 0  # say a per-user namespace limit of 0: not one sandbox can be made
    heartbeat.host_heartbeat("h1", host.engine_socket)
    host.refresh_from_db()
    assert host.kernel_max_sandboxes == 0 and placement.rooms([host], 128)[host.pk] == placement.Room(host, now=0, empty=0)


# --- a host that stops answering ---------------------------------------------------------------


def _launch_over(team: Any, count: int) -> Launch:
    launch, _ = launch_create(team=team, key=None, spec=_spec(), count=count)
    dispatch.dispatch(launch.pk, "")
    return launch


def test_a_silent_hosts_unstarted_share_goes_to_the_others_and_its_started_ones_stay(
    cluster: Any, team: Any, sent: Any, settings: Any
) -> None:
    settings.FORKYARD_LAUNCH_CHUNK = 4
    a, b, c = cluster.add_host("a"), cluster.add_host("b"), cluster.add_host("c")
    launch = _launch_over(team, 12)
    on_c = list(Sandbox.objects.filter(launch=launch, host=c).order_by("launch_index").values_list("pk", flat=True))
    assert len(on_c) == 4, "a chunk on each host"
    started = on_c[:1]
    bring_up.bring_up(c, started)  # one of them started before c went silent
    before = len(sent.commands)
    assert fleet.watch_fleet("a") == {"offline": 0, "replaced": 0, "lost": 0}, "nothing is stale yet"
    _stale(c, settings.FORKYARD_HOST_STALE_S + 1)
    assert fleet.watch_fleet("b") == {}, "b does not lead: a does"
    assert fleet.watch_fleet("a") == {"offline": 1, "replaced": 3, "lost": 0}
    assert Host.objects.get(pk=c.pk).state == Host.State.OFFLINE
    rows = {row.pk: row for row in Sandbox.objects.filter(pk__in=on_c)}
    assert rows[started[0]].host_id == c.pk and rows[started[0]].state == S.RUNNING, "a started one stays"
    moved = [rows[pk] for pk in on_c[1:]]
    assert {row.host_id for row in moved} <= {a.pk, b.pk} and {row.state for row in moved} == {S.QUEUED}
    queued = [args for name, args, _, _ in sent.commands[before:] if name == str(Command.ENSURE_RUNNING)]
    assert sorted(pk for _, ids in queued for pk in ids) == sorted(on_c[1:])
    assert {host for host, _ in queued} <= {"a", "b"}
    assert fleet.watch_fleet("a") == {"offline": 0, "replaced": 0, "lost": 0}, "a second pass moves nothing"
    for host in (a, b):
        ids = list(Sandbox.objects.filter(launch=launch, host=host).values_list("pk", flat=True))
        bring_up.bring_up(host, ids)
    assert Launch.objects.get(pk=launch.pk).state == Launch.State.READY
    assert Sandbox.objects.filter(launch=launch, state=S.RUNNING).count() == 12


def test_what_the_lost_host_had_in_flight_cannot_touch_a_sandbox_placed_elsewhere(
    cluster: Any, make_row: Any, sent: Any, settings: Any
) -> None:
    lost, other = cluster.add_host("a-lost"), cluster.add_host("b-other")
    row = make_row(S.CREATING, host=lost)
    stale_copy = Sandbox.objects.get(pk=row.pk)  # as the lost host's worker loaded it
    _stale(lost, settings.FORKYARD_HOST_STALE_S + 1)
    assert fleet.watch_fleet("b-other")["replaced"] == 1
    # The lost host's create comes back after all: its copy is destroyed there, the row is not touched.
    record = cluster.engine(lost).create(template="base", key=row.pk)
    outcome = bring_up.record_started(lost, [(stale_copy, record)])
    assert not outcome.running and cluster.engine(lost).sandboxes[record["id"]]["state"] == "destroyed"
    # And a failure it reports does not fail it.
    assert transitions.sandbox_failed(stale_copy, code="engine_unavailable", message="gone") == S.QUEUED
    bring_up.bring_up(other, [row.pk])
    current = Sandbox.objects.get(pk=row.pk)
    assert (current.state, current.host_id) == (S.RUNNING, other.pk)
    assert cluster.engine(other).sandboxes[current.engine_id]["key"] == row.pk


def test_a_host_that_comes_back_destroys_its_copies_of_what_went_elsewhere(
    cluster: Any, make_row: Any, sent: Any, settings: Any
) -> None:
    settings.FORKYARD_STUCK_AFTER_S = 0  # the engine's copy is no create in flight
    lost, other = cluster.add_host("a-lost"), cluster.add_host("b-other")
    row = make_row(S.CREATING, host=lost)
    copy = cluster.engine(lost).create(template="base", key=row.pk)  # made just before it stopped answering
    _stale(lost, settings.FORKYARD_HOST_STALE_S + 1)
    fleet.watch_fleet("b-other")
    bring_up.bring_up(other, [row.pk])
    settings.FORKYARD_ENGINE_ADDRESS = lost.engine_socket
    heartbeat.host_heartbeat("a-lost", lost.engine_socket)
    assert Host.objects.get(pk=lost.pk).state == Host.State.ONLINE
    assert reconcile.reconcile(Host.objects.get(pk=lost.pk))["orphans_destroyed"] == 1
    assert cluster.engine(lost).sandboxes[copy["id"]]["state"] == "destroyed"
    assert Sandbox.objects.get(pk=row.pk).state == S.RUNNING


def test_a_host_offline_for_good_loses_its_started_sandboxes_billed_to_its_last_heartbeat(
    cluster: Any, make_row: Any, make_launch_row: Any, sent: Any, settings: Any
) -> None:
    lost = cluster.add_host("a-lost")
    cluster.add_host("b-other")  # the live host whose agent leads the watch
    launch = make_launch_row(count=2)
    rows = [make_row(S.QUEUED, host=lost, launch=launch, launch_index=index) for index in range(2)]
    bring_up.bring_up(lost, [row.pk for row in rows])
    stopping = make_row(S.QUEUED, host=lost)
    bring_up.bring_up(lost, [stopping.pk])
    Sandbox.objects.filter(pk=stopping.pk).update(state=S.STOPPING)
    heard = timezone.now() - timedelta(seconds=settings.FORKYARD_HOST_LOST_S + 5)
    ran_from = heard - timedelta(minutes=1)  # they ran a minute before the host went silent
    Sandbox.objects.filter(host=lost).update(ready_at=ran_from)
    UsagePeriod.objects.filter(sandbox__host=lost).update(started_at=ran_from)
    Host.objects.filter(pk=lost.pk).update(last_heartbeat=heard)
    counts = fleet.watch_fleet("b-other")
    assert counts["offline"] == 1 and counts["lost"] == 3
    for row in Sandbox.objects.filter(pk__in=[row.pk for row in rows]):
        assert (row.state, row.error_code) == (S.STOPPED, "host_lost")
        assert row.ended_at == heard
        [period] = UsagePeriod.objects.filter(sandbox=row)
        assert period.ended_at == heard and period.duration_ms == 60_000
    assert Sandbox.objects.get(pk=stopping.pk).state == S.DESTROYED
    assert Launch.objects.get(pk=launch.pk).state == Launch.State.STOPPED
    assert fleet.watch_fleet("b-other")["lost"] == 0


def test_only_what_has_room_now_is_placed_again(cluster: Any, make_row: Any, sent: Any, settings: Any) -> None:
    lost = cluster.add_host("a-lost")
    cluster.add_host("b-small", max_sandboxes=3)
    rows = [make_row(S.QUEUED, host=lost) for _ in range(5)]
    _stale(lost, settings.FORKYARD_HOST_STALE_S + 1)
    assert fleet.watch_fleet("b-small")["replaced"] == 3
    assert Sandbox.objects.filter(pk__in=[row.pk for row in rows], host=lost).count() == 2, "the rest wait for room"
