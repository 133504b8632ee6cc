"""Reads about sandboxes, launches, snapshots, templates and network policies, always within a team.

Lookups raise ``NotFound`` for an object of another team exactly as for one
that does not exist.  Lists page the one way (``console.pagination``), counts
are one ``GROUP BY``, and per-row figures are annotations: a team may hold
32,752 sandboxes, and nothing here loads more rows than a page shows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar, cast

from django.db.models import Count, IntegerField, Max, Model, OuterRef, Q, QuerySet, Subquery, TextField
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast, Coalesce, TruncSecond
from django.utils import timezone

from console.errors import Conflict, InvalidRequest, NotFound, invalid, not_found
from console.models import Team
from console.pagination import Page, keyset_page
from console.selectors import limits_of

from .models import ExposedPort, Launch, Lease, NetworkPolicy, Sandbox, Snapshot, Template, TemplateBuild

Labelled = TypeVar("Labelled", bound=Model)  # a model with a ``labels`` JSON field
LAUNCH_ORDER = ("launch_index",)
READY_ORDER = ("ready_at", "id")
# The most sandboxes one batch (a command in many) may name, unless the team may launch more at once.
MAX_BATCH = 10_000

# --- one object --------------------------------------------------------------------------------


def sandbox_for(team: Team, sandbox_id: str) -> Sandbox:
    sandbox = (
        Sandbox.objects.select_related("host", "launch", "network_policy", "api_key", "snapshot")
        .filter(team=team, pk=sandbox_id)
        .first()
    )
    if sandbox is None:
        raise not_found("sandbox", sandbox_id)
    return sandbox


def started_sandbox_for(team: Team | str, sandbox_id: str) -> Sandbox:
    """A sandbox whose processes exist (running or paused): what commands, files and snapshots need."""
    team_filter = Q(team_id=team) if isinstance(team, str) else Q(team=team)
    sandbox = Sandbox.objects.select_related("host").filter(team_filter, pk=sandbox_id).first()
    if sandbox is None:
        raise not_found("sandbox", sandbox_id)
    return require_started(sandbox)


def started_members(launch: Launch) -> list[tuple[str, str]]:
    """(engine address, engine id) of each running or paused member of a launch, in one query."""
    rows = Sandbox.objects.filter(launch=launch, state__in=Sandbox.STARTED).exclude(engine_id="")
    return list(rows.values_list("host__engine_socket", "engine_id"))


def require_started(sandbox: Sandbox, doing: str = "do this") -> Sandbox:
    """The sandbox, if its processes exist (running or paused); ``sandbox_not_running`` otherwise."""
    if not sandbox.reachable:
        raise Conflict(
            "sandbox_not_running",
            f"sandbox {sandbox.id} is {sandbox.state}: only a running or paused sandbox can {doing}",
            details={"state": sandbox.state},
        )
    return sandbox


def ports_of(sandbox: Sandbox) -> list[ExposedPort]:
    """A sandbox's exposed ports, by number (at most one per port: a short list)."""
    return list(ExposedPort.objects.filter(sandbox=sandbox).order_by("port"))


def port_for(sandbox: Sandbox, port: int) -> ExposedPort:
    """One of the sandbox's exposed ports; ``port_not_found`` if it is not exposed (or no port at all)."""
    row = ExposedPort.objects.filter(sandbox=sandbox, port=port).first() if 1 <= port <= 65535 else None
    if row is None:
        raise not_found("port", str(port))
    return row


def preview_target(sandbox_id: str, port: int) -> ExposedPort | None:
    """What a preview URL names (any team's: how it may be reached is the port's ``auth``), with its
    sandbox and host; None unless the port is exposed and its sandbox is running or paused."""
    row = ExposedPort.objects.select_related("sandbox__host").filter(sandbox_id=sandbox_id, port=port).first()
    return row if row is not None and row.sandbox.reachable else None


def launch_for(team: Team, launch_id: str, *, field: str | None = None) -> Launch:
    launch = Launch.objects.select_related("snapshot", "network_policy").filter(team=team, pk=launch_id).first()
    if launch is None:
        raise not_found("launch", launch_id, field=field)
    return launch


def snapshot_for(team: Team, snapshot_id: str) -> Snapshot:
    """A snapshot that is not deleted, with its live forks counted."""
    rows = with_forks_alive(Snapshot.objects.select_related("host", "parent", "source_sandbox"))
    snapshot = rows.filter(team=team, pk=snapshot_id).exclude(state=Snapshot.State.DELETED).first()
    if snapshot is None:
        raise not_found("snapshot", snapshot_id)
    return snapshot


def ready_snapshot_locked(team: Team, snapshot_id: str) -> Snapshot:
    """Inside a create's transaction: the snapshot is ready, and stays so until it commits
    (a delete locks the same row, so a fork cannot slip in between its count and its delete)."""
    snapshot = Snapshot.objects.select_for_update().filter(team=team, pk=snapshot_id, state=Snapshot.State.READY).first()
    if snapshot is None:
        raise not_found("snapshot", snapshot_id, field="snapshot")
    return snapshot


def visible_templates(team: Team) -> QuerySet[Template]:
    """The global templates and the team's own, each with its last build's id and the hosts that hold it."""
    last_build = TemplateBuild.objects.filter(template=OuterRef("pk")).order_by("-created_at", "-id").values("pk")[:1]
    return (
        Template.objects.filter(Q(team__isnull=True) | Q(team=team))
        .select_related("snapshot")
        .prefetch_related("hosts", "snapshot__hosts")
        .annotate(last_build_id=Subquery(last_build))
    )


def template_for(team: Team, name: str, *, field: str | None = None) -> Template:
    """A global template, or one of the team's own."""
    template = visible_templates(team).filter(name=name).first()
    if template is None:
        raise not_found("template", name, field=field)
    return template


@dataclass(frozen=True)
class BuildBase:
    """A template build's base, resolved: its part of the build key, and what a sandbox names to start from it."""

    key: str
    source: dict[str, str]  # {"template": name} or {"snapshot": id}


# A build's base named as an image reference: the operator's public template of that distribution
# (``forkyard-engine template build-debian`` makes ``debian``, Debian 12 "bookworm"). Same layers, same
# build key: a spec naming ``debian:bookworm`` and one naming ``debian`` share their cached steps.
BASE_IMAGES = {"debian:bookworm": "debian", "debian:12": "debian"}


def build_base(team: Team, base: str) -> BuildBase:
    """A build's ``base``: ``snapshot:<id>`` (ready, the team's), a public template (keyed by its layers),
    an image reference of ``BASE_IMAGES`` (the public template it names), or one of the team's own (its
    last good build's snapshot); 404 or ``template_not_ready`` otherwise."""
    if base.startswith("snapshot:"):
        snapshot_id = base.removeprefix("snapshot:")
        if not Snapshot.objects.filter(team=team, pk=snapshot_id, state=Snapshot.State.READY).exists():
            raise not_found("snapshot", snapshot_id, field="base")
        return BuildBase(f"snapshot:{snapshot_id}", {"snapshot": snapshot_id})
    if base in BASE_IMAGES:
        public = Template.objects.filter(team__isnull=True, name=BASE_IMAGES[base]).first()
        if public is None:
            raise NotFound(
                "template_not_found",
                f"no public template {BASE_IMAGES[base]!r} for {base!r} on this installation: an operator makes it"
                f" with 'forkyard-engine template build-debian --name {BASE_IMAGES[base]}'",
                field="base",
            )
        base = public.name
    template = template_for(team, base, field="base")
    if template.team_id is None:
        layers = ",".join(template.layers) or template.created_at.isoformat()
        return BuildBase(f"template:{template.name}:{layers}", {"template": base})
    if template.state != Template.State.READY or template.snapshot_id is None:
        raise Conflict("template_not_ready", f"base template {base!r} is {template.state}", details={"state": template.state})
    return BuildBase(f"snapshot:{template.snapshot_id}", {"snapshot": str(template.snapshot_id)})


def last_build(template: Template) -> TemplateBuild | None:
    """A template's latest build (a public template has none)."""
    return template.builds.order_by("-created_at", "-id").first()


def with_sandboxes_alive(rows: QuerySet[Lease]) -> QuerySet[Lease]:
    """Each lease with ``sandboxes_alive``, its live sandboxes, counted by the database (no query per row)."""
    return rows.annotate(sandboxes_alive=Count("sandboxes", filter=Q(sandboxes__state__in=Sandbox.LIVE)))


def lease_for(team: Team, lease_id: str) -> Lease:
    lease = with_sandboxes_alive(Lease.objects.filter(team=team, pk=lease_id)).first()
    if lease is None:
        raise not_found("lease", lease_id)
    return lease


def active_lease(lease: Lease) -> Lease:
    """The lease, if sandboxes may still be named with it: ``lease_expired`` or ``lease_ended`` otherwise."""
    if lease.state == Lease.State.ENDED:
        raise Conflict(
            "lease_ended", f"lease {lease.pk} was ended: take a new one", field="lease", details={"state": lease.state}
        )
    if lease.state == Lease.State.EXPIRED or lease.expires_at < timezone.now():
        raise Conflict(
            "lease_expired",
            f"lease {lease.pk} expired: no heartbeat came for {lease.grace_s} s (its sandboxes are destroyed); take a new one",
            field="lease",
            details={"state": Lease.State.EXPIRED},
        )
    return lease


def active_lease_for(team: Team, lease_id: str, *, lock: bool = False) -> Lease:
    """The team's lease a create names, if still active; ``lock``, inside the create's transaction: and it
    stays so until that commits (its expiry and its end update the same row)."""
    rows = Lease.objects.filter(team=team, pk=lease_id)
    lease = (rows.select_for_update() if lock else rows).first()
    if lease is None:
        raise not_found("lease", lease_id, field="lease")
    return active_lease(lease)


def policy_for(team: Team, policy_id: str) -> NetworkPolicy:
    policy = NetworkPolicy.objects.filter(team=team, pk=policy_id).first()
    if policy is None:
        raise not_found("network_policy", policy_id)
    return policy


# --- lists -------------------------------------------------------------------------------------


def with_label(rows: QuerySet[Labelled], label: str) -> QuerySet[Labelled]:
    """Filter by ``key=value``, ``key:value`` or ``key`` (any value).

    A label's key holds neither ``=`` nor ``:``, so the first of them ends
    it.  The key is a JSON key taken literally (KeyTextTransform), never
    spliced into a lookup path: ``a__regex`` is a key, not a regex query.
    """
    ends = [index for index in (label.find("="), label.find(":")) if index >= 0]
    cut = min(ends) if ends else len(label)
    key, separator, value = label[:cut], label[cut : cut + 1], label[cut + 1 :]
    if not key or len(key) > 63:
        raise invalid("label is key:value, key=value or key", field="label")
    if "\x00" in label:  # no label holds one, and PostgreSQL refuses it in a query's text
        raise invalid("a label holds no NUL character", field="label")
    if not separator:
        return rows.filter(labels__has_key=key)
    # Cast: a JSON key transform would read "1" as the JSON number 1.
    aliased = rows.alias(label_value=Cast(KeyTextTransform(key, "labels"), output_field=TextField()))
    # The same rows: the stubs' plugin loses a generic queryset's model through alias().
    return cast("QuerySet[Labelled]", aliased.filter(label_value=value))


def within(rows: QuerySet[Labelled], labels: Mapping[str, str] | None) -> QuerySet[Labelled]:
    """Only rows carrying every one of ``labels`` (an API key's label limit, ``console.permissions``)."""
    for index, (key, value) in enumerate(sorted((labels or {}).items())):
        alias = f"limit_label_{index}"
        rows = cast(
            "QuerySet[Labelled]",
            rows.alias(**{alias: Cast(KeyTextTransform(key, "labels"), output_field=TextField())}).filter(**{alias: value}),
        )
    return rows


def _check_state(state: str | None, states: list[str]) -> None:
    if state is not None and state not in states:
        raise invalid(f"state must be one of {', '.join(states)}", field="state")


def _narrowed(
    rows: QuerySet[Labelled], states: list[str], state: str | None, label: str | None, labels: Mapping[str, str] | None
) -> QuerySet[Labelled]:
    """A list's common filters: a key's label limit (``labels``), one state (checked), one label."""
    _check_state(state, states)
    rows = within(rows, labels)
    if state:
        rows = rows.filter(state=state)
    if label:
        rows = with_label(rows, label)
    return rows


def sandboxes_page(
    team: Team,
    *,
    state: str | None = None,
    label: str | None = None,
    cursor: str | None,
    limit: int,
    strict: bool = True,
    labels: Mapping[str, str] | None = None,
    live_only: bool = False,
    search: str | None = None,
) -> Page[Sandbox]:
    """Newest first; ``labels``: only those carrying them all; ``live_only``: not the ended ones;
    ``search``: those whose id starts with it."""
    rows = _narrowed(Sandbox.objects.select_related("host").filter(team=team), Sandbox.State.values, state, label, labels)
    if live_only and not state:
        rows = rows.filter(state__in=Sandbox.LIVE)
    if search:
        rows = rows.filter(pk__startswith=search)
    return keyset_page(rows, cursor=cursor, limit=limit, strict=strict)


def _members_in(states: list[str]) -> Coalesce:
    """How many of a launch's sandboxes are in these states, counted on the
    (launch, state) index for each launch of the page."""
    counted = (
        Sandbox.objects.filter(launch=OuterRef("pk"), state__in=states)
        .order_by()
        .values("launch")
        .annotate(n=Count("pk"))
        .values("n")
    )
    return Coalesce(Subquery(counted, output_field=IntegerField()), 0)


def launches_page(
    team: Team, *, cursor: str | None, limit: int, strict: bool = True, labels: Mapping[str, str] | None = None
) -> Page[Launch]:
    """Newest first, each with ``running`` and ``failed`` counts (annotations: no query per row).

    A subquery per launch of the page, not a join grouped by launch: the join
    read every member row of every launch (176 ms for one launch of 32,752 on
    SQLite), the subqueries count index entries of the page's launches only.
    """
    rows = (
        within(Launch.objects.filter(team=team), labels)
        .select_related("snapshot")
        .annotate(running=_members_in(list(Sandbox.STARTED)), failed=_members_in([Sandbox.State.FAILED]))
    )
    return keyset_page(rows, cursor=cursor, limit=limit, strict=strict)


def launch_members_page(
    launch: Launch,
    *,
    state: str | None = None,
    ready_since: datetime | None = None,
    cursor: str | None,
    limit: int,
    strict: bool = True,
) -> Page[Sandbox]:
    """A launch's sandboxes in launch order; or, ``ready_since`` a time, those ready since then, in the
    order they became ready (what a caller waiting for a launch has not seen yet)."""
    _check_state(state, Sandbox.State.values)
    rows = Sandbox.objects.select_related("host").defer("env").filter(launch=launch)  # env: sealed, and never shown
    if state:
        rows = rows.filter(state=state)
    if ready_since is None:
        return keyset_page(rows, cursor=cursor, limit=limit, order=LAUNCH_ORDER, strict=strict)
    return keyset_page(rows.filter(ready_at__gte=ready_since), cursor=cursor, limit=limit, order=READY_ORDER, strict=strict)


def launch_members_ready(launch: Launch, since: datetime | None) -> list[tuple[str, datetime]]:
    """Ids of a launch's started members written since ``since`` (all of them without it), in the order
    they became ready, each with the time its row was last written: what a caller following the launch
    has to look at, and no more.

    By the write's time, not the engine's ready time: a worker records started sandboxes in batches, so a
    row can be written a second or more after its sandbox was ready, and a look by ready time had to
    reach that far back every time; the write is stamped at the writer's turn, just before its commit."""
    rows = Sandbox.objects.filter(launch=launch, state__in=Sandbox.STARTED, ready_at__isnull=False)
    if since is not None:
        rows = rows.filter(updated_at__gte=since)
    return list(rows.order_by(*READY_ORDER).values_list("pk", "updated_at"))


def launch_member_ids(launch: Launch) -> list[str]:
    """Every member's id, in launch order."""
    return list(Sandbox.objects.filter(launch=launch).order_by(*LAUNCH_ORDER).values_list("pk", flat=True))


def with_forks_alive(rows: QuerySet[Snapshot]) -> QuerySet[Snapshot]:
    """Each snapshot with ``forks_alive``, its live forks, counted by the database (no query per row)."""
    return rows.annotate(forks_alive=Count("sandboxes", filter=Q(sandboxes__state__in=Sandbox.LIVE)))


def snapshots_page(
    team: Team,
    *,
    state: str | None = None,
    label: str | None = None,
    cursor: str | None,
    limit: int,
    strict: bool = True,
    labels: Mapping[str, str] | None = None,
) -> Page[Snapshot]:
    """Newest first; deleted snapshots are not listed."""
    rows = Snapshot.objects.select_related("host").filter(team=team).exclude(state=Snapshot.State.DELETED)
    rows = _narrowed(rows, Snapshot.State.values, state, label, labels)
    return keyset_page(with_forks_alive(rows), cursor=cursor, limit=limit, strict=strict)


def snapshot_children(snapshot: Snapshot, limit: int = 50) -> list[Snapshot]:
    """Snapshots taken from forks of this one (not deleted), newest first."""
    rows = Snapshot.objects.filter(parent=snapshot).exclude(state=Snapshot.State.DELETED)
    return list(rows.order_by("-created_at", "-id")[:limit])


def templates_page(team: Team, *, cursor: str | None, limit: int, strict: bool = True) -> Page[Template]:
    """The global templates and the team's own, by name, with the hosts that hold them."""
    return keyset_page(visible_templates(team), cursor=cursor, limit=limit, order=("name", "id"), strict=strict)


def leases_page(
    team: Team, *, state: str | None = None, cursor: str | None, limit: int, strict: bool = True, key_id: str | None = None
) -> Page[Lease]:
    """Newest first, each with its live sandboxes counted; ``key_id``: only that key's."""
    _check_state(state, Lease.State.values)
    rows = Lease.objects.filter(team=team)
    if key_id is not None:
        rows = rows.filter(api_key_id=key_id)
    if state:
        rows = rows.filter(state=state)
    return keyset_page(with_sandboxes_alive(rows), cursor=cursor, limit=limit, strict=strict)


def policies_page(team: Team, *, cursor: str | None, limit: int, strict: bool = True) -> Page[NetworkPolicy]:
    """The team's policies by name, each with ``in_use``: how many live sandboxes run under it."""
    in_use = Count("sandbox", filter=Q(sandbox__state__in=Sandbox.LIVE))
    rows = NetworkPolicy.objects.filter(team=team).annotate(in_use=in_use)
    return keyset_page(rows, cursor=cursor, limit=limit, order=("name", "id"), strict=strict)


# --- batches -----------------------------------------------------------------------------------


def batch_limit(team: Team) -> int:
    """The most sandboxes one batch may name: ``MAX_BATCH``, or the team's largest launch if larger."""
    return max(MAX_BATCH, limits_of(team).max_launch_count)


def _too_many(limit: int, field: str) -> InvalidRequest:
    return InvalidRequest(
        "batch_too_large", f"a batch names at most {limit} sandboxes: split it", field=field, details={"limit": limit}
    )


def batch_targets(
    team: Team,
    *,
    sandbox_ids: list[str] | None = None,
    launch: str | None = None,
    label: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> list[tuple[str, Sandbox | None]]:
    """The sandboxes a batch names, each as (the id asked for, the team's row or None).

    By ids: each id once, in the order given; one of another team (or of
    nobody) is None.  By launch or label: the team's live sandboxes of it.
    More than ``batch_limit`` is ``batch_too_large``, refused before any runs.
    """
    limit = batch_limit(team)
    live = within(Sandbox.objects.select_related("host").filter(team=team, state__in=Sandbox.LIVE), labels)
    if sandbox_ids is not None:
        wanted = list(dict.fromkeys(sandbox_ids))
        if len(wanted) > limit:
            raise _too_many(limit, "sandbox_ids")
        found: dict[str, Sandbox] = {}
        for start in range(0, len(wanted), 500):
            chunk = wanted[start : start + 500]
            mine = within(Sandbox.objects.select_related("host").filter(team=team, pk__in=chunk), labels)
            found.update((row.pk, row) for row in mine)
        return [(sandbox_id, found.get(sandbox_id)) for sandbox_id in wanted]
    if launch is not None:
        found_launch = launch_for(team, launch, field="launch")
        if labels and not all(str(found_launch.labels.get(k)) == v for k, v in labels.items()):
            raise not_found("launch", launch, field="launch")
        rows = live.filter(launch=found_launch).order_by(*LAUNCH_ORDER)
        field = "launch"
    else:
        rows = with_label(live, label or "").order_by("created_at", "id")
        field = "label"
    selected = list(rows[: limit + 1])
    if len(selected) > limit:
        raise _too_many(limit, field)
    return [(row.pk, row) for row in selected]


# --- counts ------------------------------------------------------------------------------------


def state_counts(team: Team, label: str | None = None) -> dict[str, int]:
    """How many of the team's sandboxes are in each state: one GROUP BY."""
    rows = Sandbox.objects.filter(team=team)
    if label:
        rows = with_label(rows, label)
    counted = rows.values("state").annotate(n=Count("id")).order_by()
    return {row["state"]: row["n"] for row in counted}


def largest_launch(team: Team) -> int:
    """The most sandboxes one of the team's launches asked for (0: none yet)."""
    return int(Launch.objects.filter(team=team).aggregate(largest=Max("count"))["largest"] or 0)


def launches_today(team: Team) -> int:
    midnight = timezone.now().replace(hour=0, minute=0, second=0, microsecond=0)
    return Launch.objects.filter(team=team, created_at__gte=midnight).count()


def recent_launches(team: Team, count: int = 5) -> list[Launch]:
    return list(Launch.objects.filter(team=team).order_by("-created_at", "-id")[:count])


def member_states(launch: Launch) -> dict[str, int]:
    """How many of a launch's sandboxes are in each state (one GROUP BY on the (launch, state) index)."""
    counted = Sandbox.objects.filter(launch=launch).values("state").annotate(n=Count("id")).order_by()
    return {row["state"]: row["n"] for row in counted}


# A member's state -> the stage a launch's progress counts it in.
STAGES: dict[str, str] = {
    Sandbox.State.QUEUED: "queued",
    Sandbox.State.CREATING: "creating",
    Sandbox.State.RUNNING: "running",
    Sandbox.State.PAUSED: "running",
    Sandbox.State.FAILED: "failed",
    Sandbox.State.STOPPING: "ended",
    Sandbox.State.STOPPED: "ended",
    Sandbox.State.DESTROYED: "ended",
}


def launch_host_shares(launch: Launch) -> list[dict[str, Any]]:
    """Each host's share of a launch, by stage, hosts by name (one GROUP BY on the (launch, state) index)."""
    shares: dict[str, dict[str, Any]] = {}
    counted = Sandbox.objects.filter(launch=launch).values("host__name", "state").annotate(n=Count("id")).order_by()
    for row in counted:
        name = row["host__name"] or ""
        share = shares.setdefault(name, {"host": name, "queued": 0, "creating": 0, "running": 0, "failed": 0, "ended": 0})
        share[STAGES.get(row["state"], "queued")] += row["n"]
    return [shares[name] for name in sorted(shares)]


@dataclass(frozen=True)
class LaunchProgress:
    """Where a launch is: its members by stage, its state as a caller should read it, and its pace."""

    state: str
    requested: int
    queued: int
    creating: int
    running: int
    failed: int
    ended: int
    elapsed_s: float
    rate_per_s: float

    def counts(self) -> dict[str, int]:
        names = ("requested", "queued", "creating", "running", "failed", "ended")
        return {name: getattr(self, name) for name in names}


def launch_progress(launch: Launch, now: datetime | None = None) -> LaunchProgress:
    states = member_states(launch)
    # Members not made yet are on their way while the launch starts; once it is torn down (or failed)
    # they never will be, and count as ended, so that the counts always add up to the request.
    unmade = max(0, launch.count - sum(states.values()))
    starting = launch.state == Launch.State.CREATING
    queued = states.get(Sandbox.State.QUEUED, 0) + (unmade if starting else 0)
    creating = states.get(Sandbox.State.CREATING, 0)
    running = sum(states.get(state, 0) for state in Sandbox.STARTED)
    failed = states.get(Sandbox.State.FAILED, 0)
    ended = sum(states.get(state, 0) for state in (Sandbox.State.STOPPING, Sandbox.State.STOPPED, Sandbox.State.DESTROYED))
    ended += 0 if starting else unmade
    end = launch.ready_at or launch.ended_at or now or timezone.now()
    elapsed = max(0.0, (end - launch.created_at).total_seconds())
    state = launch.state
    if state == Launch.State.CREATING and queued == 0 and creating == 0:
        state = Launch.State.READY  # every sandbox started; the row catches up at its chunk's end
    return LaunchProgress(
        state=state,
        requested=launch.count,
        queued=queued,
        creating=creating,
        running=running,
        failed=failed,
        ended=ended,
        elapsed_s=round(elapsed, 3),
        rate_per_s=round((running + failed + ended) / elapsed, 1) if elapsed > 0 else 0.0,
    )


@dataclass(frozen=True)
class LaunchPace:
    """How fast a launch's sandboxes started: on average (from its creation to its last start) and at its
    busiest second; ``all_running_s``: how long until every one had started, once they all have."""

    started: int
    average_per_s: float
    peak_per_s: int
    all_running_s: float | None


def launch_pace(launch: Launch) -> LaunchPace:
    """One GROUP BY over the members' ready times, by the second."""
    by_second = (
        Sandbox.objects.filter(launch=launch, ready_at__isnull=False)
        .annotate(second=TruncSecond("ready_at"))
        .values("second")
        .annotate(n=Count("id"))
        .order_by()
    )
    counts = [(row["second"], row["n"]) for row in by_second]
    started = sum(n for _, n in counts)
    if not counts:
        return LaunchPace(0, 0.0, 0, None)
    last = max(second for second, _ in counts) + timedelta(seconds=1)
    span = max(0.001, (min(last, launch.ready_at or last) - launch.created_at).total_seconds())
    everyone = launch.ready_at is not None and started == launch.count
    return LaunchPace(
        started=started,
        average_per_s=round(started / span, 1),
        peak_per_s=max(n for _, n in counts),
        all_running_s=round((launch.ready_at - launch.created_at).total_seconds(), 1) if everyone and launch.ready_at else None,
    )


def snapshot_users(snapshot: Snapshot) -> dict[str, int]:
    """What keeps a snapshot from being deleted: live forks, launches from it still starting, and the team's
    templates it is (a built template is its build's last snapshot)."""
    return {
        "forks_alive": Sandbox.objects.filter(snapshot=snapshot, state__in=Sandbox.LIVE).count(),
        "launches_starting": Launch.objects.filter(snapshot=snapshot, state=Launch.State.CREATING).count(),
        "templates": Template.objects.filter(snapshot=snapshot).count(),
    }
