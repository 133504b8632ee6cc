"""The audit log: who did what to which object of a team, when, and from where.

A service that makes a change worth auditing records it here, inside its own
transaction, so that an entry exists exactly when its change does.  The
caller says who acts (``Actor``: a signed-in member, an API key, or the
system itself) and from which address; entry points make one from their
request (``Actor.of``).  Reads are ``audit_page`` (the console's filters and
``GET /api/v1/audit``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.contrib.auth.models import AnonymousUser, User
from django.http import HttpRequest
from django.utils import timezone

from .models import ApiKey, AuditEntry, Team
from .pagination import Page, keyset_page

Act = AuditEntry.Act
ORDER = ("-at", "-id")


@dataclass(frozen=True)
class Actor:
    """Who acts: a member (``user``), a key, or neither (forkyard itself: a budget reached, say)."""

    user: User | None = None
    key: ApiKey | None = None
    address: str = ""

    @property
    def name(self) -> str:
        if self.key is not None:
            return f"key {self.key.name} ({self.key.id})"
        if self.user is not None:
            return f"user {self.user.username}"
        return "forkyard"

    @classmethod
    def of(cls, request: HttpRequest) -> Actor:
        """From a request: its API key if it carries one (the API), else its signed-in user (the console)."""
        address = str(request.META.get("REMOTE_ADDR", ""))[:64]
        key = getattr(request, "auth", None)
        if isinstance(key, ApiKey):
            return cls(key=key, address=address)
        user = getattr(request, "user", None)
        if isinstance(user, User) and not isinstance(user, AnonymousUser):
            return cls(user=user, address=address)
        return cls(address=address)


SYSTEM = Actor()


def audit_record(
    *,
    team: Team | str,
    actor: Actor | None,
    action: str,
    target_type: str,
    target_id: str = "",
    target: str = "",
    details: dict[str, Any] | None = None,
    at: datetime | None = None,
) -> AuditEntry:
    """One entry; call inside the transaction of the change it records."""
    actor = actor or SYSTEM
    return AuditEntry.objects.create(
        team_id=team if isinstance(team, str) else team.pk,
        at=at or timezone.now(),
        action=action,
        actor_user=actor.user,
        actor_key=actor.key,
        actor=actor.name[:200],
        target_type=target_type,
        target_id=str(target_id)[:64],
        target=str(target)[:200],
        details=details or {},
        address=actor.address,
    )


def audit_page(
    team: Team,
    *,
    cursor: str | None,
    limit: int,
    action: str | None = None,
    actor: str | None = None,
    target: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    strict: bool = True,
) -> Page[AuditEntry]:
    """Newest first, filtered: ``action`` an action or a family of them (``key``), ``actor`` part of who
    (a username, a key's name or id), ``target`` an object's id or part of its name."""
    rows = AuditEntry.objects.filter(team=team)
    if action:
        rows = rows.filter(action=action) if "." in action else rows.filter(action__startswith=f"{action}.")
    if actor:
        rows = rows.filter(actor__icontains=actor)
    if target:
        rows = rows.filter(target_id=target) | rows.filter(target__icontains=target)
    if since:
        rows = rows.filter(at__gte=since)
    if until:
        rows = rows.filter(at__lt=until)
    return keyset_page(rows, cursor=cursor, limit=limit, order=ORDER, strict=strict)


def started_by(team: Team, target_id: str) -> str | None:
    """Who made an object (the actor of its first entry), for pages that name it (the board's Tear down)."""
    entry = AuditEntry.objects.filter(team=team, target_id=target_id).order_by("at", "id").only("actor").first()
    return entry.actor if entry is not None else None
