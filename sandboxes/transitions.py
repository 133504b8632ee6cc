"""Every change of state of a sandbox, a launch or a snapshot, and nothing else.

The three state machines are the tables below: a state, and the states it
may move to.  Each transition is one function here: a conditional ``UPDATE``
that names the states it may leave (so that of two racing callers exactly one
moves a row, and a replay moves nothing), the billing period it opens or
closes in the same transaction, and the notification that wakes a request
waiting on the sandbox, sent once the transaction commits.  Nothing here
queues a command or calls an engine: the services and the worker do that
around these functions.

A sandbox's host is part of its state: every transition a host's worker
makes names the host it asked (the row's host as that worker loaded it), so
that once a sandbox that never started is placed on another host
(``sandboxes_replaced``: its host stopped answering), nothing the first host
still had in flight can start, fail or end it.

Two races of this family are closed by construction:

* **A destroy that arrives during a create.**  The destroy moves the row
  ``creating -> stopping``.  When the engine's create returns,
  ``sandboxes_started`` moves only rows still ``creating``; a row it finds
  ``stopping`` gets the engine's id recorded instead, and is handed back to be
  destroyed.  A create can never turn a ``stopping`` row into a ``running``
  one, and whoever finishes the destroy (that worker at once, the
  ``ensure_gone`` command, or reconciliation) has the id it needs.
* **A launch torn down while its sandboxes are still queued.**  The teardown
  locks the launch's row, moves it to ``stopping``, ends its queued members
  and stops the started ones, all in one transaction.  The dispatcher inserts
  each chunk of members holding the same lock, and only while the launch is
  ``creating`` (``launch_admits_members``); and ``queued -> creating``
  refuses members of a launch that is no longer starting.  So a torn-down
  launch gains no member afterwards, and none of its queued members starts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from django.db import models, transaction
from django.db.models import F, Q, QuerySet
from django.utils import timezone

from billing.models import UsagePeriod
from billing.services import close_periods, gib_of, open_periods, open_running_periods, saved_state_transition, usage_transition
from console.db import one_writer, update_each

from . import notify
from .models import ExposedPort, Host, Launch, Lease, Sandbox, Snapshot, Template, TemplateBuild

S, L, N, E = Sandbox.State, Launch.State, Snapshot.State, Lease.State
Row = TypeVar("Row", bound=models.Model)

# --- the state machines ------------------------------------------------------------------------

SANDBOX_MOVES: dict[str, frozenset[str]] = {
    S.QUEUED: frozenset({S.CREATING, S.FAILED, S.DESTROYED}),  # destroyed: asked before it reached its host
    # queued: its host stopped answering before it started, and it is placed on another (sandboxes_replaced)
    S.CREATING: frozenset({S.QUEUED, S.RUNNING, S.STOPPING, S.FAILED, S.DESTROYED}),
    S.RUNNING: frozenset({S.PAUSED, S.STOPPING, S.STOPPED, S.DESTROYED}),  # stopped: it died on its own
    S.PAUSED: frozenset({S.RUNNING, S.STOPPING, S.STOPPED, S.DESTROYED}),
    S.STOPPING: frozenset({S.DESTROYED}),
    S.STOPPED: frozenset(),
    S.FAILED: frozenset(),
    S.DESTROYED: frozenset(),
}
LAUNCH_MOVES: dict[str, frozenset[str]] = {
    L.CREATING: frozenset({L.READY, L.STOPPING, L.FAILED}),  # failed: no host could run it
    L.READY: frozenset({L.STOPPING, L.STOPPED}),  # stopped: every member ended on its own
    L.STOPPING: frozenset({L.STOPPED}),
    L.STOPPED: frozenset(),
    L.FAILED: frozenset(),
}
SNAPSHOT_MOVES: dict[str, frozenset[str]] = {
    N.CREATING: frozenset({N.READY, N.FAILED, N.DELETED}),
    N.READY: frozenset({N.DELETED}),
    N.FAILED: frozenset({N.DELETED}),
    N.DELETED: frozenset(),
}
LEASE_MOVES: dict[str, frozenset[str]] = {
    E.ACTIVE: frozenset({E.EXPIRED, E.ENDED}),  # expired: its heartbeats stopped; ended: its client ended it
    E.EXPIRED: frozenset(),
    E.ENDED: frozenset(),
}


def sources(table: dict[str, frozenset[str]], target: str) -> frozenset[str]:
    """The states a row may leave for ``target``."""
    return frozenset(state for state, targets in table.items() if target in targets)


def _move(
    rows: QuerySet[Row], table: dict[str, frozenset[str]], target: str, only_from: set[str] | None = None, **fields: Any
) -> int:
    """The one conditional UPDATE every transition makes: the rows in a state that may become ``target``
    (or in ``only_from``, a part of those), moved; how many moved."""
    allowed = sources(table, target)
    if only_from is not None:
        if not only_from <= allowed:
            raise AssertionError(f"{sorted(only_from - allowed)} -> {target} is not a move of the state machine")
        allowed = frozenset(only_from)
    if sum(1 for alias in rows.query.alias_map if rows.query.alias_refcount[alias]) > 1:
        # A filter through another table (a launch's state, say) makes Django's UPDATE "WHERE pk IN (a
        # subquery)". PostgreSQL rechecks a row that a concurrent transaction changed against that
        # subquery's old snapshot, not against the row's new state: a sandbox a teardown had just destroyed
        # would be moved on regardless. So pick the rows first, then move them with the state test on the
        # rows themselves, which the recheck does see.
        picked = list(rows.filter(state__in=allowed).values_list("pk", flat=True))
        model = rows.model._default_manager
        return sum(
            model.filter(pk__in=picked[start : start + 2000], state__in=allowed).update(state=target, **fields)
            for start in range(0, len(picked), 2000)
        )
    return rows.filter(state__in=allowed).update(state=target, **fields)


def _chunks(ids: Sequence[str], size: int = 500) -> Iterator[list[str]]:
    """Ids a few hundred at a time, for IN lists (SQLite takes at most 32,766 parameters in a statement)."""
    for start in range(0, len(ids), size):
        yield list(ids[start : start + size])


def _wake(sandbox_ids: list[str]) -> None:
    """Requests waiting on these sandboxes look again, once this transaction has committed."""
    if sandbox_ids:
        transaction.on_commit(lambda: notify.publish(sandbox_ids))


# --- sandboxes ---------------------------------------------------------------------------------


def sandboxes_claimed(sandbox_ids: Sequence[str], host: Host) -> int:
    """queued -> creating: a worker (or the web server's direct path) is about to ask ``host``'s engine.

    Members of a launch that is no longer starting stay as they are: its
    teardown ended the queued ones in the transaction that stopped it.
    """
    rows = Sandbox.objects.filter(pk__in=list(sandbox_ids), host=host).filter(
        Q(launch__isnull=True) | Q(launch__state=L.CREATING)
    )
    return _move(rows, SANDBOX_MOVES, S.CREATING, updated_at=timezone.now())


@dataclass
class Started:
    """What became of sandboxes whose engine create came back running."""

    running: set[str] = field(default_factory=set)  # creating -> running now, billed from the engine's ready time
    recorded_before: set[str] = field(default_factory=set)  # reconciliation recorded the same engine sandbox first
    to_destroy: list[tuple[Sandbox, str]] = field(
        default_factory=list
    )  # (row, engine id): destroy asked meanwhile, or no row wants it


def engine_time(record: dict[str, Any], key: str) -> datetime | None:
    """A time from an engine record (epoch seconds)."""
    epoch = record.get(key)
    return datetime.fromtimestamp(epoch, tz=UTC) if epoch else None


def sandboxes_started(started: Sequence[tuple[Sandbox, dict[str, Any]]]) -> Started:
    """creating -> running for many at once (one transaction, a few queries), each with its first billed period.

    A row found ``stopping`` (its destroy came while the engine created it)
    does not run: the engine's id is recorded on it, and it is returned in
    ``to_destroy``, as is an engine sandbox whose row has already ended.
    """
    outcome = Started()
    if not started:
        return outcome
    with one_writer(), transaction.atomic():
        # Stamped once this writer's turn has come: the board reads rows by
        # updated_at, and a stamp taken before a wait for the lock is older
        # than the commit by that wait.
        now = timezone.now()
        # Locked in primary-key order, so that a destroy cannot move one of them between this read and the write.
        current = {
            pk: (state, engine_id, host_id)
            for pk, state, engine_id, host_id in Sandbox.objects.select_for_update()
            .filter(pk__in=[sandbox.pk for sandbox, _ in started])
            .order_by("pk")
            .values_list("pk", "state", "engine_id", "host_id")
        }
        moving: list[Sandbox] = []
        ready: dict[str, datetime] = {}
        for sandbox, record in started:
            state, engine_id, host_id = current.get(sandbox.pk, ("", "", None))
            if host_id != sandbox.host_id:
                # Placed on another host meanwhile (its host had stopped answering): this copy is nobody's.
                outcome.to_destroy.append((sandbox, record["id"]))
            elif state == S.CREATING:
                sandbox.state, sandbox.engine_id, sandbox.env = S.RUNNING, record["id"], {}
                sandbox.ready_at = ready[sandbox.pk] = engine_time(record, "ready_at") or now
                sandbox.expires_at, sandbox.updated_at = engine_time(record, "expires_at"), now
                moving.append(sandbox)
            elif state in Sandbox.STARTED and engine_id == record["id"]:
                outcome.recorded_before.add(sandbox.pk)
            else:
                if state == S.STOPPING and not engine_id:
                    Sandbox.objects.filter(pk=sandbox.pk, state=S.STOPPING, engine_id="").update(
                        engine_id=record["id"], updated_at=now
                    )
                outcome.to_destroy.append((sandbox, record["id"]))
        update_each(
            Sandbox,
            ["state", "engine_id", "env", "ready_at", "expires_at", "updated_at"],
            [(row.pk, (row.state, row.engine_id, row.env, row.ready_at, row.expires_at, row.updated_at)) for row in moving],
        )
        open_running_periods(moving, ready)
        outcome.running = {sandbox.pk for sandbox in moving}
        _wake(sorted(outcome.running))
    return outcome


def sandbox_engine_recorded(sandbox: Sandbox, engine_id: str) -> bool:
    """A stopping row learns which engine sandbox is its own (found by reconciliation), so that it can be destroyed."""
    return bool(Sandbox.objects.filter(pk=sandbox.pk, state=S.STOPPING, engine_id="").update(engine_id=engine_id))


def sandbox_ended(
    sandbox: Sandbox,
    state: str,
    *,
    at: datetime | None = None,
    code: str = "",
    message: str = "",
    only_from: set[str] | None = None,
) -> bool:
    """A live sandbox -> ``state`` (stopped, failed or destroyed), its billing closed at the moment it ended;
    only while it is on the host the caller knew it on."""
    ended_at = at or timezone.now()
    with transaction.atomic():
        on_its_host = Q(host__isnull=True) if sandbox.host_id is None else Q(host_id=sandbox.host_id)
        moved = _move(
            Sandbox.objects.filter(on_its_host, pk=sandbox.pk),
            SANDBOX_MOVES,
            state,
            only_from,
            ended_at=ended_at,
            updated_at=timezone.now(),
            env={},
            error_code=code[:64],
            error_message=message[:500],
        )
        if moved:
            usage_transition(sandbox=sandbox, kind=None, at=ended_at)
            ExposedPort.objects.filter(sandbox_id=sandbox.pk).delete()  # its ports close with it
            _wake([sandbox.pk])
    return bool(moved)


def sandboxes_destroyed(ended: Sequence[tuple[Sandbox, datetime | None]]) -> set[str]:
    """Live sandboxes the engine destroyed -> destroyed, many at once, each at its own end time (None:
    now): one transaction, their billing closed in one update. A teardown of hundreds takes one
    write turn instead of one each. The ids that moved."""
    if not ended:
        return set()
    with one_writer(), transaction.atomic():
        now = timezone.now()
        allowed = sources(SANDBOX_MOVES, S.DESTROYED)
        wanted = {sandbox.pk: at or now for sandbox, at in ended}
        moved: dict[str, datetime] = {}
        for part in _chunks(sorted(wanted)):
            # Locked in key order; those in a state that may become destroyed move, in one statement run for each.
            states = Sandbox.objects.select_for_update().filter(pk__in=part).order_by("pk").values_list("pk", "state")
            moved.update({pk: wanted[pk] for pk, state in states if state in allowed})
        update_each(
            Sandbox,
            ["state", "ended_at", "updated_at", "env", "error_code", "error_message"],
            [(pk, (S.DESTROYED, at, now, {}, "", "")) for pk, at in moved.items()],
        )
        close_periods(moved)
        ExposedPort.objects.filter(sandbox_id__in=list(moved)).delete()  # their ports close with them
        _wake(sorted(moved))
    return set(moved)


def sandbox_failed(sandbox: Sandbox, *, code: str, message: str) -> str:
    """Its create failed: queued or creating -> failed; or, if a destroy was asked meanwhile, stopping ->
    destroyed (it never ran). The state it is in now."""
    if sandbox_ended(sandbox, S.FAILED, code=code, message=message):
        return S.FAILED
    if sandbox_ended(sandbox, S.DESTROYED, only_from={S.STOPPING}):
        return S.DESTROYED
    return Sandbox.objects.values_list("state", flat=True).get(pk=sandbox.pk)


def sandboxes_replaced(sandbox_ids: Sequence[str], *, lost: Host, to: Host) -> list[str]:
    """Sandboxes that never started on ``lost`` (its heartbeat stopped) placed on ``to``: queued -> queued
    there, creating (no engine sandbox recorded) -> queued there. Only rows still on ``lost`` and not started
    move, so that of two callers one moves each; nothing was billed. The ids that moved."""
    with one_writer(), transaction.atomic():
        now = timezone.now()
        moving = list(
            Sandbox.objects.select_for_update()
            .filter(pk__in=list(sandbox_ids), host=lost, state__in=[S.QUEUED, S.CREATING], engine_id="")
            .order_by("pk")
            .values_list("pk", flat=True)
        )
        rows = Sandbox.objects.filter(pk__in=moving)
        _move(rows, SANDBOX_MOVES, S.QUEUED, {S.CREATING}, host=to, updated_at=now)
        rows.filter(state=S.QUEUED).update(host=to, updated_at=now)
        _wake(moving)
    return moving


def sandboxes_lost(host: Host) -> int:
    """The started sandboxes of a host offline for good (``FORKYARD_HOST_LOST_S``): running or paused -> stopped
    (``host_lost``), stopping -> destroyed, each at the host's last heartbeat (or its own start, if later): the
    last moment it is known to have run, where its billing closes. How many ended."""
    ended: dict[str, datetime] = {}
    launches: set[str] = set()
    with one_writer(), transaction.atomic():
        now = timezone.now()
        live = Sandbox.objects.select_for_update().filter(host=host, state__in=[S.RUNNING, S.PAUSED, S.STOPPING])
        for pk, state, ready_at, launch_id in live.order_by("pk").values_list("pk", "state", "ready_at", "launch_id"):
            at = max(host.last_heartbeat, ready_at) if ready_at else host.last_heartbeat
            rows = Sandbox.objects.filter(pk=pk, host=host)
            if state == S.STOPPING:
                moved = _move(rows, SANDBOX_MOVES, S.DESTROYED, {S.STOPPING}, ended_at=at, updated_at=now, env={})
            else:
                message = f"its host {host.name} stopped answering at {host.last_heartbeat.isoformat(timespec='seconds')}"
                moved = _move(
                    rows,
                    SANDBOX_MOVES,
                    S.STOPPED,
                    {S.RUNNING, S.PAUSED},
                    ended_at=at,
                    updated_at=now,
                    env={},
                    error_code="host_lost",
                    error_message=message,
                )
            if moved:
                ended[pk] = at
                if launch_id:
                    launches.add(launch_id)
        close_periods(ended)
        ExposedPort.objects.filter(sandbox_id__in=list(ended)).delete()
        _wake(sorted(ended))
        for launch in Launch.objects.filter(pk__in=sorted(launches)):
            launch_settled(launch)
    return len(ended)


def sandbox_pause_recorded(sandbox_id: str, *, paused: bool) -> bool:
    """running <-> paused, after its engine paused (or resumed) it; the period billed at the paused rate opens or closes."""
    now = timezone.now()
    target = S.PAUSED if paused else S.RUNNING
    with transaction.atomic():
        rows = Sandbox.objects.filter(pk=sandbox_id)
        moved = _move(rows, SANDBOX_MOVES, target, {S.RUNNING} if paused else {S.PAUSED}, updated_at=now)
        if moved:
            kind = UsagePeriod.Kind.PAUSED if paused else UsagePeriod.Kind.RUNNING
            usage_transition(sandbox=rows.get(), kind=kind, at=now)
    return bool(moved)


def sandboxes_paused(sandbox_ids: Sequence[str], *, at: datetime, reason: str = "", rebill: Sequence[str] = ()) -> list[str]:
    """running -> paused for many at once, after their engines paused them (a budget reached): their
    running periods close at ``at`` and paused ones open, marked with ``reason``. ``rebill``: sandboxes
    already paused whose paused period restarts at ``at`` with ``reason`` (so a statement says why they
    went on costing). Rows locked in key order, one transaction. The ids that moved."""
    moved: list[str] = []
    with one_writer(), transaction.atomic():
        now = timezone.now()
        for chunk in _chunks(sorted(set(sandbox_ids))):
            locked = list(Sandbox.objects.select_for_update().filter(pk__in=chunk, state=S.RUNNING).order_by("pk"))
            ids = [row.pk for row in locked]
            _move(Sandbox.objects.filter(pk__in=ids), SANDBOX_MOVES, S.PAUSED, {S.RUNNING}, updated_at=now)
            close_periods({pk: at for pk in ids})
            open_periods(locked, {pk: at for pk in ids}, kind=UsagePeriod.Kind.PAUSED, reason=reason)
            moved += ids
        for chunk in _chunks(sorted(set(rebill))):
            locked = list(Sandbox.objects.select_for_update().filter(pk__in=chunk, state=S.PAUSED).order_by("pk"))
            ids = [row.pk for row in locked]
            close_periods({pk: at for pk in ids})
            open_periods(locked, {pk: at for pk in ids}, kind=UsagePeriod.Kind.PAUSED, reason=reason)
    return moved


def sandbox_destroy_requested(sandbox: Sandbox) -> Sandbox:
    """Destroy asked: queued -> destroyed at once (it never reached its host, nothing was billed);
    creating, running or paused -> stopping (the host's worker then destroys it). Idempotent."""
    now = timezone.now()
    rows = Sandbox.objects.filter(pk=sandbox.pk)
    with transaction.atomic():
        if _move(rows, SANDBOX_MOVES, S.DESTROYED, {S.QUEUED}, ended_at=now, updated_at=now, env={}):
            _wake([sandbox.pk])
        else:
            _move(rows, SANDBOX_MOVES, S.STOPPING, updated_at=now)
    return Sandbox.objects.select_related("host").get(pk=sandbox.pk)


@dataclass
class Destroying:
    """Sandboxes asked to be destroyed at once: those gone already, and those their hosts now destroy."""

    destroyed: list[str] = field(default_factory=list)  # queued: they never reached a host, nothing was billed
    stopping: dict[int, list[str]] = field(default_factory=dict)  # by host id, for the commands that destroy them

    @property
    def count(self) -> int:
        return len(self.destroyed) + sum(len(ids) for ids in self.stopping.values())

    def add(self, other: Destroying) -> None:
        self.destroyed += other.destroyed
        for host_id, ids in other.stopping.items():
            self.stopping.setdefault(host_id, []).extend(ids)


def sandboxes_destroy_requested(sandbox_ids: Sequence[str]) -> Destroying:
    """Destroy asked for many sandboxes at once (a kill by label, an expired lease): each as
    ``sandbox_destroy_requested`` moves one, in one transaction, the rows locked in key order."""
    outcome = Destroying()
    if not sandbox_ids:
        return outcome
    launches: set[str] = set()
    with transaction.atomic():
        now = timezone.now()
        for chunk in _chunks(sorted(set(sandbox_ids))):
            rows = Sandbox.objects.select_for_update().filter(pk__in=chunk, state__in=Sandbox.LIVE).order_by("pk")
            current = list(rows.values_list("pk", "state", "host_id", "launch_id"))
            queued = [pk for pk, state, _, _ in current if state == S.QUEUED]
            _move(
                Sandbox.objects.filter(pk__in=queued),
                SANDBOX_MOVES,
                S.DESTROYED,
                {S.QUEUED},
                ended_at=now,
                updated_at=now,
                env={},
            )
            _move(Sandbox.objects.filter(pk__in=chunk), SANDBOX_MOVES, S.STOPPING, updated_at=now)
            outcome.destroyed += queued
            launches.update(launch_id for pk, state, _, launch_id in current if state == S.QUEUED and launch_id)
            for pk, state, host_id, _ in current:
                if state != S.QUEUED and state != S.STOPPING:
                    outcome.stopping.setdefault(host_id, []).append(pk)
        _wake(outcome.destroyed)
        for launch in Launch.objects.filter(pk__in=sorted(launches)):
            launch_settled(launch)
    return outcome


# --- launches ----------------------------------------------------------------------------------


def launch_admits_members(launch: Launch) -> bool:
    """Call inside the transaction that inserts a chunk of the launch's sandboxes: True while it is still starting.

    The launch's row stays locked until that transaction ends, and a teardown
    locks it too: a chunk is either in before the teardown (which then ends
    its queued members) or never.
    """
    return Launch.objects.select_for_update().filter(pk=launch.pk, state=L.CREATING).exists()


def launch_teardown_requested(launch: Launch) -> dict[int, list[str]]:
    """Tear a launch down: creating or ready -> stopping; its queued members destroyed at once, its
    started ones stopping. The stopping members' ids by host, for the commands that destroy them."""
    now = timezone.now()
    members = Sandbox.objects.filter(launch=launch)
    with transaction.atomic():
        Launch.objects.select_for_update().filter(pk=launch.pk).first()  # the dispatcher's chunks wait for this to commit
        _move(Launch.objects.filter(pk=launch.pk), LAUNCH_MOVES, L.STOPPING)
        _move(members, SANDBOX_MOVES, S.DESTROYED, {S.QUEUED}, ended_at=now, updated_at=now, env={})
        _move(members, SANDBOX_MOVES, S.STOPPING, updated_at=now)
        stopping: dict[int, list[str]] = {}
        for sandbox_id, host_id in members.filter(state=S.STOPPING).order_by("launch_index").values_list("pk", "host_id"):
            stopping.setdefault(host_id, []).append(sandbox_id)
        launch_settled(launch)
    return stopping


def launch_settled(launch: Launch) -> str:
    """creating -> ready once every member is made and none is still on its way; ready or stopping ->
    stopped once none is alive (no member is added after a teardown). Its state now."""
    now = timezone.now()
    rows = Launch.objects.filter(pk=launch.pk)
    members = Sandbox.objects.filter(launch=launch)
    with transaction.atomic():
        state = rows.values_list("state", flat=True).first()
        if (
            state == L.CREATING
            and members.count() == launch.count
            and not members.filter(state__in=[S.QUEUED, S.CREATING]).exists()
        ):
            _move(rows, LAUNCH_MOVES, L.READY, {L.CREATING}, ready_at=now)
        if not members.filter(state__in=Sandbox.LIVE).exists():
            _move(rows, LAUNCH_MOVES, L.STOPPED, ended_at=now)
        return rows.values_list("state", flat=True).first() or ""


def launch_failed(launch: Launch) -> bool:
    """creating -> failed: no host can run it."""
    return bool(_move(Launch.objects.filter(pk=launch.pk), LAUNCH_MOVES, L.FAILED, ended_at=timezone.now()))


# --- snapshots ---------------------------------------------------------------------------------


def snapshot_ready(snapshot: Snapshot, host: Host, *, record: dict[str, Any]) -> bool:
    """creating -> ready, from the engine's record of it; its saved state billed per GiB-hour from now."""
    now = timezone.now()
    size_bytes = int(record.get("size_bytes") or 0)
    layers = record.get("layers") or [""]
    # What forks start: the engine's list, which adds those of the snapshot the sandbox came from.
    services = record.get("services") if isinstance(record.get("services"), list) else snapshot.services
    with transaction.atomic():
        moved = _move(
            Snapshot.objects.filter(pk=snapshot.pk),
            SNAPSHOT_MOVES,
            N.READY,
            layer_id=str(record.get("layer") or layers[0])[:80],
            services=services,
            size_bytes=size_bytes,
            total_bytes=int(record.get("total_bytes") or size_bytes),
            paused_ms=record.get("paused_ms"),
            ready_at=now,
            updated_at=now,
        )
        if moved:
            snapshot.refresh_from_db()
            snapshot.hosts.add(host)
            saved_state_transition(snapshot=snapshot, gib=gib_of(size_bytes), at=now)
    return bool(moved)


def snapshot_failed(snapshot: Snapshot, *, code: str, message: str) -> bool:
    """creating -> failed, with the error's code and message."""
    rows = Snapshot.objects.filter(pk=snapshot.pk)
    return bool(_move(rows, SNAPSHOT_MOVES, N.FAILED, error_code=code[:64], error=message[:255], updated_at=timezone.now()))


def snapshot_deleted(snapshot: Snapshot) -> bool:
    """-> deleted (the row stays: billed periods and old forks name it); its saved-state billing ends now."""
    now = timezone.now()
    with transaction.atomic():
        moved = _move(Snapshot.objects.filter(pk=snapshot.pk), SNAPSHOT_MOVES, N.DELETED, deleted_at=now, updated_at=now)
        if moved:
            saved_state_transition(snapshot=snapshot, gib=None, at=now)
    return bool(moved)


# --- leases ------------------------------------------------------------------------------------


def lease_renewed(lease: Lease) -> bool:
    """A heartbeat: an active lease's expiry moves ``grace_s`` past now. Not once it is over, nor once
    its grace has run out (whether or not ``leases_expired`` has seen it yet)."""
    now = timezone.now()
    rows = Lease.objects.filter(pk=lease.pk, state=E.ACTIVE, expires_at__gte=now)
    return bool(rows.update(heartbeat_at=now, expires_at=now + timedelta(seconds=lease.grace_s)))


def leases_expired(lease_ids: Sequence[str] | None = None) -> int:
    """active -> expired for the leases (these, or any) whose grace has run out, at the moment it did."""
    rows = Lease.objects.filter(expires_at__lt=timezone.now())
    if lease_ids is not None:
        rows = rows.filter(pk__in=list(lease_ids))
    return _move(rows, LEASE_MOVES, E.EXPIRED, ended_at=F("expires_at"))


def lease_ended(lease: Lease) -> bool:
    """active -> ended: its client ended it."""
    return bool(_move(Lease.objects.filter(pk=lease.pk), LEASE_MOVES, E.ENDED, ended_at=timezone.now()))


def over_leases_taken_down(*, lease: Lease | None = None, host: Host | None = None, limit: int = 5000) -> Destroying:
    """What is named with a lease that is over (expired or ended): its launches torn down (they make no
    more members), and its live sandboxes destroy-requested; of one lease, or of every lease but only
    on ``host`` (each host's agent takes its own). Safe to repeat: what is stopping already stays so."""
    outcome = Destroying()
    launches = Launch.objects.filter(lease__state__in=Lease.OVER, state__in=[L.CREATING, L.READY])
    members = Sandbox.objects.filter(lease__state__in=Lease.OVER, state__in=[S.QUEUED, S.CREATING, S.RUNNING, S.PAUSED])
    if lease is not None:
        launches, members = launches.filter(lease=lease), members.filter(lease=lease)
    if host is not None:
        members = members.filter(host=host)
    for launch in launches.order_by("pk")[:100]:
        stopping = launch_teardown_requested(launch)
        outcome.add(Destroying(stopping=stopping))
    outcome.add(sandboxes_destroy_requested(list(members.values_list("pk", flat=True)[:limit])))
    return outcome


# --- template builds ---------------------------------------------------------------------------


def template_build_failed(build: TemplateBuild, *, code: str, message: str, step: int | None = None, output: str = "") -> None:
    """The build ends failed (the failed step's output tail kept in ``error_output``); its template too if
    no earlier build of it is ready."""
    now = timezone.now()
    steps = list(build.steps)
    if step is not None and step < len(steps):
        steps[step] = {**steps[step], "state": "failed"}
    TemplateBuild.objects.filter(pk=build.pk).exclude(state=TemplateBuild.State.READY).update(
        state=TemplateBuild.State.FAILED,
        steps=steps,
        failed_step=step,
        error_code=code[:64],
        error=message[:500],
        error_output=output[-16384:],
        ended_at=now,
        updated_at=now,
    )
    Template.objects.filter(pk=build.template_id, snapshot__isnull=True).update(state=Template.State.FAILED, updated_at=now)


def template_build_ready(build: TemplateBuild, snapshot: Snapshot, description: str) -> None:
    """The build's last snapshot is its template now."""
    now = timezone.now()
    with transaction.atomic():
        Template.objects.filter(pk=build.template_id).update(
            state=Template.State.READY,
            snapshot=snapshot,
            size_bytes=snapshot.total_bytes,
            description=description,
            updated_at=now,
        )
        TemplateBuild.objects.filter(pk=build.pk).update(
            state=TemplateBuild.State.READY, snapshot=snapshot, ended_at=now, updated_at=now
        )
