"""The worker against a recording fake engine: bring-up, take-down, dispatch, reconcile, snapshots, and the races.

Everything but the engine is real: the database, the transitions, the
worker's threads.  The engine's answers are the fake's (tests/support/fake_engine.py),
so a test can hold a create inside the engine while a destroy or a teardown
arrives, which the real engine's speed makes a matter of luck.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from billing.models import UsagePeriod
from sandboxes import commands, transitions
from sandboxes.commands import Command
from sandboxes.engine import errors as engine_errors
from sandboxes.engine.cgroups import GROUP_CPU_MAX
from sandboxes.models import Host, Launch, Lease, Sandbox, Snapshot, Template, TemplateBuild
from sandboxes.schemas import SandboxCreate
from sandboxes.services.launches import launch_create, launch_destroy
from sandboxes.services.sandboxes import sandbox_destroy
from sandboxes.worker import bring_up, dispatch, reconcile, snapshots, take_down

pytestmark = pytest.mark.django_db(transaction=True)
S = Sandbox.State


def creates(engine: Any) -> list[dict[str, Any]]:
    return [args for op, args in engine.calls if op == "create"]


def test_bring_up_makes_each_row_once_keyed_by_its_id_and_bills_from_ready(cluster: Any, make_row: Any, sent: Any) -> None:
    host = cluster.add_host("h1")
    rows = [make_row(host=host) for _ in range(5)]
    ids = [row.pk for row in rows]
    assert bring_up.bring_up(host, ids) == {"running": 5, "failed": 0, "destroyed": 0}
    engine = cluster.engine(host)
    made = creates(engine)
    assert sorted(args["key"] for args in made) == sorted(ids)
    assert all((args["size"], args["cpu"], args["memory_mib"]) == ("tiny", 1.0, 128) for args in made)
    for row in Sandbox.objects.filter(pk__in=ids):
        record = engine.sandboxes[row.engine_id]
        assert (row.state, record["key"], row.env) == (S.RUNNING, row.pk, {})
        [period] = UsagePeriod.objects.filter(sandbox=row)
        assert abs(period.started_at.timestamp() - record["ready_at"]) < 0.001
    assert bring_up.bring_up(host, ids) == {"running": 0, "failed": 0, "destroyed": 0}, "a replayed command does nothing"
    assert len(creates(engine)) == 5


def test_a_command_replayed_after_its_worker_died_gets_the_same_engine_sandboxes(cluster: Any, make_row: Any, sent: Any) -> None:
    host = cluster.add_host("h1")
    engine = cluster.engine(host)
    rows = [make_row(S.CREATING, host=host) for _ in range(3)]
    first = {row.pk: engine.create(template="base", key=row.pk)["id"] for row in rows[:2]}  # made before the worker died
    assert bring_up.bring_up(host, [row.pk for row in rows])["running"] == 3
    assert len(engine.sandboxes) == 3
    assert {pk: Sandbox.objects.get(pk=pk).engine_id for pk in first} == first


def test_an_engine_error_fails_the_row_with_its_code(cluster: Any, make_row: Any, sent: Any) -> None:
    host = cluster.add_host("h1")
    cluster.engine(host).fail("create", engine_errors.TemplateNotFound("no template 'base'"))
    row = make_row(host=host)
    assert bring_up.bring_up(host, [row.pk])["failed"] == 1
    row.refresh_from_db()
    assert (row.state, row.error_code, row.ended_at is not None) == (S.FAILED, "template_not_found", True)


def test_an_engine_that_does_not_answer_leaves_the_rows_for_the_retry(cluster: Any, make_row: Any, sent: Any) -> None:
    host = cluster.add_host("h1")
    cluster.engine(host).fail("create", engine_errors.Unavailable("connection refused"))
    row = make_row(host=host)
    with pytest.raises(engine_errors.Unavailable):
        bring_up.bring_up(host, [row.pk])
    assert Sandbox.objects.get(pk=row.pk).state == S.CREATING


def test_a_destroy_that_arrives_during_the_create_wins(cluster: Any, make_row: Any, sent: Any) -> None:
    host = cluster.add_host("h1")
    engine = cluster.engine(host)
    row = make_row(host=host)
    with engine.hold_creates():
        worker = threading.Thread(target=bring_up.bring_up, args=(host, [row.pk]))
        worker.start()
        engine.wait_for_create()
        assert sandbox_destroy(sandbox=row).state == S.STOPPING
        assert sent.named(Command.ENSURE_GONE) == [[host.name, [row.pk]]]
        # The ensure_gone command may run now: there is nothing of it in the engine yet to destroy.
        assert take_down.take_down(host, [row.pk]) == 0
    worker.join(10)
    row.refresh_from_db()
    assert row.state == S.DESTROYED and row.engine_id
    assert engine.sandboxes[row.engine_id]["state"] == "destroyed"
    assert ("destroy", {"id": row.engine_id}) in engine.calls
    assert not UsagePeriod.objects.filter(sandbox=row).exists(), "it never ran, so it was never billed"


def test_take_down_destroys_and_closes_billing_at_the_engines_end_time(cluster: Any, make_row: Any, sent: Any) -> None:
    host = cluster.add_host("h1")
    rows = [make_row(host=host) for _ in range(3)]
    bring_up.bring_up(host, [row.pk for row in rows])
    for row in rows:
        sandbox_destroy(sandbox=row)
    assert take_down.take_down(host, [row.pk for row in rows]) == 3
    engine = cluster.engine(host)
    for row in Sandbox.objects.filter(pk__in=[row.pk for row in rows]):
        assert row.state == S.DESTROYED and engine.sandboxes[row.engine_id]["state"] == "destroyed"
        [period] = UsagePeriod.objects.filter(sandbox=row)
        assert abs(period.ended_at.timestamp() - engine.sandboxes[row.engine_id]["ended_at"]) < 0.001
    assert take_down.take_down(host, [row.pk for row in rows]) == 0, "a replay destroys nothing twice"


def test_take_down_records_what_the_engine_destroyed_and_retries_the_rest(
    cluster: Any, make_row: Any, sent: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = cluster.add_host("h1")
    engine = cluster.engine(host)
    rows = [make_row(host=host) for _ in range(3)]
    bring_up.bring_up(host, [row.pk for row in rows])
    for row in rows:
        sandbox_destroy(sandbox=row)
    stuck = Sandbox.objects.get(pk=rows[1].pk).engine_id
    destroy = engine.destroy

    def failing(sandbox_id: str) -> dict[str, Any]:
        if sandbox_id == stuck:
            raise engine_errors.EngineError("the engine could not unmount it")
        return destroy(sandbox_id)

    monkeypatch.setattr(engine, "destroy", failing)
    with pytest.raises(engine_errors.EngineError, match="could not unmount"):
        take_down.take_down(host, [row.pk for row in rows])
    states = {row.pk: row.state for row in Sandbox.objects.filter(pk__in=[row.pk for row in rows])}
    assert states == {rows[0].pk: S.DESTROYED, rows[1].pk: S.STOPPING, rows[2].pk: S.DESTROYED}
    monkeypatch.setattr(engine, "destroy", destroy)
    assert take_down.take_down(host, [row.pk for row in rows]) == 1, "the retry destroys only what was left"
    assert Sandbox.objects.get(pk=rows[1].pk).state == S.DESTROYED


def test_take_down_falls_back_to_a_destroy_each_on_an_engine_without_destroy_many(
    cluster: Any, make_row: Any, sent: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = cluster.add_host("h1")
    engine = cluster.engine(host)
    rows = [make_row(host=host) for _ in range(4)]
    bring_up.bring_up(host, [row.pk for row in rows])
    for row in rows:
        sandbox_destroy(sandbox=row)

    def unknown(sandbox_ids: list[str]) -> list[dict[str, Any]]:
        raise engine_errors.InvalidRequest("unknown operation 'destroy_many'", field="op", ops=["destroy"])

    monkeypatch.setattr(engine, "destroy_many", unknown)
    assert take_down.take_down(host, [row.pk for row in rows]) == 4
    assert set(Sandbox.objects.filter(pk__in=[row.pk for row in rows]).values_list("state", flat=True)) == {S.DESTROYED}
    assert all(
        engine.sandboxes[row.engine_id]["state"] == "destroyed" for row in Sandbox.objects.filter(pk__in=[r.pk for r in rows])
    )


def test_the_web_servers_teardown_takes_the_chunks_from_the_last_and_skips_what_the_worker_ended(
    cluster: Any, make_row: Any, sent: Any, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A teardown is done twice over at once: the web server asks each engine itself (``take_down_directly``)
    and the host's worker takes the same chunks from the queued commands, from the first. On a 32,752
    teardown both destroyed and recorded every chunk, and the workers' commands hit "database is locked".
    The web server now starts from the last chunk and reads each chunk's rows only when its turn comes."""
    settings.FORKYARD_LAUNCH_CHUNK = 2
    host = cluster.add_host("h1")
    engine = cluster.engine(host)
    rows = [make_row(host=host) for _ in range(8)]
    ids = [row.pk for row in rows]
    bring_up.bring_up(host, ids)
    for row in rows:
        sandbox_destroy(sandbox=Sandbox.objects.get(pk=row.pk))
    engine_ids = dict(Sandbox.objects.filter(pk__in=ids).values_list("pk", "engine_id"))
    assert take_down.take_down(host, ids[0:2]) == 2  # the worker's first command, before the web server
    calls: list[list[str]] = []
    worker_done: list[asyncio.Event] = []

    class Client:
        async def destroy_many(self, sandbox_ids: list[str]) -> list[dict[str, Any]]:
            calls.append(sandbox_ids)
            if len(calls) == 1:  # meanwhile the worker takes its second command
                worker_done.append(asyncio.Event())
                await asyncio.to_thread(take_down.take_down, host, ids[2:4])
                worker_done[0].set()
            else:  # the chunks after these two wait their turn until the worker is done
                await worker_done[0].wait()
            return engine.destroy_many(sandbox_ids)

    class Pool:
        @contextlib.asynccontextmanager
        async def client(self) -> Any:
            yield Client()

    monkeypatch.setattr(take_down.engine_link, "async_pool", lambda socket_path: Pool())
    assert asyncio.run(take_down.take_down_directly({host.pk: ids})) == 4
    # The last two chunks (two in flight at once), and none the worker had ended before its turn came.
    assert sorted(map(sorted, calls)) == sorted(sorted(engine_ids[pk] for pk in ids[start : start + 2]) for start in (4, 6))
    assert set(Sandbox.objects.filter(pk__in=ids).values_list("state", flat=True)) == {S.DESTROYED}


# --- launches: dispatch, and teardown winning whatever the order ---------------------------------


def _launch(team: Any, count: int) -> Launch:
    spec = SandboxCreate.model_validate({"template": "base", "size": "tiny", "ttl_s": 600})
    launch, created = launch_create(team=team, key=None, spec=spec, count=count)
    assert created
    return launch


def test_a_groups_cpu_quota_is_its_members_cores_summed_within_what_the_engine_takes(cluster: Any, team: Any, sent: Any) -> None:
    host = cluster.add_host("h1")
    for size, group_size, cores in (("tiny", 64, 64.0), ("default", 4096, float(GROUP_CPU_MAX))):
        spec = SandboxCreate.model_validate({"template": "base", "size": size, "ttl_s": 600})
        launch, _ = launch_create(team=team, key=None, spec=spec, count=2, memory_group_size=group_size, memory_group_cpu="group")
        args = bring_up.create_args(launch.member(0, host, {}))
        assert args["memory_group"]["cpu"] == cores, args["memory_group"]
        assert "cpu" not in bring_up.create_args(_launch(team, 2).member(0, host, {})).get("memory_group", {})


def test_dispatch_spreads_chunks_over_the_hosts_with_room(cluster: Any, team: Any, sent: Any, settings: Any) -> None:
    settings.FORKYARD_LAUNCH_CHUNK = 2
    cluster.add_host("roomy", max_sandboxes=5)
    cluster.add_host("small", max_sandboxes=4)
    launch = _launch(team, 6)
    assert sent.named(Command.DISPATCH_LAUNCH) == [[launch.pk, ""]]
    assert dispatch.dispatch(launch.pk, "") == 6
    queued = sent.named(Command.ENSURE_RUNNING)
    assert [host for host, _ in queued] == ["roomy", "small", "roomy"]  # room 5, 4 -> 3, 4 -> 3, 2 -> 1, 2
    assert dispatch.dispatch(launch.pk, "") == 0, "a replay inserts nothing twice"
    assert Sandbox.objects.filter(launch=launch).count() == 6 and len(sent.named(Command.ENSURE_RUNNING)) == 3


def test_a_launch_whose_hosts_all_went_away_fails(cluster: Any, team: Any, sent: Any) -> None:
    host = cluster.add_host("h1")
    launch = _launch(team, 2)
    Host.objects.filter(pk=host.pk).update(last_heartbeat=timezone.now() - timedelta(hours=1))  # its agent stopped
    assert dispatch.dispatch(launch.pk, "") == 0
    assert Launch.objects.get(pk=launch.pk).state == Launch.State.FAILED


def test_a_launch_torn_down_before_its_dispatch_makes_nothing(cluster: Any, team: Any, sent: Any) -> None:
    host = cluster.add_host("h1")
    launch = _launch(team, 4)
    launch_destroy(launch=launch)
    assert Launch.objects.get(pk=launch.pk).state == Launch.State.STOPPED
    assert dispatch.dispatch(launch.pk, "") == 0
    assert not Sandbox.objects.filter(launch=launch).exists() and not creates(cluster.engine(host))


def test_a_launch_torn_down_during_its_dispatch_gains_no_member_and_starts_none(
    cluster: Any, team: Any, sent: Any, settings: Any
) -> None:
    """Issue: DELETE right after POST left every sandbox running; here the teardown lands between two chunks."""
    settings.FORKYARD_LAUNCH_CHUNK = 2
    host = cluster.add_host("h1")
    launch = _launch(team, 6)
    sent.then(Command.ENSURE_RUNNING, lambda args: launch_destroy(launch=Launch.objects.get(pk=launch.pk)))
    assert dispatch.dispatch(launch.pk, "") == 2, "the first chunk was queued before the teardown, the rest never made"
    members = list(Sandbox.objects.filter(launch=launch))
    assert len(members) == 2 and {member.state for member in members} == {S.DESTROYED}
    [(host_name, ids)] = sent.named(Command.ENSURE_RUNNING)
    assert bring_up.bring_up(host, ids) == {"running": 0, "failed": 0, "destroyed": 0}, "the queued command starts nothing"
    assert not creates(cluster.engine(host))
    assert Launch.objects.get(pk=launch.pk).state == Launch.State.STOPPED


def test_a_launch_torn_down_while_its_sandboxes_are_being_created_leaves_none_running(
    cluster: Any, team: Any, sent: Any, settings: Any
) -> None:
    settings.FORKYARD_LAUNCH_CHUNK = 3
    host = cluster.add_host("h1")
    engine = cluster.engine(host)
    launch = _launch(team, 6)
    dispatch.dispatch(launch.pk, "")
    first, second = sent.named(Command.ENSURE_RUNNING)
    with engine.hold_creates():
        worker = threading.Thread(target=bring_up.bring_up, args=(host, first[1]))
        worker.start()
        engine.wait_for_create()
        launch_destroy(launch=Launch.objects.get(pk=launch.pk))
    worker.join(10)
    bring_up.bring_up(host, second[1])  # the second chunk's command, arriving after the teardown
    assert engine.running() == []
    assert set(Sandbox.objects.filter(launch=launch).values_list("state", flat=True)) == {S.DESTROYED}
    assert not UsagePeriod.objects.filter(sandbox__launch=launch, ended_at__isnull=True).exists()
    assert Launch.objects.get(pk=launch.pk).state == Launch.State.STOPPED


def test_a_launch_torn_down_between_a_chunks_claim_and_its_creates_ends_at_once(
    cluster: Any, team: Any, sent: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI: DELETE right after POST left a launch "stopping" for good, every member ended but a few stuck
    "stopping": claimed (creating) by the worker, torn down before it read them back, so never created,
    and each take-down left them to a create that never came. Nothing is made; they end now."""
    host = cluster.add_host("h1")
    launch = _launch(team, 4)
    dispatch.dispatch(launch.pk, "")
    [(_, ids)] = sent.named(Command.ENSURE_RUNNING)
    claimed = bring_up.transitions.sandboxes_claimed

    def claimed_then_torn_down(sandbox_ids: Any, on: Host) -> int:
        moved = claimed(sandbox_ids, on)
        launch_destroy(launch=Launch.objects.get(pk=launch.pk))
        return moved

    monkeypatch.setattr(bring_up.transitions, "sandboxes_claimed", claimed_then_torn_down)
    assert bring_up.bring_up(host, ids) == {"running": 0, "failed": 0, "destroyed": 0}
    assert not creates(cluster.engine(host))
    assert set(Sandbox.objects.filter(launch=launch).values_list("state", flat=True)) == {S.DESTROYED}
    assert Launch.objects.get(pk=launch.pk).state == Launch.State.STOPPED


# --- reconciliation ------------------------------------------------------------------------------


def test_reconcile_brings_the_record_and_the_engine_back_together(cluster: Any, make_row: Any, sent: Any, settings: Any) -> None:
    settings.FORKYARD_STUCK_AFTER_S = 60
    host = cluster.add_host("h1")
    engine = cluster.engine(host)
    long_ago = timezone.now() - timedelta(minutes=5)
    # A running row whose engine sandbox is gone (its TTL ran out in the engine).
    gone = make_row(host=host)
    bring_up.bring_up(host, [gone.pk])
    gone.refresh_from_db()
    engine.sandboxes[gone.engine_id].update(state="destroyed", ended_at=timezone.now().timestamp())
    # An engine sandbox nobody's row names.
    orphan = engine.create(template="base", key="sb_nobody")
    # A create whose worker died after the engine made it, long ago.
    lost = make_row(S.CREATING, host=host)
    engine.create(template="base", key=lost.pk)
    # A queued row whose command was lost with the broker.
    stuck = make_row(S.QUEUED, host=host)
    Sandbox.objects.filter(pk__in=[lost.pk, stuck.pk]).update(updated_at=long_ago)

    counts = reconcile.reconcile(host)
    assert (counts["ended"], counts["orphans_destroyed"], counts["adopted"], counts["requeued"]) == (1, 1, 1, 1)
    assert Sandbox.objects.get(pk=gone.pk).state == S.DESTROYED
    assert engine.sandboxes[orphan["id"]]["state"] == "destroyed"
    assert (
        Sandbox.objects.get(pk=lost.pk).state == S.RUNNING
        and UsagePeriod.objects.filter(sandbox=lost, ended_at=None).count() == 1
    )
    assert [stuck.pk] in [ids for _, ids in sent.named(Command.ENSURE_RUNNING)]
    assert reconcile.reconcile(host) == {
        "ended": 0,
        "adopted": 0,
        "orphans_destroyed": 0,
        "requeued": 0,
        "billing_fixed": 0,
        "lease_destroyed": 0,
        "build_logs_cleared": 0,
    }


def test_reconcile_leaves_a_stopping_row_to_its_teardown_until_that_is_lost(
    cluster: Any, make_row: Any, sent: Any, settings: Any
) -> None:
    """A teardown destroys its members in the engine, then records them: reconciliation in between used to
    look each up in the engine and end it itself, every member twice over. A stopping row whose engine
    sandbox is gone is ended here only once it has been stopping for FORKYARD_STUCK_AFTER_S (its teardown
    was lost), at the engine's end time; a started row that died is ended at once, as before."""
    settings.FORKYARD_STUCK_AFTER_S = 60
    host = cluster.add_host("h1")
    engine = cluster.engine(host)
    rows = {name: make_row(S.STOPPING if name != "died" else S.RUNNING, host=host) for name in ("fresh", "lost", "died")}
    for row in rows.values():
        record = engine.create(template="base", key=row.pk)
        Sandbox.objects.filter(pk=row.pk).update(engine_id=record["id"])
        engine.destroy(record["id"])  # gone from the engine, not recorded yet
    Sandbox.objects.filter(pk=rows["lost"].pk).update(updated_at=timezone.now() - timedelta(minutes=5))
    engine.calls.clear()

    assert reconcile.reconcile(host)["ended"] == 2
    states = {name: Sandbox.objects.get(pk=row.pk) for name, row in rows.items()}
    assert states["fresh"].state == S.STOPPING, "its teardown records it"
    assert states["lost"].state == S.DESTROYED and states["died"].state == S.DESTROYED
    lost_engine = engine.sandboxes[states["lost"].engine_id]
    assert abs(states["lost"].ended_at.timestamp() - lost_engine["ended_at"]) < 0.001, "billed to the engine's end"
    assert sorted(args["id"] for op, args in engine.calls if op == "get") == sorted(
        [states["lost"].engine_id, states["died"].engine_id]
    ), "the fresh one is not looked up"


def test_a_launch_whose_last_members_reconciliation_ends_is_stopped(cluster: Any, team: Any, sent: Any, settings: Any) -> None:
    """CI: a launch torn down mid-launch stayed "stopping" for good with every member ended: its last
    stopping member was ended by reconciliation (its teardown taken for lost), which never settled the
    launch, and nothing else looked at it again. A launch whose members all die on their own (TTL) is
    stopped the same way."""
    settings.FORKYARD_STUCK_AFTER_S = 60
    host = cluster.add_host("h1")
    engine = cluster.engine(host)
    torn, expired = _launch(team, 2), _launch(team, 2)
    for launch in (torn, expired):
        dispatch.dispatch(launch.pk, "")
    for _, ids in sent.named(Command.ENSURE_RUNNING):
        bring_up.bring_up(host, ids)
    assert {Launch.objects.get(pk=launch.pk).state for launch in (torn, expired)} == {Launch.State.READY}

    launch_destroy(launch=Launch.objects.get(pk=torn.pk))
    first, last = Sandbox.objects.filter(launch=torn).order_by("launch_index")
    take_down.take_down(host, [first.pk])  # the teardown records one member, and is lost before the other
    engine.destroy(last.engine_id)
    Sandbox.objects.filter(pk=last.pk).update(updated_at=timezone.now() - timedelta(minutes=5))
    for member in Sandbox.objects.filter(launch=expired):
        engine.sandboxes[member.engine_id].update(state="destroyed", ended_at=timezone.now().timestamp(), reason="ttl expired")
    assert Launch.objects.get(pk=torn.pk).state == Launch.State.STOPPING

    assert reconcile.reconcile(host)["ended"] == 3
    for launch in (torn, expired):
        launch.refresh_from_db()
        assert (launch.state, launch.ended_at is not None) == (Launch.State.STOPPED, True), launch.pk
    assert set(Sandbox.objects.filter(launch__in=[torn, expired]).values_list("state", flat=True)) == {S.DESTROYED}


def test_reconcile_leaves_queued_members_of_a_launch_that_moves_on_their_host_to_its_queue(
    cluster: Any, make_row: Any, make_launch_row: Any, sent: Any, settings: Any
) -> None:
    """A host takes a big launch chunk by chunk for minutes: its later chunks' rows sit queued past
    FORKYARD_STUCK_AFTER_S while their commands wait in its queue. Queued again, every pass sent hundreds
    of duplicates. A launch that stands still on the host is stuck, as a row of no launch is."""
    settings.FORKYARD_STUCK_AFTER_S = 60
    host = cluster.add_host("h1")
    long_ago = timezone.now() - timedelta(minutes=5)
    moving, still = make_launch_row(count=2), make_launch_row(count=2)
    started = make_row(host=host, launch=moving, launch_index=0)
    bring_up.bring_up(host, [started.pk])  # recorded running just now: its launch moves on this host
    waiting = make_row(S.QUEUED, host=host, launch=moving, launch_index=1)
    lost = [make_row(S.QUEUED, host=host, launch=still, launch_index=index) for index in range(2)]
    alone = make_row(S.QUEUED, host=host)
    Sandbox.objects.filter(pk__in=[waiting.pk, alone.pk, *(row.pk for row in lost)]).update(updated_at=long_ago)

    counts = reconcile.reconcile(host)
    requeued = sorted(pk for _, ids in sent.named(Command.ENSURE_RUNNING) for pk in ids)
    assert requeued == sorted([alone.pk, *(row.pk for row in lost)]) and counts["requeued"] == 3
    assert waiting.pk not in requeued

    # Once the launch stands still here too (nothing of it moved for FORKYARD_STUCK_AFTER_S), its row is stuck.
    Sandbox.objects.filter(pk=started.pk).update(updated_at=long_ago)
    reconcile.reconcile(host)
    assert [waiting.pk] in [ids for _, ids in sent.named(Command.ENSURE_RUNNING)]


def test_reconcile_ends_a_stuck_stopping_row_that_never_reached_the_engine(
    cluster: Any, make_row: Any, sent: Any, settings: Any
) -> None:
    """Queued again, such a row only looked fresh to the take-down, which left it to its create: stuck for
    good. A stuck stopping row whose engine sandbox exists under its key is destroyed through it instead."""
    settings.FORKYARD_STUCK_AFTER_S = 60
    host = cluster.add_host("h1")
    engine = cluster.engine(host)
    long_ago = timezone.now() - timedelta(minutes=5)
    unmade = make_row(S.STOPPING, host=host)
    made = make_row(S.STOPPING, host=host)
    late = engine.create(template="base", key=made.pk)  # its create reached the engine; nobody recorded it
    fresh = make_row(S.STOPPING, host=host)  # a create may still be on its way: left alone
    Sandbox.objects.filter(pk__in=[unmade.pk, made.pk]).update(updated_at=long_ago)

    counts = reconcile.reconcile(host)
    assert Sandbox.objects.get(pk=unmade.pk).state == S.DESTROYED
    assert Sandbox.objects.get(pk=fresh.pk).state == S.STOPPING
    assert engine.sandboxes[late["id"]]["state"] == "destroyed" and counts["orphans_destroyed"] == 1
    assert Sandbox.objects.get(pk=made.pk).engine_id == late["id"]
    assert [made.pk] in [ids for _, ids in sent.named(Command.ENSURE_GONE)]
    take_down.take_down(host, [made.pk])
    assert Sandbox.objects.get(pk=made.pk).state == S.DESTROYED
    assert not sent.named(Command.ENSURE_GONE)[1:], "one command, for the row with an engine sandbox"


def test_reconcile_clears_ended_builds_logs_and_requeues_a_build_its_worker_lost(cluster: Any, team: Any, sent: Any) -> None:
    host = cluster.add_host("h1")
    template = Template.objects.create(team=team, name="built", state=Template.State.BUILDING)
    now = timezone.now()
    ended = TemplateBuild.objects.create(
        team=team, template=template, state="failed", log="old output", ended_at=now - timedelta(minutes=5)
    )
    just_ended = TemplateBuild.objects.create(team=team, template=template, state="ready", log="fresh output", ended_at=now)
    lost = TemplateBuild.objects.create(team=team, template=template, state="building", log="half way")
    slow = TemplateBuild.objects.create(
        team=team, template=template, state="building", spec={"steps": [{"run": "make", "timeout_s": 3600}]}
    )
    TemplateBuild.objects.filter(pk__in=[lost.pk, slow.pk]).update(updated_at=now - timedelta(minutes=30))
    counts = reconcile.reconcile(host)
    assert (counts["build_logs_cleared"], counts["requeued"]) == (1, 1)
    assert [TemplateBuild.objects.get(pk=row.pk).log for row in (ended, just_ended, lost)] == ["", "fresh output", "half way"]
    assert sent.named(Command.BUILD_TEMPLATE) == [[lost.pk]], "a step may run silent for its timeout_s"
    assert reconcile.reconcile(host)["requeued"] == 0, "queued again once, not at every pass"


def test_reconcile_expires_silent_leases_and_takes_down_what_they_held(
    cluster: Any, make_row: Any, make_launch_row: Any, team: Any, sent: Any
) -> None:
    """Through the normal destroy path: each host's agent asks its own sandboxes of an over lease to stop
    and hands them to its lane; a launch of one is torn down, whichever agent sees it first."""
    here, there = cluster.add_host("h1"), cluster.add_host("h2")
    now = timezone.now()
    silent = Lease.objects.create(
        team=team, grace_s=5, heartbeat_at=now - timedelta(seconds=60), expires_at=now - timedelta(seconds=55)
    )
    alive = Lease.objects.create(team=team, grace_s=60, expires_at=now + timedelta(seconds=60))
    running = make_row(S.RUNNING, host=here, engine_id="engine-1", lease=silent)
    queued = make_row(S.QUEUED, host=here, lease=silent)
    elsewhere = make_row(S.RUNNING, host=there, engine_id="engine-2", lease=silent)
    kept = make_row(S.RUNNING, host=here, engine_id="engine-3", lease=alive)
    launch = make_launch_row(count=2, lease=silent)
    cluster.engine(here).sandboxes["engine-1"] = {"id": "engine-1", "key": running.pk, "state": "running", "labels": {}}
    cluster.engine(here).sandboxes["engine-3"] = {"id": "engine-3", "key": kept.pk, "state": "running", "labels": {}}

    counts = reconcile.reconcile(here)
    assert counts["lease_destroyed"] == 2
    lease = Lease.objects.get(pk=silent.pk)
    assert lease.state == Lease.State.EXPIRED and lease.ended_at == lease.expires_at
    assert Lease.objects.get(pk=alive.pk).state == Lease.State.ACTIVE
    states = {row.pk: Sandbox.objects.get(pk=row.pk).state for row in (running, queued, elsewhere, kept)}
    assert states == {running.pk: S.STOPPING, queued.pk: S.DESTROYED, elsewhere.pk: S.RUNNING, kept.pk: S.RUNNING}
    assert Launch.objects.get(pk=launch.pk).state in (Launch.State.STOPPING, Launch.State.STOPPED)
    assert [args for args in sent.named(commands.Command.ENSURE_GONE)] == [[here.name, [running.pk]]]
    assert reconcile.reconcile(here)["lease_destroyed"] == 0, "what is stopping already is not asked twice"
    assert reconcile.reconcile(there)["lease_destroyed"] == 1, "the other host's agent takes its own"


def test_reconcile_fixes_billing_both_ways(cluster: Any, make_row: Any, sent: Any) -> None:
    host = cluster.add_host("h1")
    unbilled = make_row(host=host)
    bring_up.bring_up(host, [unbilled.pk])
    UsagePeriod.objects.filter(sandbox=unbilled).delete()
    ended = make_row(S.DESTROYED, host=host, ended_at=timezone.now())
    UsagePeriod.objects.create(
        team=ended.team, sandbox=ended, kind="running", unit_price=1, started_at=timezone.now() - timedelta(hours=1)
    )
    assert reconcile.reconcile_billing(host) == 2
    assert UsagePeriod.objects.filter(sandbox=unbilled, ended_at=None).count() == 1
    assert not UsagePeriod.objects.filter(sandbox=ended, ended_at=None).exists()


def test_reconcile_billing_reads_each_table_alone(cluster: Any, make_row: Any, sent: Any) -> None:
    # Joined, PostgreSQL planned sandboxes and periods from statistics a launch had outgrown: nested loops,
    # a pass costing the square of the fleet. Each table is read alone, by index, whatever the planner knows.
    host = cluster.add_host("h1")
    rows = [make_row(host=host) for _ in range(3)]
    bring_up.bring_up(host, [row.pk for row in rows])
    with CaptureQueriesContext(connection) as queries:
        assert reconcile.reconcile_billing(host) == 0
    assert queries.captured_queries, "it read something"
    assert not [query["sql"] for query in queries.captured_queries if " JOIN " in query["sql"].upper()]


def test_reconcile_leaves_the_billing_of_a_stopping_sandbox_to_its_teardown(cluster: Any, make_row: Any, sent: Any) -> None:
    # A stopping sandbox still holds its host: billing ends when its teardown ends it, at the engine's end time.
    host = cluster.add_host("h1")
    stopping = make_row(host=host)
    bring_up.bring_up(host, [stopping.pk])
    Sandbox.objects.filter(pk=stopping.pk).update(state=S.STOPPING)
    assert reconcile.reconcile_billing(host) == 0
    assert UsagePeriod.objects.filter(sandbox=stopping, ended_at=None).count() == 1
    stopping.refresh_from_db()
    ended_at = timezone.now() + timedelta(seconds=30)
    assert transitions.sandboxes_destroyed([(stopping, ended_at)]) == {stopping.pk}
    period = UsagePeriod.objects.get(sandbox=stopping)
    assert period.ended_at == ended_at, "closed at the end the engine reported, not at a reconciliation pass"


# --- snapshots -----------------------------------------------------------------------------------


def test_a_snapshot_is_taken_by_the_sources_host_and_billed_once_ready(cluster: Any, make_row: Any, team: Any, sent: Any) -> None:
    host = cluster.add_host("h1")
    source = make_row(host=host)
    bring_up.bring_up(host, [source.pk])
    source.refresh_from_db()
    snapshot = Snapshot.objects.create(team=team, name="deps", source_sandbox=source, template="base", host=host)
    assert snapshots.snapshot_take(host, snapshot.pk) == Snapshot.State.READY
    assert snapshots.snapshot_take(host, snapshot.pk) == Snapshot.State.READY, "a replay"
    engine = cluster.engine(host)
    assert [args for op, args in engine.calls if op == "snapshots.create"] == [
        {"sandbox": source.engine_id, "name": snapshot.pk, "services": []}
    ]
    snapshot.refresh_from_db()
    assert (snapshot.size_bytes, snapshot.layer_id) == (2**20, f"layer-of-{snapshot.pk}")
    assert UsagePeriod.objects.filter(snapshot=snapshot, kind="saved_state", ended_at=None).count() == 1


def test_a_snapshot_of_a_sandbox_that_stopped_fails_with_a_code(cluster: Any, make_row: Any, team: Any, sent: Any) -> None:
    host = cluster.add_host("h1")
    source = make_row(S.DESTROYED, host=host)
    snapshot = Snapshot.objects.create(team=team, name="late", source_sandbox=source, template="base", host=host)
    assert snapshots.snapshot_take(host, snapshot.pk) == Snapshot.State.FAILED
    snapshot.refresh_from_db()
    assert snapshot.error_code == "sandbox_not_running" and "destroyed" in snapshot.error


# --- commands ------------------------------------------------------------------------------------


def test_every_command_is_a_registered_task() -> None:
    import grading.tasks  # noqa: F401 - registers them, as a worker does at start
    import sandboxes.tasks  # noqa: F401

    assert {str(command) for command in Command} <= set(commands.app.tasks)
    assert set(commands.EXPIRES) == set(Command)


def test_host_commands_travel_on_their_hosts_lane_and_expire(cluster: Any, sent: Any, settings: Any) -> None:
    settings.FORKYARD_LAUNCH_CHUNK = 2
    host = cluster.add_host("h1")
    commands.ensure_gone(host, ["a", "b", "c"])
    commands.dispatch_launch("launch_x", "")
    assert sent.commands == [
        (str(Command.ENSURE_GONE), ["h1", ["a", "b"]], "host.h1", 3600),
        (str(Command.ENSURE_GONE), ["h1", ["c"]], "host.h1", 3600),
        (str(Command.DISPATCH_LAUNCH), ["launch_x", ""], settings.CELERY_TASK_DEFAULT_QUEUE, None),
    ]


# --- secrets at rest ----------------------------------------------------------------------------


def test_a_launchs_environment_is_sealed_in_the_broker_and_the_database(cluster: Any, team: Any, sent: Any) -> None:
    from django.db import connection

    host = cluster.add_host("h1")
    spec = SandboxCreate.model_validate({"template": "base", "size": "tiny", "env": {"TOKEN": "s3cret-value"}})
    launch, _ = launch_create(team=team, key=None, spec=spec, count=2)
    [[_, sealed]] = sent.named(Command.DISPATCH_LAUNCH)
    assert sealed.startswith("sealed:") and "s3cret" not in sealed
    dispatch.dispatch(launch.pk, sealed)
    with connection.cursor() as cursor:
        cursor.execute("SELECT env FROM sandboxes_sandbox WHERE launch_id = %s", [launch.pk])
        stored = [row[0] for row in cursor.fetchall()]
    assert len(stored) == 2 and all(value.startswith("sealed:") and "s3cret" not in value for value in stored)
    assert all(row.env == {"TOKEN": "s3cret-value"} for row in Sandbox.objects.filter(launch=launch))
    [(_, ids)] = sent.named(Command.ENSURE_RUNNING)
    bring_up.bring_up(host, ids)
    assert [args["env"] for args in creates(cluster.engine(host))] == [{"TOKEN": "s3cret-value"}] * 2
    with connection.cursor() as cursor:
        cursor.execute("SELECT env FROM sandboxes_sandbox WHERE launch_id = %s", [launch.pk])
        assert {row[0] for row in cursor.fetchall()} == {""}, "cleared once the engine has it"


def test_an_upload_silent_too_long_fails_and_a_stuck_snapshot_is_queued_again(
    cluster: Any, team: Any, sent: Any, make_row: Any
) -> None:
    host = cluster.add_host("h1")
    source = make_row(Sandbox.State.RUNNING, host=host)
    taken = Snapshot.objects.create(team=team, name="taken", template="base", host=host, source_sandbox=source)
    upload = Snapshot.objects.create(
        id="snap_upload0000000001", team=team, name="image", template="snap_upload0000000001", host=host
    )
    fresh = Snapshot.objects.create(
        id="snap_upload0000000002", team=team, name="image", template="snap_upload0000000002", host=host
    )
    long_ago = timezone.now() - snapshots.STUCK_AFTER - timedelta(seconds=5)
    Snapshot.objects.filter(pk__in=[taken.pk, upload.pk]).update(updated_at=long_ago)

    assert snapshots.requeue_stuck_snapshots(host) == 1
    upload.refresh_from_db()
    assert (upload.state, upload.error_code) == (Snapshot.State.FAILED, "upload_interrupted")
    fresh.refresh_from_db()
    assert fresh.state == Snapshot.State.CREATING, "an upload touched lately is still arriving"
    queued = [str(args) for _name, args, _queue, _expires in sent.commands]
    assert any(taken.pk in args for args in queued) and not any("snap_upload" in args for args in queued), queued
