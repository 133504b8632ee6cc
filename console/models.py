"""Accounts: teams, memberships with roles, invitations, API keys and limits."""

from __future__ import annotations

import secrets
from datetime import timedelta

from django.conf import settings
from django.db import models
from django.utils import timezone


def public_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


def team_id() -> str:
    return public_id("team")


def key_id() -> str:
    return public_id("key")


class Role(models.TextChoices):
    OWNER = "owner", "Owner"
    ADMIN = "admin", "Admin"
    MEMBER = "member", "Member"


ROLE_RANK = {Role.MEMBER: 0, Role.ADMIN: 1, Role.OWNER: 2}


class Team(models.Model):
    id = models.CharField(primary_key=True, max_length=32, default=team_id, editable=False)
    name = models.CharField(max_length=100)
    slug = models.SlugField(max_length=60, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    # Content (exec output, files, grading prompts) is never kept unless a
    # team asks; then for at most 30 days.
    retain_content_days = models.PositiveSmallIntegerField(default=0)

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "user"], name="one_membership_per_user_and_team")]

    def can(self, role: str) -> bool:
        return ROLE_RANK[Role(self.role)] >= ROLE_RANK[Role(role)]


def _invitation_token() -> str:
    return secrets.token_urlsafe(24)


def _in_a_week():  # type: ignore[no-untyped-def]
    return timezone.now() + timedelta(days=7)


class Invitation(models.Model):
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="invitations")
    email = models.EmailField()
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.MEMBER)
    token = models.CharField(max_length=64, unique=True, default=_invitation_token)
    invited_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(default=_in_a_week)
    accepted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["team", "email"], condition=models.Q(accepted_at__isnull=True), name="one_open_invitation_per_email"
            )
        ]


class ApiKey(models.Model):
    """A team's key.  The secret is shown once; we keep a prefix and an HMAC of it."""

    id = models.CharField(primary_key=True, max_length=32, default=key_id, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)
    digest = models.CharField(max_length=64)
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.ADMIN)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Narrower than its role (console/permissions.py): the resources it may use, each "<resource>" or
    # "<resource>:read"; empty: everything its role allows.
    scopes = models.JSONField(default=list, blank=True)
    # Only sandboxes, launches and snapshots carrying all of these labels; its creates get them. Empty: any.
    label_limit = models.JSONField(default=dict, blank=True)
    rotated_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix})"

    @property
    def active(self) -> bool:
        now = timezone.now()
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)


class TeamLimits(models.Model):
    """Per-team limits, editable by an operator (Django admin)."""

    team = models.OneToOneField(Team, on_delete=models.CASCADE, related_name="limits", primary_key=True)
    # RL loops exec thousands of commands a second across their sandboxes.
    requests_per_second = models.PositiveIntegerField(default=2000)
    burst = models.PositiveIntegerField(default=4000)
    max_sandboxes = models.PositiveIntegerField(default=1000)
    max_launch_count = models.PositiveIntegerField(default=40000)
    max_ttl_s = models.PositiveIntegerField(default=24 * 3600)

    class Meta:
        verbose_name_plural = "team limits"


def audit_id() -> str:
    return public_id("audit")


class AuditEntry(models.Model):
    """Who (a member or a key) did what to which object of a team, when, and from where.

    Written by the service that made the change, in its transaction (``console.audit``): an
    entry exists exactly when its change does.  The actor's and the object's names are copied,
    so an entry still reads after the key or the member is gone.
    """

    class Act(models.TextChoices):
        KEY_CREATED = "key.created"
        KEY_RENAMED = "key.renamed"
        KEY_ROTATED = "key.rotated"
        KEY_REVOKED = "key.revoked"
        KEY_DELETED = "key.deleted"
        MEMBER_INVITED = "member.invited"
        INVITATION_RESENT = "invitation.resent"
        INVITATION_REVOKED = "invitation.revoked"
        MEMBER_JOINED = "member.joined"
        MEMBER_ROLE_CHANGED = "member.role_changed"
        MEMBER_REMOVED = "member.removed"
        POLICY_CREATED = "policy.created"
        POLICY_CHANGED = "policy.changed"
        POLICY_DELETED = "policy.deleted"
        LAUNCH_STARTED = "launch.started"
        LAUNCH_TORN_DOWN = "launch.torn_down"
        BUDGET_CREATED = "budget.created"
        BUDGET_CHANGED = "budget.changed"
        BUDGET_DELETED = "budget.deleted"
        BUDGET_REACHED = "budget.reached"
        RETENTION_CHANGED = "retention.changed"

    id = models.CharField(primary_key=True, max_length=32, default=audit_id, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="audit_entries")
    at = models.DateTimeField(default=timezone.now)
    action = models.CharField(max_length=32, choices=Act.choices)
    actor_user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    actor_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    actor = models.CharField(max_length=200)  # "user alice", "key trainer (key_…)", "forkyard" (the system)
    target_type = models.CharField(max_length=32)
    target_id = models.CharField(max_length=64, blank=True)
    target = models.CharField(max_length=200, blank=True)  # the object's name when it was done
    details = models.JSONField(default=dict, blank=True)
    address = models.CharField(max_length=64, blank=True)  # where the request came from

    class Meta:
        indexes = [
            models.Index(fields=["team", "at"]),
            models.Index(fields=["team", "action", "at"]),
            models.Index(fields=["team", "target_id"]),
        ]
        verbose_name_plural = "audit entries"


class ChannelMessage(models.Model):
    """A message in flight on the embedded channel layer (see channel_layer.py)."""

    channel = models.CharField(max_length=200, db_index=True)
    body = models.TextField()
    expires_at = models.FloatField(db_index=True)


class ChannelGroupMember(models.Model):
    group = models.CharField(max_length=200, db_index=True)
    channel = models.CharField(max_length=200)
    expires_at = models.FloatField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["group", "channel"], name="one_membership_per_group_channel")]
