"""What a host's worker does with the commands on its queue.

Each command names the end state it wants ("ensure running", "ensure gone")
for a chunk of sandboxes, so a replay (a worker killed mid-task, the task
redelivered) does nothing twice: rows move with conditional updates, and the
engine's create is idempotent on the sandbox's id (sent as its key).
"""

from __future__ import annotations

import fcntl
import logging
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone

from billing.models import UsagePeriod
from billing.services import open_running_periods, usage_transition
from sandboxes.engine import errors as engine_errors

from . import notify, snapshots
from .engine_link import engine
from .models import Host, Launch, Sandbox, Snapshot

log = logging.getLogger("forkyard.lifecycle")
PARALLEL = 16
BATCH = 64  # sandboxes recorded running per transaction, at most
# A started sandbox waits at most this long for others to share its transaction.
# Each transaction costs the database a few queries and a commit: at 5 ms a
# launch of 1,000 wrote in ~1,000 of them (6.1 s on PostgreSQL), at 100 ms in
# ~150 (see docs/benchmarks.md); the board shows a pixel that much later at most.
BATCH_WAIT_S = 0.1


def _chunks(ids: list[str], size: int = 500) -> Iterator[list[str]]:
    """Ids a few hundred at a time, for IN lists: a whole launch may move at once,
    and SQLite takes at most 32,766 parameters in a statement."""
    for start in range(0, len(ids), size):
        yield ids[start : start + size]


def _stuck_before() -> datetime:
    return timezone.now() - timedelta(seconds=settings.FORKYARD_STUCK_AFTER_S)


def _when(epoch: float | None) -> datetime | None:
    return datetime.fromtimestamp(epoch, tz=UTC) if epoch else None


def _create_args(sandbox: Sandbox, sizes: dict[str, Any]) -> dict[str, Any]:
    args: dict[str, Any] = {
        # In the engine a snapshot is a template named by the snapshot's id.
        "template": sandbox.snapshot_id or sandbox.template,
        "ttl_s": sandbox.ttl_s,
        "env": sandbox.env,
        "labels": {key: value for key, value in sandbox.labels.items()},
        "key": sandbox.id,
    }
    engine_size = sizes.get(sandbox.size)
    if sandbox.size and engine_size and (engine_size["cpu"], engine_size["memory_mib"]) == (sandbox.cpu, sandbox.memory_mib):
        args["size"] = sandbox.size  # a size the engine knows: it may have a warm pool of it
    else:
        args["cpu"], args["memory_mib"] = sandbox.cpu, sandbox.memory_mib
    return args


_sizes: dict[str, tuple[float, dict[str, Any]]] = {}
SIZES_TTL_S = 30.0


def _engine_sizes(host: Host) -> dict[str, Any]:
    """The sizes a host's engine knows (an operator's edit shows within SIZES_TTL_S)."""
    cached = _sizes.get(host.engine_socket)
    if cached is None or time.monotonic() - cached[0] > SIZES_TTL_S:
        cached = _sizes[host.engine_socket] = (time.monotonic(), engine(host.engine_socket).info().get("sizes", {}))
    return cached[1]


def mark_running(sandbox: Sandbox, engine_record: dict[str, Any]) -> bool:
    """creating -> running, with its first billed second; False if it changed meanwhile."""
    ready_at = _when(engine_record.get("ready_at")) or timezone.now()
    with transaction.atomic():
        moved = Sandbox.objects.filter(pk=sandbox.pk, state=Sandbox.State.CREATING).update(
            state=Sandbox.State.RUNNING,
            engine_id=engine_record["id"],
            ready_at=ready_at,
            expires_at=_when(engine_record.get("expires_at")),
            updated_at=timezone.now(),
            env={},
        )
        if moved:
            sandbox.refresh_from_db()
            usage_transition(sandbox=sandbox, kind=UsagePeriod.Kind.RUNNING, at=ready_at)
    return bool(moved)


_sqlite_writer = threading.Lock()
_bringing_up: Counter[str] = Counter()  # row ids this process's bring_up calls are at
_bringing_up_lock = threading.Lock()


@contextmanager
def _at_work(sandbox_ids: Iterable[str]) -> Iterator[None]:
    ids = list(sandbox_ids)
    with _bringing_up_lock:
        _bringing_up.update(ids)
    try:
        yield
    finally:
        with _bringing_up_lock:
            _bringing_up.subtract(ids)
            for sandbox_id in ids:
                if _bringing_up[sandbox_id] <= 0:
                    del _bringing_up[sandbox_id]


# Creates this worker has in flight at once, whatever the number of chunks it
# runs: an engine makes a few hundred a second, and a deeper queue in front of
# it only makes each sandbox wait longer between ready and recorded.
CREATES_IN_FLIGHT = 32
_in_flight = threading.BoundedSemaphore(CREATES_IN_FLIGHT)


@contextmanager
def _one_writer() -> Iterator[None]:
    """On SQLite, this process's threads take turns for the write lock here, in
    order; left to SQLite's busy handler, which sleeps up to 100 ms between
    tries, a writer among several could wait seconds (and the board's pixels
    with it). Other databases lock rows, not the file: no turn-taking."""
    if connection.vendor != "sqlite":
        yield
        return
    with _sqlite_writer:
        yield


def mark_running_many(started: list[tuple[Sandbox, dict[str, Any]]]) -> set[str]:
    """creating -> running for many at once (one transaction, a few queries),
    with their first billed seconds; the ids that moved (the others changed meanwhile)."""
    with _one_writer(), transaction.atomic():
        # Stamped once this writer's turn has come: the board reads rows by
        # updated_at, and a stamp taken before a wait for the lock is older
        # than the commit by that wait.
        now = timezone.now()
        still_creating = set(
            Sandbox.objects.filter(pk__in=[sandbox.pk for sandbox, _ in started], state=Sandbox.State.CREATING).values_list(
                "pk", flat=True
            )
        )
        moving = []
        ready: dict[str, datetime] = {}
        for sandbox, record in started:
            if sandbox.pk not in still_creating:
                continue
            sandbox.state, sandbox.engine_id, sandbox.env = Sandbox.State.RUNNING, record["id"], {}
            sandbox.ready_at = ready[sandbox.pk] = _when(record.get("ready_at")) or now
            sandbox.expires_at, sandbox.updated_at = _when(record.get("expires_at")), now
            moving.append(sandbox)
        # Under the write transaction nothing moved them since the read above.
        Sandbox.objects.bulk_update(moving, ["state", "engine_id", "env", "ready_at", "expires_at", "updated_at"], batch_size=500)
        open_running_periods(moving, ready)
    return {sandbox.pk for sandbox in moving}


async def start_directly(sandbox: Sandbox) -> Sandbox:
    """The API's fast path for one create: the web server asks the host's engine
    itself (as it does for exec), skipping the broker and the worker's pickup.

    The engine's create is idempotent on the sandbox's id, and every outcome
    is recorded the way ``bring_up`` records it. If the engine cannot be
    reached, the command goes to the host's queue after all; if this process
    dies half way, the row stays ``creating`` and reconciliation queues it
    again (the engine then answers the replay with the same sandbox).
    """
    from console.db import db

    from .engine_link import async_pool
    from .services import enqueue_bring_up

    assert sandbox.host is not None
    host = sandbox.host
    try:
        sizes = await db(_engine_sizes)(host)
        async with async_pool(host.engine_socket).client() as client:
            record = await client.create(**_create_args(sandbox, sizes))
    except engine_errors.Unavailable:
        await db(enqueue_bring_up)(host, [sandbox.id])
        return sandbox
    except engine_errors.EngineError as error:
        await db(mark_ended)(sandbox, Sandbox.State.FAILED, code=error.code, message=error.message)
        return await db(Sandbox.objects.select_related("host").get)(pk=sandbox.pk)

    def record_outcome() -> Sandbox:
        if record["state"] != "running":
            mark_ended(sandbox, Sandbox.State.DESTROYED, at=_when(record.get("ended_at")))
        elif not mark_running_many([(sandbox, record)]):
            current = Sandbox.objects.get(pk=sandbox.pk)
            if not (current.state in (Sandbox.State.RUNNING, Sandbox.State.PAUSED) and current.engine_id == record["id"]):
                # Destroy was asked while we created it: honour it now.
                engine(host.engine_socket).destroy(record["id"])
                Sandbox.objects.filter(pk=sandbox.pk).update(engine_id=record["id"])
                mark_ended(sandbox, Sandbox.State.DESTROYED)
        return Sandbox.objects.select_related("host").get(pk=sandbox.pk)

    return await db(record_outcome)()


def mark_ended(sandbox: Sandbox, state: str, at: datetime | None = None, code: str = "", message: str = "") -> None:
    """Any state -> an end state, closing its billing at the moment it ended."""
    ended_at = at or timezone.now()
    with transaction.atomic():
        moved = Sandbox.objects.filter(pk=sandbox.pk, state__in=Sandbox.LIVE).update(
            state=state,
            ended_at=ended_at,
            updated_at=timezone.now(),
            env={},
            error_code=code[:64],
            error_message=message[:500],
        )
        if moved:
            usage_transition(sandbox=sandbox, kind=None, at=ended_at)


class SnapshotNotOnHost(engine_errors.EngineError):
    code = "snapshot_unavailable"
    status = 503


def ensure_snapshot_on_host(host: Host, snapshot: Snapshot) -> None:
    """Make sure this host's engine holds ``snapshot`` (a template named by its id) before forking it here.

    A no-op when the engine already has it.  Otherwise it is copied once from
    a host that holds it (``snapshot.hosts``): that engine's
    ``snapshots.export`` streams straight into this one's ``snapshots.import``,
    only the layers this host lacks, each checked against its content address
    on arrival.  Concurrent chunks of a launch on this host wait for the one
    copy (a lock file per snapshot).  No holder reachable: ``SnapshotNotOnHost``.
    Raises ``Unavailable`` if this host's engine does not answer.
    """
    local = engine(host.engine_socket)
    if _holds(local, snapshot):
        snapshot.hosts.add(host)
        return
    lock_path = Path(tempfile.gettempdir()) / f"forkyard-copy-{host.name}-{snapshot.id}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _holds(local, snapshot):  # another chunk copied it while we waited
            snapshot.hosts.add(host)
            return
        have = sorted({layer for template in local.call("templates.list")["templates"] for layer in template["layers"]})
        failures = []
        for source in snapshot.hosts.exclude(pk=host.pk).filter(
            last_heartbeat__gte=timezone.now() - timedelta(seconds=settings.FORKYARD_HOST_STALE_S)
        ):
            started = time.monotonic()
            try:
                _, chunks = engine(source.engine_socket).stream("snapshots.export", {"name": snapshot.id, "have": have})
                local.call("snapshots.import", body=chunks or [])
            except engine_errors.EngineError as error:
                failures.append(f"{source.name}: {error}")
                log.warning("copying snapshot %s from %s to %s failed: %s", snapshot.id, source.name, host.name, error)
                continue
            snapshot.hosts.add(host)
            log.info("copied snapshot %s from %s to %s in %.2fs", snapshot.id, source.name, host.name, time.monotonic() - started)
            return
    raise SnapshotNotOnHost(
        f"host {host.name} does not hold snapshot {snapshot.id}, and no host that does could send it"
        + (f" ({'; '.join(failures)})" if failures else ""),
        snapshot=snapshot.id,
        host=host.name,
    )


def _holds(client: Any, snapshot: Snapshot) -> bool:
    try:
        client.call("templates.get", name=snapshot.id)
    except engine_errors.TemplateNotFound:
        return False
    return True


def _snapshots_missing(host: Host, rows: list[Sandbox]) -> dict[str, engine_errors.EngineError]:
    """Ensure every snapshot these rows fork is on this host; the ones that cannot be, with why."""
    missing: dict[str, engine_errors.EngineError] = {}
    for snapshot in Snapshot.objects.filter(pk__in={row.snapshot_id for row in rows if row.snapshot_id}):
        try:
            ensure_snapshot_on_host(host, snapshot)
        except engine_errors.Unavailable:
            raise  # the whole chunk is retried
        except engine_errors.EngineError as error:
            missing[snapshot.id] = error
    return missing


def bring_up(host: Host, sandbox_ids: list[str]) -> dict[str, int]:
    """Ensure these sandboxes run on this host."""
    Sandbox.objects.filter(id__in=sandbox_ids, host=host, state=Sandbox.State.QUEUED).update(
        state=Sandbox.State.CREATING, updated_at=timezone.now()
    )
    rows = list(Sandbox.objects.filter(id__in=sandbox_ids, host=host, state__in=[Sandbox.State.CREATING, Sandbox.State.STOPPING]))
    sizes = _engine_sizes(host)
    missing = _snapshots_missing(host, rows)
    counts = {"running": 0, "failed": 0, "destroyed": 0}

    def create(sandbox: Sandbox) -> tuple[str, dict[str, Any]]:
        """The engine's part, in a pool thread: ("started", record) or an outcome already recorded."""
        client = engine(host.engine_socket)
        unavailable = missing.get(sandbox.snapshot_id or "")
        if unavailable is not None:
            mark_ended(sandbox, Sandbox.State.FAILED, code=unavailable.code, message=unavailable.message)
            return "failed", {}
        try:
            with _in_flight:
                record = client.create(**_create_args(sandbox, sizes))
        except engine_errors.Unavailable:
            raise  # the whole chunk is retried: creates are idempotent on the key
        except engine_errors.EngineError as error:
            mark_ended(sandbox, Sandbox.State.FAILED, code=error.code, message=error.message)
            return "failed", {}
        if record["state"] != "running":
            mark_ended(sandbox, Sandbox.State.DESTROYED, at=_when(record.get("ended_at")))
            return "destroyed", {}
        return "started", record

    def record_started(started: list[tuple[Sandbox, dict[str, Any]]]) -> None:
        moved = mark_running_many(started)
        notify.publish(list(moved))
        for sandbox, record in started:
            if sandbox.pk in moved:
                counts["running"] += 1
                continue
            current = Sandbox.objects.get(pk=sandbox.pk)
            if current.state in (Sandbox.State.RUNNING, Sandbox.State.PAUSED) and current.engine_id == record["id"]:
                counts["running"] += 1  # reconciliation recorded it first
                continue
            # Destroy was asked while we created it: honour it now.
            engine(host.engine_socket).destroy(record["id"])
            Sandbox.objects.filter(pk=sandbox.pk).update(engine_id=record["id"])
            mark_ended(sandbox, Sandbox.State.DESTROYED)
            counts["destroyed"] += 1

    # Engine creates run in parallel; their results are written in batches
    # (what finished in the last few milliseconds, up to BATCH), so a launch
    # costs a few transactions per hundred sandboxes, not several each.
    # Reconciliation takes a creating row whose engine sandbox runs but which no
    # worker recorded for FORKYARD_STUCK_AFTER_S as lost with its worker, and
    # adopts it. Rows of a big chunk wait longer than that on a busy host, so
    # this process tells its own reconciliation which rows it is still at
    # (_at_work), and other processes by a heartbeat on the waiting rows.
    heartbeat_s = settings.FORKYARD_STUCK_AFTER_S / 4
    last_beat = time.monotonic()
    with _at_work(row.pk for row in rows), ThreadPoolExecutor(min(PARALLEL, max(1, len(rows)))) as pool:
        pending = {pool.submit(create, row): row for row in rows}
        batch: list[tuple[Sandbox, dict[str, Any]]] = []
        batch_opened = 0.0
        while pending:
            if time.monotonic() - last_beat >= heartbeat_s:
                with _one_writer():
                    for waiting in _chunks([row.pk for row in pending.values()]):
                        Sandbox.objects.filter(pk__in=waiting, state=Sandbox.State.CREATING).update(updated_at=timezone.now())
                last_beat = time.monotonic()
            left = BATCH_WAIT_S - (time.monotonic() - batch_opened) if batch else heartbeat_s
            done, _ = wait(pending, timeout=max(0.0, left), return_when=FIRST_COMPLETED)
            for future in done:
                row = pending.pop(future)
                outcome, record = future.result()
                if outcome != "started":
                    counts[outcome] += 1
                    continue
                if not batch:
                    batch_opened = time.monotonic()
                batch.append((row, record))
            if batch and (len(batch) >= BATCH or not pending or time.monotonic() - batch_opened >= BATCH_WAIT_S):
                record_started(batch)
                batch = []
    notify.publish(sandbox_ids)
    _settle_launches({row.launch_id for row in rows if row.launch_id})
    return counts


def take_down(host: Host, sandbox_ids: list[str]) -> int:
    """Ensure these sandboxes are gone from this host."""
    rows = list(
        Sandbox.objects.filter(id__in=sandbox_ids, host=host).exclude(state__in=[Sandbox.State.DESTROYED, Sandbox.State.FAILED])
    )

    def one(sandbox: Sandbox) -> int:
        if not sandbox.engine_id:
            if sandbox.state == Sandbox.State.STOPPING and sandbox.updated_at < _stuck_before():
                mark_ended(sandbox, Sandbox.State.DESTROYED)  # it never reached the engine
            return 0
        try:
            record = engine(host.engine_socket).destroy(sandbox.engine_id)
        except engine_errors.SandboxNotFound:
            record = {}
        mark_ended(sandbox, Sandbox.State.DESTROYED, at=_when(record.get("ended_at")))
        return 1

    with ThreadPoolExecutor(min(PARALLEL, max(1, len(rows)))) as pool:
        done = sum(pool.map(one, rows))
    notify.publish(sandbox_ids)
    _settle_launches({row.launch_id for row in rows if row.launch_id})
    return done


def _settle_launches(launch_ids: set[str]) -> None:
    for launch_id in launch_ids:
        launch_settle(launch_id)


def launch_settle(launch_id: str) -> None:
    """A launch is ready once none of its sandboxes is still on its way, stopped once all ended."""
    launch = Launch.objects.filter(pk=launch_id).first()
    if launch is None:
        return
    pending = Sandbox.objects.filter(launch=launch, state__in=[Sandbox.State.QUEUED, Sandbox.State.CREATING])
    made = Sandbox.objects.filter(launch=launch).count()
    now = timezone.now()
    if launch.state == Launch.State.CREATING and made == launch.count and not pending.exists():
        Launch.objects.filter(pk=launch.pk, state=Launch.State.CREATING).update(state=Launch.State.READY, ready_at=now)
    if launch.state in (Launch.State.STOPPING, Launch.State.READY, Launch.State.CREATING):
        if made == launch.count and not Sandbox.objects.filter(launch=launch, state__in=Sandbox.LIVE).exists():
            Launch.objects.filter(pk=launch.pk).exclude(state=Launch.State.STOPPED).update(
                state=Launch.State.STOPPED, ended_at=now
            )


def dispatch(launch_id: str, env: dict[str, str], enqueue: Callable[[Host, list[str]], None]) -> int:
    """Make a launch's sandboxes, in chunks spread over hosts with room."""
    from .services import hosts_for

    launch = Launch.objects.select_related("team", "snapshot").get(pk=launch_id)
    if launch.state != Launch.State.CREATING:
        return 0
    existing = set(Sandbox.objects.filter(launch=launch).values_list("launch_index", flat=True))
    missing = [index for index in range(launch.count) if index not in existing]
    # Every host that can run it, forks included: a launch spreads over hosts
    # for speed, and a host without the snapshot gets it copied once.
    tiers = hosts_for(team=launch.team, template=launch.template, snapshot=launch.snapshot)
    capable = [host for tier in tiers for host in tier]
    hosts = sorted(capable, key=lambda host: host.engine_sandboxes - host.max_sandboxes)
    if not hosts:
        Launch.objects.filter(pk=launch.pk).update(state=Launch.State.FAILED, ended_at=timezone.now())
        return 0
    room = {host.id: max(0, host.max_sandboxes - host.engine_sandboxes) for host in hosts}
    chunk = settings.FORKYARD_LAUNCH_CHUNK
    made = 0
    for start in range(0, len(missing), chunk):
        indexes = missing[start : start + chunk]
        host = max(hosts, key=lambda candidate: room[candidate.id])
        room[host.id] -= len(indexes)
        rows = [
            Sandbox(
                team_id=launch.team_id,
                api_key_id=launch.api_key_id,
                host=host,
                launch=launch,
                launch_index=index,
                template=launch.template,
                snapshot_id=launch.snapshot_id,
                size=launch.size,
                cpu=launch.cpu,
                memory_mib=launch.memory_mib,
                ttl_s=launch.ttl_s,
                network_policy_id=launch.network_policy_id,
                env=env,
                labels={**launch.labels, "launch": launch.id},
            )
            for index in indexes
        ]
        with _one_writer(), transaction.atomic():
            Sandbox.objects.bulk_create(rows, ignore_conflicts=True)
        ids = list(
            Sandbox.objects.filter(launch=launch, launch_index__in=indexes, state=Sandbox.State.QUEUED).values_list(
                "id", flat=True
            )
        )
        enqueue(host, ids)
        made += len(ids)
    return made


def reconcile(host: Host) -> dict[str, int]:
    """Make this host's rows and its engine agree, in both directions."""
    client = engine(host.engine_socket)
    live = {record["id"]: record for record in client.list()}
    counts = {"ended": 0, "adopted": 0, "orphans_destroyed": 0, "requeued": 0, "billing_fixed": 0}
    # Read ids, not rows: a pass runs every few seconds over every live sandbox of
    # the host; only those whose engine sandbox is gone are loaded whole.
    started = [Sandbox.State.RUNNING, Sandbox.State.PAUSED, Sandbox.State.STOPPING]
    claimed: set[str] = set()  # engine ids that a live row names
    gone: list[str] = []  # rows of started sandboxes that their engine no longer runs
    rows = Sandbox.objects.filter(host=host, state__in=Sandbox.LIVE).exclude(engine_id="")
    for engine_id, pk, state in rows.values_list("engine_id", "pk", "state"):
        claimed.add(engine_id)
        if state in started and live.get(engine_id, {}).get("state", "destroyed") in ("stopped", "destroyed"):
            gone.append(pk)
    for sandbox in (row for ids in _chunks(gone) for row in Sandbox.objects.filter(pk__in=ids, state__in=started)):
        try:
            record = client.get(sandbox.engine_id)
        except engine_errors.EngineError:
            record = {}
        if record.get("state") in ("running", "paused", "creating"):
            continue  # it started after we listed the host
        state = Sandbox.State.STOPPED if record.get("state") == "stopped" else Sandbox.State.DESTROYED
        if sandbox.state == Sandbox.State.STOPPING:
            state = Sandbox.State.DESTROYED
        mark_ended(sandbox, state, at=_when(record.get("ended_at")), message=record.get("reason") or "")
        if record.get("state") == "stopped":
            client.destroy(sandbox.engine_id)
        counts["ended"] += 1
    # The other direction: sandboxes the engine runs that no live row claims.
    unclaimed = {engine_id: record for engine_id, record in live.items() if engine_id not in claimed}
    # Mid-launch most of them are creates whose worker has not written yet: their
    # rows are read in one query, not one each.
    keys = [record["key"] for record in unclaimed.values() if record.get("state") != "creating" and record.get("key")]
    rows_by_key: dict[str, Sandbox] = {}
    for some in _chunks(keys):
        rows_by_key.update(Sandbox.objects.filter(host=host).in_bulk(some))
    for engine_id, record in unclaimed.items():
        outcome = _claim_by_key(engine_id, record, rows_by_key.get(record.get("key") or ""))
        if outcome == "orphan":
            client.destroy(engine_id)
            counts["orphans_destroyed"] += 1
        elif outcome == "adopted":
            counts["adopted"] += 1
    # Commands lost with a worker or broker: queue them again (they are idempotent).
    from .services import enqueue_bring_up, enqueue_take_down

    # Not those this process is still creating: a big chunk on a busy host outlasts
    # FORKYARD_STUCK_AFTER_S between heartbeats, and a second command for its rows
    # would only race the first.
    stuck = [
        sandbox_id
        for sandbox_id in Sandbox.objects.filter(
            host=host, state__in=[Sandbox.State.QUEUED, Sandbox.State.CREATING], updated_at__lt=_stuck_before()
        ).values_list("id", flat=True)[:5000]
        if sandbox_id not in _bringing_up
    ][:1000]
    if stuck:
        Sandbox.objects.filter(id__in=stuck).update(updated_at=timezone.now())
        enqueue_bring_up(host, stuck)
        counts["requeued"] = len(stuck)
    stopping = list(
        Sandbox.objects.filter(host=host, state=Sandbox.State.STOPPING, updated_at__lt=_stuck_before()).values_list(
            "id", flat=True
        )[:1000]
    )
    if stopping:
        Sandbox.objects.filter(id__in=stopping).update(updated_at=timezone.now())
        enqueue_take_down(host, stopping)
        counts["requeued"] += len(stopping)
    counts["billing_fixed"] = reconcile_billing(host)
    counts["requeued"] += snapshots.requeue_stuck(host)
    return counts


def _claim_by_key(engine_id: str, record: dict[str, Any], row: Sandbox | None) -> str:
    """Whose is an engine sandbox no row names?  Its key is the row's id
    (``row``: the host's row of that id, if there is one).

    "kept": a row recorded it since we listed; "adopted": its create finished
    after the command that asked for it died, so we record it now rather than
    make it again; "orphan": nobody's (destroy it).
    """
    if record.get("state") == "creating":
        # Its create is still running in the engine (a fork waits for its snapshot's
        # services to answer): whoever asked records it, or the next pass judges it.
        return "kept"
    if row is None or row.state not in Sandbox.LIVE:
        return "orphan"
    if row.engine_id == engine_id:
        return "kept"
    if row.engine_id:
        return "orphan"  # a second sandbox for one row: the recorded one stands
    if row.state in (Sandbox.State.QUEUED, Sandbox.State.CREATING):
        if row.pk in _bringing_up or row.updated_at >= _stuck_before():
            # Its command may still be at work (a fork's create returns only once its
            # services answer, and the engine lists it before): that worker records it.
            return "kept"
        Sandbox.objects.filter(pk=row.pk, state=Sandbox.State.QUEUED).update(state=Sandbox.State.CREATING)
        return (
            "adopted" if mark_running(row, record) or Sandbox.objects.filter(pk=row.pk, engine_id=engine_id).exists() else "kept"
        )
    # Stopping, and never recorded: it is the one to stop.
    Sandbox.objects.filter(pk=row.pk).update(engine_id=engine_id)
    return "orphan"


def reconcile_billing(host: Host) -> int:
    """Open periods for running sandboxes lacking one; close those of ended ones."""
    fixed = 0
    open_period = UsagePeriod.objects.filter(sandbox=OuterRef("pk"), ended_at__isnull=True)
    for sandbox in Sandbox.objects.filter(host=host, state=Sandbox.State.RUNNING).exclude(Exists(open_period)):
        usage_transition(sandbox=sandbox, kind=UsagePeriod.Kind.RUNNING, at=sandbox.ready_at or sandbox.created_at)
        fixed += 1
    for period in (
        UsagePeriod.objects.filter(sandbox__host=host, ended_at__isnull=True)
        .exclude(sandbox__state__in=[Sandbox.State.RUNNING, Sandbox.State.PAUSED])
        .select_related("sandbox")
    ):
        assert period.sandbox is not None
        usage_transition(sandbox=period.sandbox, kind=None, at=period.sandbox.ended_at or timezone.now())
        fixed += 1
    return fixed


def host_heartbeat(name: str, socket_path: str) -> Host:
    """Register this host (first time) and record its engine's capacity."""
    from .models import Template

    info = engine(socket_path).info()
    now = timezone.now()
    reported = {
        "queue": f"host.{name}",
        "engine_socket": settings.FORKYARD_ENGINE_ADDRESS,  # how everyone else reaches it
        "region": settings.FORKYARD_REGION,
        "cpus": info["cpus"],
        "memory_mib": info["memory_mib"],
        "max_sandboxes": info["max_sandboxes"],
        "engine_sandboxes": info["sandboxes"] + info.get("pooled", 0),
        "committed_memory_mib": info["committed_memory_mib"],
        "engine_version": info["version"],
        "last_heartbeat": now,
    }
    # Only what the host reports: a save of the whole row would put back a
    # state an operator changed meanwhile (draining, say).
    if not Host.objects.filter(name=name).update(**reported):
        Host.objects.get_or_create(name=name, defaults=reported)
    host = Host.objects.get(name=name)
    held = []
    for template in engine(socket_path).call("templates.list")["templates"]:
        if template.get("kind") == "snapshot":
            held.append(template["name"])  # a team's snapshot, not a public template
            continue
        row, _ = Template.objects.update_or_create(
            name=template["name"], team=None, defaults={"size_bytes": template["size_bytes"], "layers": template["layers"]}
        )
        row.hosts.add(host)
    snapshots.sync_host(host, held)
    return host
