"""The control plane's records of hosts, templates, sandboxes, launches, snapshots and network policies.

The engine on each host is the authority on what runs there; these rows are
what the API promises and bills.  Reconciliation keeps the two in step.
"""

from __future__ import annotations

from typing import Any

from django.db import models
from django.utils import timezone

from console.models import ApiKey, Team, public_id
from console.sealing import SealedJSONField
from sandboxes.engine.cgroups import GROUP_CPU_MAX


def sandbox_id() -> str:
    return public_id("sb")


def launch_id() -> str:
    return public_id("launch")


def snapshot_id() -> str:
    return public_id("snap")


def policy_id() -> str:
    return public_id("net")


def port_id() -> str:
    return public_id("port")


def lease_id() -> str:
    return public_id("ls")


def build_id() -> str:
    return public_id("tb")


class Host(models.Model):
    """A machine running an engine and a Celery worker on its own queue."""

    class State(models.TextChoices):
        ONLINE = "online"
        DRAINING = "draining"
        OFFLINE = "offline"

    name = models.CharField(max_length=100, unique=True)
    queue = models.CharField(max_length=120)
    engine_socket = models.CharField(max_length=255)
    region = models.CharField(max_length=64)
    state = models.CharField(max_length=10, choices=State.choices, default=State.ONLINE)
    cpus = models.PositiveIntegerField(default=0)
    memory_mib = models.PositiveBigIntegerField(default=0)
    max_sandboxes = models.PositiveIntegerField(default=0)
    # How many sandboxes the host's kernel limits let it hold (its engine's preflight: ``fits``); None: not reported.
    kernel_max_sandboxes = models.PositiveIntegerField(null=True, blank=True)
    # The kernel's memory per sandbox that no memory limit charges, as its engine measured it (KiB); 0: not reported.
    sandbox_overhead_kib = models.PositiveIntegerField(default=0)
    engine_sandboxes = models.PositiveIntegerField(default=0)  # as the engine last reported (pooled included)
    committed_memory_mib = models.PositiveBigIntegerField(default=0)
    engine_version = models.CharField(max_length=32, blank=True)
    # Its data path's gateway (sandboxes.engine.gateway): where callers send commands with a data token, and
    # the key it checks them with (as its engine reported it), sealed at rest.
    gateway_url = models.CharField(max_length=255, blank=True)
    gateway_secret = SealedJSONField(blank=True, default="")
    registered_at = models.DateTimeField(default=timezone.now)
    last_heartbeat = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return self.name

    @property
    def interactive_queue(self) -> str:
        """Its interactive lane (``sandboxes.commands``): what someone waits on, taken by a worker of its own."""
        return f"{self.queue}.interactive"


class Template(models.Model):
    """A root filesystem sandboxes start from; global unless it names a team.

    A global one is what the hosts' engines hold (they report it). A team's
    own is built through the API (``TemplateBuild``): it is the last snapshot
    of its build, so a create from it is a fork of that snapshot.
    """

    class State(models.TextChoices):
        BUILDING = "building"  # its first build has not finished
        READY = "ready"
        FAILED = "failed"  # its first build failed: nothing to start from

    name = models.CharField(max_length=64)
    team = models.ForeignKey(Team, null=True, blank=True, on_delete=models.CASCADE, related_name="templates")
    description = models.CharField(max_length=255, blank=True)
    size_bytes = models.PositiveBigIntegerField(default=0)
    layers = models.JSONField(default=list)
    hosts = models.ManyToManyField(Host, blank=True, related_name="templates")
    state = models.CharField(max_length=10, choices=State.choices, default=State.READY)
    # A team's template: the snapshot its last good build ended with.
    snapshot = models.ForeignKey("Snapshot", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["name"], condition=models.Q(team__isnull=True), name="unique_global_template"),
            models.UniqueConstraint(fields=["team", "name"], condition=models.Q(team__isnull=False), name="unique_team_template"),
        ]

    def __str__(self) -> str:
        return self.name


class NetworkPolicy(models.Model):
    """Where a sandbox may connect.  Default: nowhere but its own loopback."""

    id = models.CharField(primary_key=True, max_length=32, default=policy_id, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="network_policies")
    name = models.CharField(max_length=64)
    description = models.CharField(max_length=255, blank=True)
    # [{"cidr": "10.0.0.0/8" | "host": "pypi.org", "ports": [443], "protocol": "tcp"}]
    egress = models.JSONField(default=list)
    # Sandboxes of the same launch under this policy may reach each other (a multi-service environment).
    same_launch = models.BooleanField(default=False)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "name"], name="unique_policy_name_per_team")]

    def engine_network(self, launch_id: str | None = None) -> dict[str, Any]:
        """Its rules as the engine takes them (``sandboxes/engine/network.py``: ``create``'s and
        ``network.set``'s ``network``), which enforces them on the sandbox's host; for a member of
        ``launch_id`` under a ``same_launch`` policy, the launch is its group."""
        network: dict[str, Any] = {
            "egress": [{key: value for key, value in rule.items() if value is not None} for rule in self.egress]
        }
        if self.same_launch and launch_id:
            network["group"] = launch_id
        return network


class Snapshot(models.Model):
    """A sandbox's filesystem saved as a layer (and the services its forks start).

    In the engine a snapshot is a template named by this row's id.  The row is
    never removed: a deleted snapshot keeps its row (``deleted``) so that its
    billed GiB-hours and the sandboxes forked from it still name it.
    """

    class State(models.TextChoices):
        CREATING = "creating"
        READY = "ready"
        DELETED = "deleted"
        FAILED = "failed"

    id = models.CharField(primary_key=True, max_length=32, default=snapshot_id, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="snapshots")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL)
    name = models.CharField(max_length=100)
    labels = models.JSONField(default=dict)
    state = models.CharField(max_length=10, choices=State.choices, default=State.CREATING)
    source_sandbox = models.ForeignKey("Sandbox", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.PROTECT, related_name="children")
    template = models.CharField(max_length=64)  # the root template under every layer
    layer_id = models.CharField(max_length=80, blank=True)  # the engine's content address of its own layer
    size_bytes = models.PositiveBigIntegerField(default=0)  # its own layer: what saved state bills
    total_bytes = models.PositiveBigIntegerField(default=0)  # with every layer below it
    paused_ms = models.FloatField(null=True, blank=True)  # how long the source sandbox was paused to take it
    host = models.ForeignKey(Host, null=True, blank=True, on_delete=models.SET_NULL)  # where it was taken
    hosts = models.ManyToManyField(Host, blank=True, related_name="snapshots_held")  # every host whose engine holds it
    services = models.JSONField(default=list)
    # Taken by a template build after a step: the digest of its base and every step up to it (a build
    # whose steps start the same way forks the same snapshot instead of running them again).
    build_key = models.CharField(max_length=64, blank=True, db_index=True)
    # What forks get by default besides the parent's (a build's env, workdir and user steps).
    defaults = models.JSONField(default=dict)
    idempotency_key = models.CharField(max_length=255, null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    ready_at = models.DateTimeField(null=True, blank=True)
    deleted_at = models.DateTimeField(null=True, blank=True)
    error_code = models.CharField(max_length=64, blank=True)
    error = models.CharField(max_length=255, blank=True)  # the error's message

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["team", "idempotency_key"],
                condition=models.Q(idempotency_key__isnull=False),
                name="unique_snapshot_key_per_team",
            )
        ]
        indexes = [models.Index(fields=["team", "state"]), models.Index(fields=["team", "created_at"])]

    def __str__(self) -> str:
        return f"{self.id} ({self.name})"


class TemplateBuild(models.Model):
    """One build of a team's template from its spec (``schemas.TemplateBuildIn``): its steps run as
    commands in a sandbox, each step's result saved as a snapshot, the last one the template.

    ``log`` is the build's output while it runs (its tail, for whoever follows it); when the build
    ends it is cleared, and only a failed step's output tail stays, in ``error_output``.
    """

    class State(models.TextChoices):
        QUEUED = "queued"
        BUILDING = "building"
        READY = "ready"
        FAILED = "failed"

    id = models.CharField(primary_key=True, max_length=32, default=build_id, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="template_builds")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL)
    template = models.ForeignKey(Template, on_delete=models.CASCADE, related_name="builds")
    spec = models.JSONField(default=dict)
    state = models.CharField(max_length=10, choices=State.choices, default=State.QUEUED)
    # [{"name", "state": pending|cached|running|done|failed, "seconds", "snapshot"}], one a step
    steps = models.JSONField(default=list)
    log = models.TextField(blank=True)
    log_total = models.PositiveBigIntegerField(default=0)  # characters ever written to the log (its tail is kept)
    sandbox = models.ForeignKey("Sandbox", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    snapshot = models.ForeignKey(Snapshot, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    failed_step = models.IntegerField(null=True, blank=True)
    error_code = models.CharField(max_length=64, blank=True)
    error = models.CharField(max_length=500, blank=True)
    error_output = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["team", "created_at"])]

    def __str__(self) -> str:
        return f"{self.id} ({self.template_id})"


class Lease(models.Model):
    """Sandboxes that live only while their client does: a client heartbeats its lease, and when the
    heartbeats stop for ``grace_s`` (or the client ends it) every sandbox named with it is destroyed."""

    class State(models.TextChoices):
        ACTIVE = "active"
        EXPIRED = "expired"  # its heartbeats stopped for its grace period
        ENDED = "ended"  # its client ended it

    # Its sandboxes are (being) destroyed.
    OVER = (State.EXPIRED, State.ENDED)

    id = models.CharField(primary_key=True, max_length=32, default=lease_id, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="leases")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL)
    grace_s = models.PositiveIntegerField()
    state = models.CharField(max_length=10, choices=State.choices, default=State.ACTIVE)
    created_at = models.DateTimeField(default=timezone.now)
    heartbeat_at = models.DateTimeField(default=timezone.now)  # the last sign of life (the create, then each heartbeat)
    expires_at = models.DateTimeField()  # heartbeat_at + grace_s
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["state", "expires_at"]), models.Index(fields=["team", "created_at"])]

    def __str__(self) -> str:
        return self.id


class Launch(models.Model):
    """Many sandboxes in one call; forking a snapshot N times is a launch."""

    class State(models.TextChoices):
        CREATING = "creating"
        READY = "ready"  # every sandbox started (some may have failed)
        STOPPING = "stopping"
        STOPPED = "stopped"
        FAILED = "failed"

    id = models.CharField(primary_key=True, max_length=32, default=launch_id, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="launches")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL)
    template = models.CharField(max_length=64)
    snapshot = models.ForeignKey(Snapshot, null=True, blank=True, on_delete=models.PROTECT, related_name="launches")
    size = models.CharField(max_length=32)
    cpu = models.FloatField()
    memory_mib = models.PositiveIntegerField()
    disk_mib = models.PositiveIntegerField(default=0)  # 0: its size's own
    ttl_s = models.PositiveIntegerField()
    idle_timeout_s = models.PositiveIntegerField(default=0)  # 0: none
    count = models.PositiveIntegerField()
    # Its sandboxes share a memory cgroup this many at a time on each host (sandboxes/engine/cgroups.py:
    # the opt-in for scale); 1: each its own.
    memory_group_size = models.PositiveIntegerField(default=1)
    # Where its groups' CPU quota is: each sandbox's own ("each"), or one for the group, its members' summed
    # ("group": no quota write per create, which walks every CPU cgroup on the host; cgroups.py).
    memory_group_cpu = models.CharField(max_length=5, choices=[("each", "Each"), ("group", "Group")], default="each")
    labels = models.JSONField(default=dict)
    network_policy = models.ForeignKey(NetworkPolicy, null=True, blank=True, on_delete=models.SET_NULL)
    lease = models.ForeignKey(Lease, null=True, blank=True, on_delete=models.SET_NULL, related_name="launches")
    idempotency_key = models.CharField(max_length=255, null=True, blank=True)
    state = models.CharField(max_length=10, choices=State.choices, default=State.CREATING)
    created_at = models.DateTimeField(default=timezone.now)
    ready_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["team", "idempotency_key"],
                condition=models.Q(idempotency_key__isnull=False),
                name="unique_launch_key_per_team",
            )
        ]
        indexes = [models.Index(fields=["team", "created_at"])]

    def member(self, index: int, host: Host, env: dict[str, str]) -> Sandbox:
        """Its sandbox number ``index`` (not saved), shaped as the launch asked."""
        return Sandbox(
            team_id=self.team_id,
            api_key_id=self.api_key_id,
            host=host,
            launch=self,
            launch_index=index,
            template=self.template,
            snapshot_id=self.snapshot_id,
            size=self.size,
            cpu=self.cpu,
            memory_mib=self.memory_mib,
            disk_mib=self.disk_mib,
            ttl_s=self.ttl_s,
            idle_timeout_s=self.idle_timeout_s,
            network_policy_id=self.network_policy_id,
            lease_id=self.lease_id,
            env=env,
            labels={**self.labels, "launch": self.id},
            **self._memory_group(index, host),
        )

    def _memory_group(self, index: int, host: Host) -> dict[str, Any]:
        """The memory group member ``index`` joins on ``host``, and the group's limit: what the group's
        members would have had, together."""
        if self.memory_group_size <= 1:
            return {}
        group = f"{self.id.lower().replace('_', '-')}-{host.pk}-{index // self.memory_group_size}"
        # Its members' cores summed, at most what the engine takes (a quota past any host's cores: none at all);
        # 64 cores x 4,096 members would otherwise be refused at every member's create.
        shared_cpu = min(self.cpu * self.memory_group_size, GROUP_CPU_MAX) if self.memory_group_cpu == "group" else 0.0
        return {
            "memory_group": group[:40],
            "memory_group_mib": self.memory_mib * self.memory_group_size,
            "memory_group_cpu": shared_cpu,
        }


class Sandbox(models.Model):
    class State(models.TextChoices):
        QUEUED = "queued"  # recorded, not yet on its host
        CREATING = "creating"
        RUNNING = "running"
        PAUSED = "paused"
        STOPPING = "stopping"
        STOPPED = "stopped"  # it died on its own
        FAILED = "failed"  # it never started
        DESTROYED = "destroyed"

    # Not yet ended: it holds (or will hold) a place on its host.
    LIVE = (State.QUEUED, State.CREATING, State.RUNNING, State.PAUSED, State.STOPPING)
    ENDED = (State.STOPPED, State.FAILED, State.DESTROYED)
    # Its processes exist: commands, files and snapshots can reach it.
    STARTED = (State.RUNNING, State.PAUSED)
    # Why a sandbox ended on its own (kept in error_code, with the engine's words in error_message): not errors.
    # host_lost: its host stopped answering (FORKYARD_HOST_LOST_S), billed up to its last heartbeat.
    END_REASONS = ("ttl_expired", "idle_timeout", "exited", "host_lost")

    id = models.CharField(primary_key=True, max_length=32, default=sandbox_id, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="sandboxes", db_index=False)
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, db_index=False)
    host = models.ForeignKey(Host, null=True, blank=True, on_delete=models.PROTECT, related_name="sandboxes", db_index=False)
    engine_id = models.CharField(max_length=64, blank=True)
    launch = models.ForeignKey(
        Launch, null=True, blank=True, on_delete=models.CASCADE, related_name="sandboxes", db_index=False
    )
    launch_index = models.PositiveIntegerField(null=True, blank=True)
    # The memory group it is in on its host (its launch's memory_group_size), and that group's limit.
    memory_group = models.CharField(max_length=40, blank=True)
    memory_group_mib = models.PositiveIntegerField(default=0)
    memory_group_cpu = models.FloatField(default=0.0)  # ... and that group's CPU quota in cores; 0: a quota each
    template = models.CharField(max_length=64)
    snapshot = models.ForeignKey(
        Snapshot, null=True, blank=True, on_delete=models.PROTECT, related_name="sandboxes", db_index=False
    )
    size = models.CharField(max_length=32)
    cpu = models.FloatField()
    memory_mib = models.PositiveIntegerField()
    disk_mib = models.PositiveIntegerField(default=0)  # its disk, when not its size's own (0)
    ttl_s = models.PositiveIntegerField()
    # Destroyed by its engine after this many seconds without an exec or a file call; 0: never.
    idle_timeout_s = models.PositiveIntegerField(default=0)
    network_policy = models.ForeignKey(NetworkPolicy, null=True, blank=True, on_delete=models.SET_NULL, db_index=False)
    # Destroyed once this lease is over (its heartbeats stopped, or its client ended it).
    lease = models.ForeignKey(Lease, null=True, blank=True, on_delete=models.SET_NULL, related_name="sandboxes", db_index=False)
    # Handed to the engine at create, then cleared: it may hold secrets, so it is stored sealed.
    env = SealedJSONField(default=dict, blank=True)
    labels = models.JSONField(default=dict)
    idempotency_key = models.CharField(max_length=255, null=True, blank=True)
    state = models.CharField(max_length=10, choices=State.choices, default=State.QUEUED)
    error_code = models.CharField(max_length=64, blank=True)
    error_message = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    ready_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            # Idempotency is a unique constraint, not a check in Python.
            models.UniqueConstraint(
                fields=["team", "idempotency_key"],
                condition=models.Q(idempotency_key__isnull=False),
                name="unique_sandbox_key_per_team",
            ),
            # A replayed launch dispatch cannot make a sandbox twice.
            models.UniqueConstraint(
                fields=["launch", "launch_index"], condition=models.Q(launch__isnull=False), name="unique_launch_index"
            ),
        ]
        indexes = [
            models.Index(fields=["team", "state"]),
            models.Index(fields=["host", "state"]),
            models.Index(fields=["launch", "state"]),
            models.Index(fields=["team", "created_at"]),
            models.Index(fields=["updated_at"]),  # the board ticker reads what just changed
            # The rest of the foreign keys, for their lookups and their deletes' cascades. Not the keys'
            # own index (team, host, launch: the pairs above lead with them), and no second one for LIKE
            # (Django's varchar_pattern_ops on PostgreSQL; nothing matches ids by pattern): a sandbox's
            # row moves three or four times in its life, and each move wrote every index of the table.
            models.Index(fields=["api_key"]),
            models.Index(fields=["snapshot"]),
            models.Index(fields=["network_policy"]),
            models.Index(fields=["lease"]),
        ]

    @property
    def live(self) -> bool:
        return self.state in self.LIVE

    @property
    def reachable(self) -> bool:
        """Running or paused on a host whose engine has recorded it: something to exec in."""
        return self.state in self.STARTED and bool(self.engine_id) and self.host_id is not None


class ExposedPort(models.Model):
    """A sandbox's TCP port reachable at a preview URL (``console/preview.py``); it closes with its sandbox."""

    class Auth(models.TextChoices):
        KEY = "key"  # the team's API key in a header
        TOKEN = "token"  # a signed URL that expires
        PUBLIC = "public"  # nothing

    id = models.CharField(primary_key=True, max_length=32, default=port_id, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="exposed_ports")
    sandbox = models.ForeignKey(Sandbox, on_delete=models.CASCADE, related_name="exposed_ports")
    port = models.PositiveIntegerField()
    auth = models.CharField(max_length=8, choices=Auth.choices)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["sandbox", "port"], name="unique_exposed_port")]
        indexes = [models.Index(fields=["team", "sandbox"])]

    def __str__(self) -> str:
        return f"{self.sandbox_id}:{self.port}"


class BoardLease(models.Model):
    """Which web process runs the board's ticker (one at a time, by lease)."""

    name = models.CharField(primary_key=True, max_length=32)
    holder = models.CharField(max_length=64)
    expires_at = models.DateTimeField()
