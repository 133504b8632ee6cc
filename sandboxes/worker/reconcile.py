"""Make a host's rows and its engine agree, in both directions; run by the host agent every few seconds.

It calls the engine and the database directly, not through the broker, so
it keeps the record honest while the broker is down, and it covers what a
lost command would leave behind:

1. A started row whose engine sandbox is gone ends (``stopped`` or
   ``destroyed``) at the engine's own end time, and its billing closes then;
   a stopping one only once its teardown is taken for lost.
2. An engine sandbox that no live row names is looked up by its key (the
   row's id): a row still ``creating`` long after its worker last showed a
   sign of life lost that worker after the engine made it, and is adopted;
   otherwise the sandbox is nobody's and is destroyed.
3. Rows stuck ``queued``/``creating``/``stopping`` longer than
   ``FORKYARD_STUCK_AFTER_S`` have their command queued again (they are
   idempotent); rows this process is still creating are left alone, and so
   are queued members of a launch whose other members on this host moved
   meanwhile (their command waits its turn in the host's queue). A
   stopping row that never reached the engine ends, destroyed.
4. Billing, both ways: a running sandbox without an open period gets one
   from its ready time; an open period of an ended sandbox closes at its end.
5. Snapshots still ``creating`` long after their worker last touched them are queued again.
6. Leases whose heartbeats stopped expire, and what they held is destroyed
   (``leases``; first, since it needs no engine).

A pass reads ids, not rows, in a few queries whatever the fleet, and loads
whole only the rows whose engine sandbox is gone.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from billing.models import UsagePeriod
from billing.services import usage_transition
from sandboxes.engine import errors as engine_errors

from .. import commands, engine_link, transitions
from ..models import Host, Sandbox
from .bring_up import is_at_work, settle_launches
from .leases import expire_leases
from .snapshots import requeue_stuck_snapshots
from .template_builds import forget_ended_logs, requeue_stuck_builds

S = Sandbox.State


def _chunks(ids: list[str], size: int = 500) -> Iterator[list[str]]:
    """Ids a few hundred at a time, for IN lists: a whole launch may move at once,
    and SQLite takes at most 32,766 parameters in a statement."""
    for start in range(0, len(ids), size):
        yield ids[start : start + size]


def _stuck_before() -> datetime:
    return timezone.now() - timedelta(seconds=settings.FORKYARD_STUCK_AFTER_S)


def reconcile(host: Host) -> dict[str, int]:
    """Make this host's rows and its engine agree, in both directions; what it fixed, by kind."""
    lease_destroyed = expire_leases(host)  # first: it needs no engine, and should not wait for one
    client = engine_link.engine(host.engine_socket)
    live = {record["id"]: record for record in client.list()}
    counts = {"ended": 0, "adopted": 0, "orphans_destroyed": 0, "requeued": 0, "billing_fixed": 0, "lease_destroyed": 0}
    claimed = _end_the_gone(host, client, live, counts)
    _claim_the_unclaimed(
        host, client, {engine_id: record for engine_id, record in live.items() if engine_id not in claimed}, counts
    )
    keys = {str(record.get("key") or "") for record in live.values()}
    counts["requeued"] = _requeue_stuck(host, keys) + requeue_stuck_snapshots(host) + requeue_stuck_builds()
    counts["build_logs_cleared"] = forget_ended_logs()
    counts["billing_fixed"] = reconcile_billing(host)
    counts["lease_destroyed"] = lease_destroyed
    return counts


def _end_the_gone(host: Host, client: Any, live: dict[str, dict[str, Any]], counts: dict[str, int]) -> set[str]:
    """Step 1; returns the engine ids that a live row names."""
    started = [S.RUNNING, S.PAUSED, S.STOPPING]
    claimed: set[str] = set()
    gone: list[str] = []  # rows of started sandboxes that their engine no longer runs
    # A stopping row is its teardown's to record, once its engine has destroyed the sandbox: ended here
    # as well, a teardown's every member cost a lookup in the engine and a transaction of its own twice
    # over. One stopping for longer than that lost its teardown, and ends here (before step 3 queues it
    # again and makes it look fresh).
    recording = _stuck_before()
    rows = Sandbox.objects.filter(host=host, state__in=Sandbox.LIVE).exclude(engine_id="")
    for engine_id, pk, state, updated_at in rows.values_list("engine_id", "pk", "state", "updated_at"):
        claimed.add(engine_id)
        if state == S.STOPPING and updated_at >= recording:
            continue
        if state in started and live.get(engine_id, {}).get("state", "destroyed") in ("stopped", "destroyed"):
            gone.append(pk)
    ended: list[Sandbox] = []
    for sandbox in (row for ids in _chunks(gone) for row in Sandbox.objects.filter(pk__in=ids, state__in=started)):
        try:
            record = client.get(sandbox.engine_id)
        except engine_errors.EngineError:
            record = {}
        if record.get("state") in ("running", "paused", "creating"):
            continue  # it started after we listed the host
        died = record.get("state") == "stopped" and sandbox.state != S.STOPPING
        end = transitions.engine_time(record, "ended_at")
        reason = record.get("reason") or ""
        transitions.sandbox_ended(
            sandbox, S.STOPPED if died else S.DESTROYED, at=end, code=_end_reason(reason, died, sandbox.state), message=reason
        )
        if record.get("state") == "stopped":
            client.destroy(sandbox.engine_id)
        ended.append(sandbox)
        counts["ended"] += 1
    # Their launches settle: a launch whose last live member ends here (its TTL ran out, or its teardown
    # was lost) is stopped now; nothing else would look at it again.
    settle_launches(ended)
    return claimed


def _end_reason(reason: str, died: bool, state: str) -> str:
    """The code of why an engine ended a sandbox nobody asked to stop (``Sandbox.END_REASONS``); "" for a destroy
    that was asked for."""
    if died:
        return "exited"
    if state == S.STOPPING:
        return ""
    if reason.startswith("ttl expired"):
        return "ttl_expired"
    if reason.startswith("idle timeout"):
        return "idle_timeout"
    return ""


def _claim_the_unclaimed(host: Host, client: Any, unclaimed: dict[str, dict[str, Any]], counts: dict[str, int]) -> None:
    """Step 2: sandboxes the engine runs that no live row claims."""
    # Mid-launch most of them are creates whose worker has not written yet: their
    # rows are read in one query, not one each.
    keys = [record["key"] for record in unclaimed.values() if record.get("state") != "creating" and record.get("key")]
    rows_by_key: dict[str, Sandbox] = {}
    for some in _chunks(keys):
        rows_by_key.update(Sandbox.objects.filter(host=host).in_bulk(some))
    for engine_id, record in unclaimed.items():
        outcome = _claim_by_key(host, engine_id, record, rows_by_key.get(record.get("key") or ""))
        if outcome == "orphan":
            client.destroy(engine_id)
            counts["orphans_destroyed"] += 1
        elif outcome == "adopted":
            counts["adopted"] += 1


def _claim_by_key(host: Host, engine_id: str, record: dict[str, Any], row: Sandbox | None) -> str:
    """Whose is an engine sandbox no row names?  Its key is the row's id (``row``: the host's row of that id, if any).

    "kept": a row recorded it since we listed, or its create is still at work;
    "adopted": its create finished after the command that asked for it died,
    so we record it now rather than make it again; "orphan": nobody's (destroy it).
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
    if row.state in (S.QUEUED, S.CREATING):
        if is_at_work(row.pk) or row.updated_at >= _stuck_before():
            # Its command may still be at work (a fork's create returns only once its
            # services answer, and the engine lists it before): that worker records it.
            return "kept"
        transitions.sandboxes_claimed([row.pk], host)
        started = transitions.sandboxes_started([(row, record)])
        if started.running or started.recorded_before:
            return "adopted"
        return "orphan" if started.to_destroy else "kept"
    # Stopping, and never recorded: it is the one to stop.
    transitions.sandbox_engine_recorded(row, engine_id)
    return "orphan"


def _requeue_stuck(host: Host, keys: set[str]) -> int:
    """Step 3. Not rows this process is still creating: a big chunk on a busy host outlasts
    FORKYARD_STUCK_AFTER_S between heartbeats, and a second command for its rows would only race the first.

    A stuck stopping row with no engine sandbox, none at work and none the engine
    lists under its key (``keys``), was torn down before any create reached the
    engine: it ends, destroyed. Queued again, it would only wait for a create
    that never comes (``take_down`` leaves such a row to its create), each
    pass making it look fresh."""
    since = _stuck_before()
    candidates = [
        (sandbox_id, launch_id, state)
        for sandbox_id, launch_id, state in Sandbox.objects.filter(
            host=host, state__in=[S.QUEUED, S.CREATING], updated_at__lt=since
        ).values_list("pk", "launch_id", "state")[:5000]
        if not is_at_work(sandbox_id)
    ]
    # A queued member of a launch whose other members on this host moved since is waiting its turn: its
    # chunk's command sits in the host's queue behind the launch's earlier chunks (a host takes a launch
    # of thousands for minutes). Queued again, each pass sent hundreds of duplicate commands ahead of it.
    # One whose launch stands still here is stuck, as before.
    waiting = {launch_id for _, launch_id, state in candidates if launch_id and state == S.QUEUED}
    # (No waiting launch: Django answers the empty IN list without a query.)
    moving = set(
        Sandbox.objects.filter(host=host, launch_id__in=sorted(waiting), updated_at__gte=since)
        .exclude(state=S.QUEUED)
        .values_list("launch_id", flat=True)
        .distinct()
    )
    stuck = [sandbox_id for sandbox_id, launch_id, state in candidates if not (state == S.QUEUED and launch_id in moving)][:1000]
    if stuck:
        Sandbox.objects.filter(pk__in=stuck).update(updated_at=timezone.now())
        commands.ensure_running(host, stuck)
    stopping: list[str] = []
    unmade: list[Sandbox] = []
    for sandbox in Sandbox.objects.filter(host=host, state=S.STOPPING, updated_at__lt=_stuck_before()).only(
        "pk", "engine_id", "launch_id"
    )[:1000]:
        if sandbox.engine_id:
            stopping.append(sandbox.pk)
        elif not is_at_work(sandbox.pk) and sandbox.pk not in keys:
            unmade.append(sandbox)
    if unmade:
        transitions.sandboxes_destroyed([(sandbox, None) for sandbox in unmade])
        settle_launches(unmade)
    if stopping:
        Sandbox.objects.filter(pk__in=stopping).update(updated_at=timezone.now())
        commands.ensure_gone(host, stopping)
    return len(stuck) + len(stopping) + len(unmade)


def reconcile_billing(host: Host) -> int:
    """Step 4: open periods for running sandboxes lacking one; close those of ended ones (not of live ones).

    Single-table queries, compared here, never a join of sandboxes and periods: PostgreSQL plans a join
    from its statistics, which lag a table that grew by thousands in seconds (a launch), and with them it
    chose nested loops over both sides, a pass costing the square of the fleet (0.2 and 0.6 s for the two
    joins at 1,000 running, every few seconds). These read each side once, by index."""
    fixed = 0
    # Every host's live ids (by the (host, state) index), this host's running among them.
    hosts = list(Host.objects.values_list("pk", flat=True))
    live_rows = Sandbox.objects.filter(host_id__in=hosts, state__in=Sandbox.LIVE).values_list("pk", "host_id", "state")
    live = {pk: (host_id, state) for pk, host_id, state in live_rows}
    running = {pk for pk, (host_id, state) in live.items() if host_id == host.pk and state == S.RUNNING}
    # Every sandbox with an open period (the partial unique index holds exactly those), on any host.
    billed = set(UsagePeriod.objects.filter(ended_at__isnull=True, sandbox__isnull=False).values_list("sandbox_id", flat=True))
    for chunk in _chunks(sorted(running - billed)):
        for sandbox in Sandbox.objects.filter(pk__in=chunk, host=host, state=S.RUNNING):
            usage_transition(sandbox=sandbox, kind=UsagePeriod.Kind.RUNNING, at=sandbox.ready_at or sandbox.created_at)
            fixed += 1
    # Only those of sandboxes that ended: a stopping one still holds its host until its teardown ends it, and
    # that teardown closes its period at the engine's end time (many in one statement). Closing it here too
    # ended its billing early, one transaction a sandbox, in the middle of every big teardown.
    # Those still open of sandboxes live on any host are nobody's to close: left out before any row is read,
    # what remains is, as a rule, nothing.
    for chunk in _chunks(sorted(billed - live.keys())):
        for sandbox in Sandbox.objects.filter(pk__in=chunk, host=host, state__in=Sandbox.ENDED):
            usage_transition(sandbox=sandbox, kind=None, at=sandbox.ended_at or timezone.now())
            fixed += 1
    return fixed
