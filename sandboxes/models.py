"""The control plane's records of hosts, templates, sandboxes, launches, snapshots and network policies.

The engine on each host is the authority on what runs there; these rows are
what the API promises and bills.  Reconciliation keeps the two in step.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from console.models import ApiKey, Team, public_id


def sandbox_id() -> str:
    return public_id("sb")


def launch_id() -> str:
    return public_id("launch")


def snapshot_id() -> str:
    return public_id("snap")


def policy_id() -> str:
    return public_id("net")


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
    engine_sandboxes = models.PositiveIntegerField(default=0)  # as the engine last reported (pooled included)
    committed_memory_mib = models.PositiveBigIntegerField(default=0)
    engine_version = models.CharField(max_length=32, blank=True)
    registered_at = models.DateTimeField(default=timezone.now)
    last_heartbeat = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return self.name


class Template(models.Model):
    """A root filesystem sandboxes start from; global unless it names a team."""

    name = models.CharField(max_length=64)
    team = models.ForeignKey(Team, null=True, blank=True, on_delete=models.CASCADE, related_name="templates")
    description = models.CharField(max_length=255, blank=True)
    size_bytes = models.PositiveBigIntegerField(default=0)
    layers = models.JSONField(default=list)
    hosts = models.ManyToManyField(Host, blank=True, related_name="templates")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["name"], condition=models.Q(team__isnull=True), name="unique_global_template")
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
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "name"], name="unique_policy_name_per_team")]


class Snapshot(models.Model):
    """A sandbox's filesystem saved as a layer (and the services its forks start).

    In the engine a snapshot is a template named by this row's id.  The row is
    never removed: a deleted snapshot keeps its row (``deleted``) so that its
    billed GiB-hours and the sandboxes forked from it still name it.
    """

    class State(models.TextChoices):
        CREATING = "creating"
        READY = "ready"
        DELETING = "deleting"
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
    ttl_s = models.PositiveIntegerField()
    count = models.PositiveIntegerField()
    labels = models.JSONField(default=dict)
    network_policy = models.ForeignKey(NetworkPolicy, null=True, blank=True, on_delete=models.SET_NULL)
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

    LIVE = (State.QUEUED, State.CREATING, State.RUNNING, State.PAUSED, State.STOPPING)

    id = models.CharField(primary_key=True, max_length=32, default=sandbox_id, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="sandboxes")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL)
    host = models.ForeignKey(Host, null=True, blank=True, on_delete=models.PROTECT, related_name="sandboxes")
    engine_id = models.CharField(max_length=64, blank=True)
    launch = models.ForeignKey(Launch, null=True, blank=True, on_delete=models.CASCADE, related_name="sandboxes")
    launch_index = models.PositiveIntegerField(null=True, blank=True)
    template = models.CharField(max_length=64)
    snapshot = models.ForeignKey(Snapshot, null=True, blank=True, on_delete=models.PROTECT, related_name="sandboxes")
    size = models.CharField(max_length=32)
    cpu = models.FloatField()
    memory_mib = models.PositiveIntegerField()
    ttl_s = models.PositiveIntegerField()
    network_policy = models.ForeignKey(NetworkPolicy, null=True, blank=True, on_delete=models.SET_NULL)
    # Handed to the engine at create, then cleared: it may hold secrets.
    env = models.JSONField(default=dict)
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
        ]

    @property
    def live(self) -> bool:
        return self.state in self.LIVE


class BoardLease(models.Model):
    """Which web process runs the board's ticker (one at a time, by lease)."""

    name = models.CharField(primary_key=True, max_length=32)
    holder = models.CharField(max_length=64)
    expires_at = models.DateTimeField()
