"""Writes about sandboxes, from the API's side: validate, place, record, queue.

Every mutation is one function, keyword-only, in one transaction, and queues
its Celery command only once that transaction commits.  What a host's worker
does with the command lives in ``lifecycle.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from billing.models import Price, UsagePeriod
from billing.services import usage_transition
from console.errors import ApiError, from_engine, unavailable
from console.models import ApiKey, Team, TeamLimits
from sandboxes.engine.errors import EngineError

from .models import Host, Launch, NetworkPolicy, Sandbox, Snapshot, Template
from .snapshots import lock_ready

ENGINE_SIZES = {"tiny": (1.0, 128), "default": (2.0, 4096)}
log = logging.getLogger("forkyard.sandboxes")


@dataclass
class CreateSpec:
    template: str | None = None
    snapshot: str | None = None
    size: str | None = None
    cpu: float | None = None
    memory_mib: int | None = None
    ttl_s: int = 3600
    network_policy: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    idempotency_key: str | None = None


@dataclass(frozen=True)
class Resolved:
    template: str
    snapshot: Snapshot | None
    size: str
    cpu: float
    memory_mib: int
    network_policy: NetworkPolicy | None


def limits_of(team: Team) -> TeamLimits:
    try:
        return team.limits
    except TeamLimits.DoesNotExist:
        return TeamLimits.objects.create(team=team)


def sizes() -> dict[str, tuple[float, int]]:
    """The sizes on the rate card (data an operator edits), with their shape."""
    catalog = dict(ENGINE_SIZES)
    for size, cpu, memory_mib in Price.objects.filter(kind=Price.Kind.RUNNING).values_list("size", "cpu", "memory_mib"):
        if cpu and memory_mib:
            catalog[size] = (float(cpu), int(memory_mib))
    return catalog


def resolve(*, team: Team, spec: CreateSpec) -> Resolved:
    """Check a create (or launch) against the catalog and the team's objects."""
    if bool(spec.template) == bool(spec.snapshot):
        raise ApiError("invalid_request", "give exactly one of template or snapshot", field="template")
    snapshot = None
    template = spec.template or ""
    if spec.snapshot:
        snapshot = Snapshot.objects.filter(team=team, id=spec.snapshot, state=Snapshot.State.READY).first()
        if snapshot is None:
            raise ApiError("snapshot_not_found", f"no ready snapshot {spec.snapshot!r}", status=404, field="snapshot")
        template = snapshot.template
    elif not Template.objects.filter(Q(team__isnull=True) | Q(team=team), name=template).exists():
        raise ApiError("template_not_found", f"no template {template!r}", status=404, field="template")
    explicit = spec.cpu is not None or spec.memory_mib is not None
    if explicit and spec.size:
        raise ApiError("invalid_size", "give either size or cpu and memory_mib, not both", field="size")
    if explicit:
        if spec.cpu is None or spec.memory_mib is None:
            raise ApiError("invalid_size", "cpu and memory_mib go together", field="cpu" if spec.cpu is None else "memory_mib")
        size, cpu, memory_mib = "", float(spec.cpu), int(spec.memory_mib)
    else:
        size = spec.size or "default"
        catalog = sizes()
        if size not in catalog:
            raise ApiError(
                "invalid_size", f"unknown size {size!r}: one of {', '.join(sorted(catalog))}, or cpu and memory_mib", field="size"
            )
        cpu, memory_mib = catalog[size]
    limits = limits_of(team)
    if spec.ttl_s > limits.max_ttl_s:
        raise ApiError("invalid_request", f"ttl_s is over the team's maximum of {limits.max_ttl_s}", field="ttl_s")
    policy = None
    if spec.network_policy:
        policy = NetworkPolicy.objects.filter(team=team, id=spec.network_policy).first()
        if policy is None:
            raise ApiError(
                "network_policy_not_found", f"no network policy {spec.network_policy!r}", status=404, field="network_policy"
            )
    return Resolved(template=template, snapshot=snapshot, size=size, cpu=cpu, memory_mib=memory_mib, network_policy=policy)


def live_hosts() -> list[Host]:
    fresh = timezone.now() - timedelta(seconds=settings.FORKYARD_HOST_STALE_S)
    return list(Host.objects.filter(state=Host.State.ONLINE, last_heartbeat__gte=fresh))


def hosts_for(*, team: Team, template: str, snapshot: Snapshot | None = None) -> list[list[Host]]:
    """The live hosts that can run it, in tiers of preference.

    A template runs only on the hosts that hold it (those whose engines
    reported it; any live host if none has yet). A fork runs anywhere, but a
    host without its snapshot first gets it copied (seconds for a big one), so
    the hosts holding it come first.
    """
    hosts = live_hosts()
    if snapshot is not None:
        with_snapshot = set(snapshot.hosts.values_list("pk", flat=True))
        return [[host for host in hosts if host.pk in with_snapshot], [host for host in hosts if host.pk not in with_snapshot]]
    templates = Template.objects.filter(Q(team__isnull=True) | Q(team=team), name=template)
    holding = set(templates.exclude(hosts=None).values_list("hosts", flat=True))
    return [[host for host in hosts if host.pk in holding] if holding else hosts]


def choose_host(*, tiers: list[list[Host]], count: int = 1) -> Host:
    """The host with the most room (by sandbox count) in the first tier that has room."""
    if not any(tiers):
        raise unavailable("no host is online to run sandboxes", code="no_capacity")
    for hosts in tiers:
        best, room = None, 0
        for host in hosts:
            pending = Sandbox.objects.filter(host=host, state__in=[Sandbox.State.QUEUED, Sandbox.State.CREATING]).count()
            free = host.max_sandboxes - host.engine_sandboxes - pending
            if free >= count and free > room:
                best, room = host, free
        if best is not None:
            return best
    raise unavailable("every host is full; try again shortly", code="no_capacity", retry_after_s=10)


def _check_quota(team: Team, adding: int) -> None:
    limits = limits_of(team)
    live = Sandbox.objects.filter(team=team, state__in=Sandbox.LIVE).count()
    if live + adding > limits.max_sandboxes:
        raise ApiError(
            "sandbox_quota_exceeded",
            f"the team may run {limits.max_sandboxes} sandboxes at once and has {live}",
            status=429,
            retry_after_s=5,
            details={"limit": limits.max_sandboxes, "running": live},
        )


def enqueue_bring_up(host: Host, sandbox_ids: list[str]) -> None:
    from .tasks import ensure_running

    ensure_running.apply_async(args=(host.name, sandbox_ids), queue=host.queue, expires=600)


def enqueue_take_down(host: Host, sandbox_ids: list[str]) -> None:
    from .tasks import ensure_gone

    ensure_gone.apply_async(args=(host.name, sandbox_ids), queue=host.queue, expires=3600)


def sandbox_create(*, team: Team, key: ApiKey | None, spec: CreateSpec, direct: bool = False) -> tuple[Sandbox, bool]:
    """Record a sandbox and queue it on a host; (sandbox, created).

    ``key`` is the API key that asked (None: a signed-in member, from the
    console). A repeated ``idempotency_key`` returns the first sandbox and
    creates nothing: the unique constraint decides, not a check here.

    ``direct``: the caller will ask the host's engine itself (the API's fast
    path, ``lifecycle.start_directly``), so the row is recorded ``creating``
    and nothing is queued, when the host can take it at once (it holds the
    template or snapshot). Otherwise, or if the caller then fails, the host's
    queue does it, as for everything else.
    """
    if spec.idempotency_key:
        existing = Sandbox.objects.select_related("host").filter(team=team, idempotency_key=spec.idempotency_key).first()
        if existing is not None:
            return existing, False
    resolved = resolve(team=team, spec=spec)
    _check_quota(team, 1)
    host = choose_host(tiers=hosts_for(team=team, template=resolved.template, snapshot=resolved.snapshot))
    try:
        with transaction.atomic():
            lock_ready(resolved.snapshot)
            sandbox = Sandbox.objects.create(
                team=team,
                api_key=key,
                host=host,
                template=resolved.template,
                snapshot=resolved.snapshot,
                size=resolved.size,
                cpu=resolved.cpu,
                memory_mib=resolved.memory_mib,
                ttl_s=spec.ttl_s,
                network_policy=resolved.network_policy,
                env=spec.env,
                labels=spec.labels,
                idempotency_key=spec.idempotency_key or None,
            )
    except IntegrityError:
        existing = Sandbox.objects.select_related("host").filter(team=team, idempotency_key=spec.idempotency_key).first()
        if existing is None:
            raise
        return existing, False
    if direct and (resolved.snapshot is None or resolved.snapshot.hosts.filter(pk=host.pk).exists()):
        # Claimed for the caller: "creating", so no reconciliation queues it
        # meanwhile (a row stuck there is queued again after STUCK_AFTER_S).
        if Sandbox.objects.filter(pk=sandbox.pk, state=Sandbox.State.QUEUED).update(state=Sandbox.State.CREATING):
            sandbox.state = Sandbox.State.CREATING
            return sandbox, True
    _queue_or_fail(sandbox, lambda: enqueue_bring_up(host, [sandbox.id]))
    return sandbox, True


def _queue_or_fail(sandbox: Sandbox, enqueue: Callable[[], None]) -> None:
    """Queue the command (after commit); if the broker refuses, the sandbox
    fails now rather than start later behind the caller's back."""
    try:
        enqueue()
    except Exception as error:
        # Whatever the broker raised (its own errors, or an OSError from the
        # embedded one's directory), the command is not queued.
        log.warning("could not queue a command for %s: %r", sandbox.id, error)
        now = timezone.now()
        Sandbox.objects.filter(pk=sandbox.pk, state=Sandbox.State.QUEUED).update(
            state=Sandbox.State.FAILED,
            ended_at=now,
            updated_at=now,
            env={},
            error_code="broker_unavailable",
            error_message="the command could not be queued",
        )
        raise unavailable("the task broker is unavailable; try again shortly", code="broker_unavailable") from error


def sandbox_record_pause(*, sandbox_id: str, state: str) -> Sandbox:
    """After the engine paused (``state`` paused) or resumed (running) a sandbox: its row and its billing follow."""
    now = timezone.now()
    sandbox = Sandbox.objects.get(pk=sandbox_id)
    moved = (
        Sandbox.objects.filter(pk=sandbox_id, state__in=[Sandbox.State.RUNNING, Sandbox.State.PAUSED])
        .exclude(state=state)
        .update(state=state, updated_at=now)
    )
    if moved:
        kind = UsagePeriod.Kind.PAUSED if state == Sandbox.State.PAUSED else UsagePeriod.Kind.RUNNING
        usage_transition(sandbox=sandbox, kind=kind, at=now)
    return Sandbox.objects.select_related("host").get(pk=sandbox_id)


def sandbox_pause(*, sandbox: Sandbox, paused: bool) -> Sandbox:
    """Pause (or resume) a sandbox from a worker thread or a view: the engine, then the row.

    The API does the same with its async engine pool (the interactive path).
    """
    if sandbox.state not in (Sandbox.State.RUNNING, Sandbox.State.PAUSED) or not sandbox.engine_id or sandbox.host is None:
        raise ApiError(
            "sandbox_not_running", f"sandbox {sandbox.id} is {sandbox.state}", status=409, details={"state": sandbox.state}
        )
    from .engine_link import engine

    try:
        engine(sandbox.host.engine_socket).call("pause" if paused else "resume", id=sandbox.engine_id)
    except EngineError as error:
        raise from_engine(error) from None
    return sandbox_record_pause(sandbox_id=sandbox.id, state=Sandbox.State.PAUSED if paused else Sandbox.State.RUNNING)


def sandbox_destroy(*, sandbox: Sandbox) -> Sandbox:
    """Ask for a sandbox to be gone; idempotent."""
    _request_destroy(sandbox)
    return Sandbox.objects.select_related("host").get(pk=sandbox.pk)


def _request_destroy(sandbox: Sandbox) -> None:
    with transaction.atomic():
        locked = Sandbox.objects.select_for_update().get(pk=sandbox.pk)
        if locked.state in (Sandbox.State.DESTROYED, Sandbox.State.FAILED):
            return
        now = timezone.now()
        if locked.state == Sandbox.State.QUEUED:
            # Never reached its host: nothing to stop, nothing was billed.
            locked.state, locked.ended_at, locked.updated_at, locked.env = Sandbox.State.DESTROYED, now, now, {}
            locked.save(update_fields=["state", "ended_at", "updated_at", "env"])
            return
        if locked.state != Sandbox.State.STOPPING:
            locked.state, locked.updated_at = Sandbox.State.STOPPING, now
            locked.save(update_fields=["state", "updated_at"])
        host = locked.host
        assert host is not None
        transaction.on_commit(lambda: enqueue_take_down(host, [locked.id]))


def launch_create(*, team: Team, key: ApiKey | None, spec: CreateSpec, count: int) -> tuple[Launch, bool]:
    """Record a launch; its sandboxes are made and queued in chunks by the dispatcher."""
    limits = limits_of(team)
    if count < 1:
        raise ApiError("invalid_request", "count must be at least 1", field="count")
    if count > limits.max_launch_count:
        raise ApiError(
            "launch_too_large",
            f"count is over the team's maximum of {limits.max_launch_count} per launch",
            field="count",
            details={"limit": limits.max_launch_count},
        )
    if spec.idempotency_key:
        existing = Launch.objects.filter(team=team, idempotency_key=spec.idempotency_key).first()
        if existing is not None:
            return existing, False
    resolved = resolve(team=team, spec=spec)
    _check_quota(team, count)
    if not live_hosts():
        raise unavailable("no host is online to run sandboxes", code="no_capacity")
    try:
        with transaction.atomic():
            lock_ready(resolved.snapshot)
            launch = Launch.objects.create(
                team=team,
                api_key=key,
                template=resolved.template,
                snapshot=resolved.snapshot,
                size=resolved.size,
                cpu=resolved.cpu,
                memory_mib=resolved.memory_mib,
                ttl_s=spec.ttl_s,
                count=count,
                labels=spec.labels,
                network_policy=resolved.network_policy,
                idempotency_key=spec.idempotency_key or None,
            )
            env = dict(spec.env)
            transaction.on_commit(lambda: _enqueue_dispatch(launch.id, env))
    except IntegrityError:
        existing = Launch.objects.filter(team=team, idempotency_key=spec.idempotency_key).first()
        if existing is None:
            raise
        return existing, False
    return launch, True


def _enqueue_dispatch(launch_id: str, env: dict[str, str]) -> None:
    from .tasks import dispatch_launch

    dispatch_launch.apply_async(args=(launch_id, env), queue=settings.CELERY_TASK_DEFAULT_QUEUE)


def launch_destroy(*, launch: Launch) -> Launch:
    """Tear a launch down: every sandbox in it, whatever its state."""
    with transaction.atomic():
        Launch.objects.filter(pk=launch.pk).exclude(state=Launch.State.STOPPED).update(state=Launch.State.STOPPING)
        now = timezone.now()
        Sandbox.objects.filter(launch=launch, state=Sandbox.State.QUEUED).update(
            state=Sandbox.State.DESTROYED, ended_at=now, updated_at=now, env={}
        )
        by_host: dict[int, list[str]] = {}
        for sandbox_id, host_id in Sandbox.objects.filter(
            launch=launch, state__in=[Sandbox.State.CREATING, Sandbox.State.RUNNING, Sandbox.State.PAUSED, Sandbox.State.STOPPING]
        ).values_list("id", "host_id"):
            by_host.setdefault(host_id, []).append(sandbox_id)
        Sandbox.objects.filter(
            launch=launch, state__in=[Sandbox.State.CREATING, Sandbox.State.RUNNING, Sandbox.State.PAUSED]
        ).update(state=Sandbox.State.STOPPING, updated_at=now)
        hosts = {host.id: host for host in Host.objects.filter(id__in=by_host)}
        chunk = settings.FORKYARD_LAUNCH_CHUNK

        def enqueue() -> None:
            for host_id, ids in by_host.items():
                for start in range(0, len(ids), chunk):
                    enqueue_take_down(hosts[host_id], ids[start : start + chunk])

        transaction.on_commit(enqueue)
    launch.refresh_from_db()
    return launch
