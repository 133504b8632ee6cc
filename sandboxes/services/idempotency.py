"""Creates that happen once per idempotency key, decided by the database.

A create carries an optional ``idempotency_key``; the team's rows of that
model have a unique constraint on (team, key).  A retry finds the first row
(``replay_of``, before anything is checked again), and two racing creates
with one key cannot both insert (``insert_once``): the loser gets the
winner's row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from django.db import IntegrityError, models, transaction

from console.models import Team

Row = TypeVar("Row", bound=models.Model)


def replay_of(model: type[Row], team: Team, idempotency_key: str | None, related: tuple[str, ...] = ()) -> Row | None:
    """The team's row already made with this key, if any (with its ``related`` rows loaded)."""
    if not idempotency_key:
        return None
    return model._default_manager.select_related(*related).filter(team=team, idempotency_key=idempotency_key).first()


def insert_once(
    model: type[Row],
    *,
    team: Team,
    idempotency_key: str | None,
    before: Callable[[], Any] | None = None,
    related: tuple[str, ...] = (),
    **fields: Any,
) -> tuple[Row, bool]:
    """Insert a row (``before`` runs first, in the same transaction), or return the one a racing create
    with the same key inserted; (row, inserted)."""
    try:
        with transaction.atomic():
            if before is not None:
                before()
            return model._default_manager.create(team=team, idempotency_key=idempotency_key or None, **fields), True
    except IntegrityError:
        existing = replay_of(model, team, idempotency_key, related)
        if existing is None:
            raise
        return existing, False
