"""The state machines: every transition tried from every state, against the tables, and the billing each moves.

Each case starts a row in one state, calls one transition, and reads the row
back: it moved where the transition says, or it did not move at all.  Then
every move seen is checked against the table, so a transition can never make
a move the state machine does not name.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from billing.models import UsagePeriod
from sandboxes import transitions
from sandboxes.models import Host, Launch, Lease, Sandbox, Snapshot
from sandboxes.transitions import LAUNCH_MOVES, LEASE_MOVES, SANDBOX_MOVES, SNAPSHOT_MOVES

pytestmark = pytest.mark.django_db
S, L, N, E = Sandbox.State, Launch.State, Snapshot.State, Lease.State
ALL = list(S.values)


def _started(sandbox: Sandbox) -> None:
    transitions.sandboxes_started([(sandbox, {"id": "engine-1", "ready_at": timezone.now().timestamp()})])


def _claimed(sandbox: Sandbox) -> None:
    transitions.sandboxes_claimed([sandbox.pk], Host.objects.get())


# (transition, how to call it, where each state goes: a state not named does not move)
SANDBOX_CASES: list[tuple[str, Callable[[Sandbox], Any], dict[str, str]]] = [
    ("claimed", _claimed, {S.QUEUED: S.CREATING}),
    ("started", _started, {S.CREATING: S.RUNNING}),
    (
        "ended destroyed",
        lambda sandbox: transitions.sandbox_ended(sandbox, S.DESTROYED),
        dict.fromkeys(Sandbox.LIVE, S.DESTROYED),
    ),
    ("ended stopped", lambda sandbox: transitions.sandbox_ended(sandbox, S.STOPPED), {S.RUNNING: S.STOPPED, S.PAUSED: S.STOPPED}),
    ("ended failed", lambda sandbox: transitions.sandbox_ended(sandbox, S.FAILED), {S.QUEUED: S.FAILED, S.CREATING: S.FAILED}),
    (
        "failed",
        lambda sandbox: transitions.sandbox_failed(sandbox, code="c", message="m"),
        {S.QUEUED: S.FAILED, S.CREATING: S.FAILED, S.STOPPING: S.DESTROYED},
    ),
    ("paused", lambda sandbox: transitions.sandbox_pause_recorded(sandbox.pk, paused=True), {S.RUNNING: S.PAUSED}),
    ("resumed", lambda sandbox: transitions.sandbox_pause_recorded(sandbox.pk, paused=False), {S.PAUSED: S.RUNNING}),
    (
        "paused by a budget, many at once",
        lambda sandbox: transitions.sandboxes_paused([sandbox.pk], at=timezone.now(), reason="over_budget"),
        {S.RUNNING: S.PAUSED},
    ),
    (
        "destroy requested",
        transitions.sandbox_destroy_requested,
        {S.QUEUED: S.DESTROYED, S.CREATING: S.STOPPING, S.RUNNING: S.STOPPING, S.PAUSED: S.STOPPING},
    ),
    (
        "destroyed by the engine, many at once",
        lambda sandbox: transitions.sandboxes_destroyed([(sandbox, None)]),
        dict.fromkeys(Sandbox.LIVE, S.DESTROYED),
    ),
    (
        "destroy requested, many at once",
        lambda sandbox: transitions.sandboxes_destroy_requested([sandbox.pk]),
        {S.QUEUED: S.DESTROYED, S.CREATING: S.STOPPING, S.RUNNING: S.STOPPING, S.PAUSED: S.STOPPING},
    ),
]


@pytest.mark.parametrize("state", ALL)
@pytest.mark.parametrize(("name", "call", "moves"), SANDBOX_CASES, ids=[case[0] for case in SANDBOX_CASES])
def test_every_sandbox_transition_from_every_state(
    cluster: Any, make_row: Any, name: str, call: Callable[[Sandbox], Any], moves: dict[str, str], state: str
) -> None:
    host = cluster.add_host("h1")
    sandbox = make_row(state, host=host, engine_id="engine-1" if state in (S.RUNNING, S.PAUSED) else "")
    call(sandbox)
    after = Sandbox.objects.get(pk=sandbox.pk).state
    assert after == moves.get(state, state), f"{name} from {state}"
    if after != state:
        assert after in SANDBOX_MOVES[state], f"{name}: {state} -> {after} is not in the table"


def test_the_tables_name_every_state_and_nothing_else() -> None:
    for table, model in ((SANDBOX_MOVES, Sandbox), (LAUNCH_MOVES, Launch), (SNAPSHOT_MOVES, Snapshot), (LEASE_MOVES, Lease)):
        states = set(model.State.values)
        assert set(table) == states and all(targets <= states for targets in table.values()), model.__name__


def test_a_move_outside_the_table_is_refused_before_the_database_is_asked(make_row: Any) -> None:
    sandbox = make_row(S.DESTROYED)
    with pytest.raises(AssertionError, match="not a move of the state machine"):
        transitions.sandbox_ended(sandbox, S.STOPPED, only_from={S.DESTROYED})


def test_ended_states_are_final() -> None:
    for state in Sandbox.ENDED:
        assert SANDBOX_MOVES[state] == frozenset()
    assert LAUNCH_MOVES[L.STOPPED] == LAUNCH_MOVES[L.FAILED] == frozenset()
    assert SNAPSHOT_MOVES[N.DELETED] == frozenset()


# --- billing moves with the state --------------------------------------------------------------


def test_started_bills_from_the_engines_ready_time_and_ended_closes_at_its_end(cluster: Any, make_row: Any) -> None:
    host = cluster.add_host("h1")
    sandbox = make_row(S.CREATING, host=host)
    ready = timezone.now() - timedelta(seconds=30)
    outcome = transitions.sandboxes_started([(sandbox, {"id": "engine-7", "ready_at": ready.timestamp()})])
    assert outcome.running == {sandbox.pk} and not outcome.to_destroy
    [period] = UsagePeriod.objects.filter(sandbox=sandbox)
    assert period.kind == "running" and abs((period.started_at - ready).total_seconds()) < 0.001 and period.ended_at is None
    row = Sandbox.objects.get(pk=sandbox.pk)
    assert (row.engine_id, row.env) == ("engine-7", {})
    end = ready + timedelta(seconds=10)
    assert transitions.sandbox_ended(row, S.DESTROYED, at=end)
    period.refresh_from_db()
    assert period.duration_ms == 10_000 and period.ended_at == end
    assert not transitions.sandbox_ended(row, S.DESTROYED), "a second end is a no-op"
    assert UsagePeriod.objects.filter(sandbox=sandbox).count() == 1


def test_many_destroyed_at_once_close_each_period_at_its_own_end(cluster: Any, make_row: Any) -> None:
    host = cluster.add_host("h1")
    ready = timezone.now() - timedelta(seconds=60)
    rows = [make_row(S.CREATING, host=host) for _ in range(3)]
    transitions.sandboxes_started([(row, {"id": f"engine-{n}", "ready_at": ready.timestamp()}) for n, row in enumerate(rows)])
    gone_before = Sandbox.objects.get(pk=rows[2].pk)
    assert transitions.sandbox_ended(gone_before, S.DESTROYED, at=ready + timedelta(seconds=5))
    ends = [ready + timedelta(seconds=10), ready + timedelta(seconds=20), ready + timedelta(seconds=30)]
    moved = transitions.sandboxes_destroyed(list(zip(rows, ends, strict=True)))
    assert moved == {rows[0].pk, rows[1].pk}, "the one ended already does not move again"
    periods = {period.sandbox_id: period for period in UsagePeriod.objects.filter(sandbox__in=rows)}
    assert [periods[row.pk].duration_ms for row in rows] == [10_000, 20_000, 5_000]
    assert all(period.amount > 0 for period in periods.values())
    assert [Sandbox.objects.get(pk=row.pk).ended_at for row in rows[:2]] == ends[:2]
    assert transitions.sandboxes_destroyed([(rows[0], ends[0])]) == set(), "a replay moves nothing"


def test_pause_and_resume_switch_the_billed_rate(cluster: Any, make_row: Any) -> None:
    sandbox = make_row(S.CREATING, host=cluster.add_host("h1"))
    _started(sandbox)
    assert transitions.sandbox_pause_recorded(sandbox.pk, paused=True)
    assert not transitions.sandbox_pause_recorded(sandbox.pk, paused=True), "a replay moves nothing"
    assert transitions.sandbox_pause_recorded(sandbox.pk, paused=False)
    kinds = list(UsagePeriod.objects.filter(sandbox=sandbox).order_by("started_at", "id").values_list("kind", "ended_at"))
    assert [kind for kind, _ in kinds] == ["running", "paused", "running"]
    assert [ended is None for _, ended in kinds] == [False, False, True]


def test_a_create_that_returns_after_its_destroy_never_runs(cluster: Any, make_row: Any) -> None:
    """The race by construction: destroy asked while the engine creates; the engine's answer comes after."""
    sandbox = make_row(S.CREATING, host=cluster.add_host("h1"))
    assert transitions.sandbox_destroy_requested(sandbox).state == S.STOPPING
    outcome = transitions.sandboxes_started([(sandbox, {"id": "engine-9", "ready_at": timezone.now().timestamp()})])
    assert outcome.running == set() and [(row.pk, engine_id) for row, engine_id in outcome.to_destroy] == [
        (sandbox.pk, "engine-9")
    ]
    row = Sandbox.objects.get(pk=sandbox.pk)
    assert (row.state, row.engine_id) == (S.STOPPING, "engine-9"), "recorded, so whoever destroys it knows what"
    assert not UsagePeriod.objects.filter(sandbox=sandbox).exists(), "never billed"


def test_a_create_recorded_first_by_reconciliation_is_not_destroyed(cluster: Any, make_row: Any) -> None:
    sandbox = make_row(S.RUNNING, host=cluster.add_host("h1"), engine_id="engine-3")
    outcome = transitions.sandboxes_started([(sandbox, {"id": "engine-3"})])
    assert outcome.recorded_before == {sandbox.pk} and not outcome.to_destroy and not outcome.running


def test_queued_members_of_a_launch_that_stopped_are_never_claimed(cluster: Any, make_row: Any, make_launch_row: Any) -> None:
    host = cluster.add_host("h1")
    launch = make_launch_row(count=1, state=L.STOPPING)
    member = make_row(S.QUEUED, host=host, launch=launch, launch_index=0)
    assert transitions.sandboxes_claimed([member.pk], host) == 0
    assert Sandbox.objects.get(pk=member.pk).state == S.QUEUED


@pytest.mark.django_db(transaction=True)
def test_a_claim_waiting_on_a_teardowns_lock_does_not_revive_the_members_it_destroyed(
    cluster: Any, make_row: Any, make_launch_row: Any
) -> None:
    """Seen on PostgreSQL: a worker's claim (queued -> creating, filtered by its launch's state, so
    through a join) blocked on the rows a teardown was destroying, then moved them anyway once the
    teardown committed: the database rechecked them against the claim's old snapshot. The launch said
    stopped while its members sat in creating."""
    if connection.vendor != "postgresql":
        pytest.skip("a row recheck of PostgreSQL's: SQLite lets one writer in at a time")
    host = cluster.add_host("h1")
    launch = make_launch_row(count=1)
    member = make_row(S.QUEUED, host=host, launch=launch, launch_index=0)
    claimed: list[int] = []

    def claim() -> None:
        try:
            claimed.append(transitions.sandboxes_claimed([member.pk], host))
        finally:
            connections.close_all()

    worker = threading.Thread(target=claim)
    with transaction.atomic():
        transitions.launch_teardown_requested(launch)  # the member destroyed, its row locked until the commit
        worker.start()
        deadline = time.monotonic() + 30
        with connection.cursor() as cursor:
            while True:  # until the claim waits on that lock: the race, not a claim that came after
                cursor.execute("SELECT pg_stat_clear_snapshot()")  # the view is otherwise read once a transaction
                cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid()")
                if cursor.fetchone()[0]:
                    break
                assert worker.is_alive() and time.monotonic() < deadline, "the claim never waited on the teardown"
                time.sleep(0.01)
    worker.join(30)
    assert claimed == [0]
    assert Sandbox.objects.get(pk=member.pk).state == S.DESTROYED
    assert Launch.objects.get(pk=launch.pk).state == L.STOPPED


# --- launches ----------------------------------------------------------------------------------


def test_teardown_ends_queued_members_stops_started_ones_and_names_their_hosts(
    cluster: Any, make_row: Any, make_launch_row: Any
) -> None:
    host = cluster.add_host("h1")
    launch = make_launch_row(count=len(ALL))
    members = {state: make_row(state, host=host, launch=launch, launch_index=index) for index, state in enumerate(ALL)}
    stopping = transitions.launch_teardown_requested(launch)
    after = {state: Sandbox.objects.get(pk=row.pk).state for state, row in members.items()}
    assert after == {
        S.QUEUED: S.DESTROYED,
        S.CREATING: S.STOPPING,
        S.RUNNING: S.STOPPING,
        S.PAUSED: S.STOPPING,
        S.STOPPING: S.STOPPING,
        S.STOPPED: S.STOPPED,
        S.FAILED: S.FAILED,
        S.DESTROYED: S.DESTROYED,
    }
    assert stopping == {host.pk: [members[state].pk for state in (S.CREATING, S.RUNNING, S.PAUSED, S.STOPPING)]}
    assert Launch.objects.get(pk=launch.pk).state == L.STOPPING
    assert not transitions.launch_admits_members(launch), "no member is added after a teardown"


def test_a_launch_torn_down_before_any_member_exists_is_stopped_at_once(make_launch_row: Any) -> None:
    launch = make_launch_row(count=100)
    assert transitions.launch_teardown_requested(launch) == {}
    launch.refresh_from_db()
    assert (launch.state, launch.ended_at is not None) == (L.STOPPED, True)


@pytest.mark.parametrize(
    ("launch_state", "member_states", "count", "settled"),
    [
        (L.CREATING, [S.RUNNING, S.RUNNING], 2, L.READY),  # all made, none pending
        (L.CREATING, [S.RUNNING, S.CREATING], 2, L.CREATING),  # one still on its way
        (L.CREATING, [S.RUNNING], 2, L.CREATING),  # one not made yet
        (L.CREATING, [S.FAILED, S.DESTROYED], 2, L.STOPPED),  # made, and none alive
        (L.READY, [S.DESTROYED, S.STOPPED], 2, L.STOPPED),  # every member ended on its own
        (L.STOPPING, [S.DESTROYED], 5, L.STOPPED),  # torn down: no more will be made
        (L.STOPPING, [S.STOPPING], 1, L.STOPPING),
        (L.FAILED, [], 3, L.FAILED),
        (L.STOPPED, [], 3, L.STOPPED),
    ],
)
def test_launch_settles(
    cluster: Any, make_row: Any, make_launch_row: Any, launch_state: str, member_states: list[str], count: int, settled: str
) -> None:
    host = cluster.add_host("h1")
    launch = make_launch_row(count=count, state=launch_state)
    for index, state in enumerate(member_states):
        make_row(state, host=host, launch=launch, launch_index=index)
    assert transitions.launch_settled(launch) == settled
    if settled != launch_state:
        assert settled in LAUNCH_MOVES[launch_state] or (launch_state, settled) == (L.CREATING, L.STOPPED)


@pytest.mark.parametrize("state", list(L.values))
def test_only_a_starting_launch_fails(make_launch_row: Any, state: str) -> None:
    launch = make_launch_row(state=state)
    assert transitions.launch_failed(launch) == (state == L.CREATING)


# --- snapshots ---------------------------------------------------------------------------------


@pytest.fixture
def snapshot_in(cluster: Any, make_row: Any, team: Any) -> Callable[[str], Snapshot]:
    host = cluster.add_host("h1")
    source = make_row(S.RUNNING, host=host, engine_id="engine-1")

    def make(state: str) -> Snapshot:
        return Snapshot.objects.create(team=team, name="s", state=state, source_sandbox=source, template="base", host=host)

    return make


RECORD = {"layer": "layer-1", "size_bytes": 3 * 2**30, "total_bytes": 4 * 2**30, "paused_ms": 2.0, "services": []}


@pytest.mark.parametrize("state", list(N.values))
def test_every_snapshot_transition_from_every_state(snapshot_in: Callable[[str], Snapshot], state: str) -> None:
    cases = [
        (lambda snapshot: transitions.snapshot_ready(snapshot, Host.objects.get(), record=RECORD), {N.CREATING: N.READY}),
        (lambda snapshot: transitions.snapshot_failed(snapshot, code="c", message="m"), {N.CREATING: N.FAILED}),
        (transitions.snapshot_deleted, {N.CREATING: N.DELETED, N.READY: N.DELETED, N.FAILED: N.DELETED}),
    ]
    for call, moves in cases:
        snapshot = snapshot_in(state)
        call(snapshot)
        after = Snapshot.objects.get(pk=snapshot.pk).state
        assert after == moves.get(state, state)
        if after != state:
            assert after in SNAPSHOT_MOVES[state]


def test_saved_state_is_billed_by_the_gib_from_ready_to_deleted(snapshot_in: Callable[[str], Snapshot]) -> None:
    snapshot = snapshot_in(N.CREATING)
    assert transitions.snapshot_ready(snapshot, Host.objects.get(), record=RECORD)
    [period] = UsagePeriod.objects.filter(snapshot=snapshot)
    assert (period.kind, str(period.quantity_gib), period.ended_at) == ("saved_state", "3.000000", None)
    assert list(snapshot.hosts.values_list("name", flat=True)) == ["h1"]
    assert transitions.snapshot_deleted(snapshot)
    period.refresh_from_db()
    assert period.ended_at is not None and period.amount is not None


# --- many at once, and leases ------------------------------------------------------------------


def test_many_destroyed_at_once_name_their_hosts_and_settle_their_launches(
    cluster: Any, make_row: Any, make_launch_row: Any
) -> None:
    one, two = cluster.add_host("h1"), cluster.add_host("h2")
    launch = make_launch_row(count=1)
    rows = {state: make_row(state, host=one) for state in ALL}
    rows["elsewhere"] = make_row(S.RUNNING, host=two)
    rows["member"] = make_row(S.QUEUED, host=one, launch=launch, launch_index=0)
    outcome = transitions.sandboxes_destroy_requested([row.pk for row in rows.values()] + ["sb_nobody"])
    assert sorted(outcome.destroyed) == sorted([rows[S.QUEUED].pk, rows["member"].pk])
    assert outcome.stopping == {
        one.pk: sorted(rows[state].pk for state in (S.CREATING, S.RUNNING, S.PAUSED)),
        two.pk: [rows["elsewhere"].pk],
    }, "stopping already, or ended: not asked again"
    assert outcome.count == 6
    assert Launch.objects.get(pk=launch.pk).state == L.STOPPED, "its only member ended before it started"
    again = transitions.sandboxes_destroy_requested([row.pk for row in rows.values()])
    assert again.count == 0


def _lease(team: Any, *, grace_s: int = 60, expired_ago_s: float | None = None, state: str = E.ACTIVE) -> Lease:
    now = timezone.now()
    expires = now - timedelta(seconds=expired_ago_s) if expired_ago_s is not None else now + timedelta(seconds=grace_s)
    return Lease.objects.create(team=team, grace_s=grace_s, state=state, expires_at=expires)


@pytest.mark.parametrize("state", list(E.values))
def test_every_lease_transition_from_every_state(team: Any, state: str) -> None:
    cases: list[tuple[Callable[[Lease], Any], dict[str, str]]] = [
        (transitions.lease_ended, {E.ACTIVE: E.ENDED}),
        (lambda lease: transitions.leases_expired([lease.pk]), {E.ACTIVE: E.EXPIRED}),
    ]
    for call, moves in cases:
        lease = _lease(team, expired_ago_s=1, state=state)
        call(lease)
        after = Lease.objects.get(pk=lease.pk).state
        assert after == moves.get(state, state)
        if after != state:
            assert after in LEASE_MOVES[state]


def test_a_heartbeat_keeps_an_active_lease_and_never_revives_one(team: Any) -> None:
    lease = _lease(team, grace_s=30)
    before = lease.expires_at
    assert transitions.lease_renewed(lease)
    assert Lease.objects.get(pk=lease.pk).expires_at >= before
    assert transitions.leases_expired() == 0, "an active lease in its grace does not expire"
    late = _lease(team, grace_s=5, expired_ago_s=1)
    assert not transitions.lease_renewed(late), "its grace ran out before the heartbeat came"
    assert transitions.leases_expired() == 1
    assert Lease.objects.get(pk=late.pk).state == E.EXPIRED
    assert not transitions.lease_renewed(late)
    ended = _lease(team)
    assert transitions.lease_ended(ended) and not transitions.lease_renewed(ended)


def test_what_an_over_lease_held_is_taken_down(cluster: Any, team: Any, make_row: Any, make_launch_row: Any) -> None:
    host = cluster.add_host("h1")
    over, active = _lease(team, state=E.ENDED), _lease(team)
    held = [make_row(state, host=host, lease=over) for state in (S.QUEUED, S.RUNNING, S.STOPPING, S.DESTROYED)]
    kept = make_row(S.RUNNING, host=host, lease=active)
    launch = make_launch_row(count=3, lease=over)
    outcome = transitions.over_leases_taken_down(host=host)
    assert outcome.destroyed == [held[0].pk] and outcome.stopping == {host.pk: [held[1].pk]}
    assert Launch.objects.get(pk=launch.pk).state == L.STOPPED, "torn down: it makes no more members"
    assert Sandbox.objects.get(pk=kept.pk).state == S.RUNNING
    assert transitions.over_leases_taken_down(lease=over).count == 0, "nothing is asked twice"
