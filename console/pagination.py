"""One way to page every list: keyset pages behind an opaque cursor.

A list is ordered by a few columns that end in a unique one (newest first:
``-created_at, -id``; a launch's sandboxes: ``launch_index``).  A page is the
first ``limit`` rows after the cursor, and the cursor handed out for the next
page names the last row's values of those columns.  A page costs one query
however deep it is, so a team holding 32,752 sandboxes pages as fast as one
holding three.

Cursors are opaque to callers (base64 of a JSON list).  The API refuses one
it did not give out (``strict``); the console starts the list over instead,
since a cursor there comes from a URL anyone can edit.  Cursors written by
earlier releases (``<value>|<value>``) are still read.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

from django.core.exceptions import ValidationError
from django.db.models import Field, Model, Q, QuerySet
from django.utils import timezone

from .errors import invalid, not_found

Row = TypeVar("Row", bound=Model)
NEWEST_FIRST = ("-created_at", "-id")
MAX_CURSOR = 512


@dataclass(frozen=True)
class Page(Generic[Row]):
    rows: list[Row]
    next_cursor: str | None


def _columns(order: tuple[str, ...]) -> list[tuple[str, bool]]:
    """(column, descending) for each ordering term."""
    return [(term.lstrip("-"), term.startswith("-")) for term in order]


def encode(row: Model, order: tuple[str, ...]) -> str:
    values = [getattr(row, column) for column, _ in _columns(order)]
    text = json.dumps([value.isoformat() if hasattr(value, "isoformat") else value for value in values])
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def decode(rows: QuerySet[Row], cursor: str, order: tuple[str, ...]) -> list[Any] | None:
    """The cursor's values, typed and checked as their columns are; None for anything this module did not write."""
    columns = _columns(order)
    if len(cursor) > MAX_CURSOR:
        return None
    try:
        raw = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (ValueError, binascii.Error):
        raw = cursor.split("|")  # an earlier release's cursor
    if not isinstance(raw, list) or len(raw) != len(columns):
        return None
    values = []
    for (column, _), given in zip(columns, raw, strict=True):
        field = rows.model._meta.get_field(column)
        assert isinstance(field, Field), f"{column} is a column"
        try:
            value = field.to_python(given)
            field.run_validators(value)  # e.g. no negative launch index, no id longer than an id
        except (ValidationError, TypeError, ValueError):
            return None
        if value in (None, "") or (isinstance(value, datetime) and timezone.is_naive(value)):
            return None
        values.append(value)
    return values


def _after(values: list[Any], order: tuple[str, ...]) -> Q:
    """Rows that come after ``values`` in this order: (a, b) > (x, y) spelled for the database."""
    columns = _columns(order)
    after = Q()
    for index, (column, descending) in enumerate(columns):
        step = Q(**{f"{column}__{'lt' if descending else 'gt'}": values[index]})
        for earlier in range(index):
            step &= Q(**{columns[earlier][0]: values[earlier]})
        after |= step
    return after


def keyset_page(
    rows: QuerySet[Row], *, cursor: str | None, limit: int, order: tuple[str, ...] = NEWEST_FIRST, strict: bool = True
) -> Page[Row]:
    """One page of ``rows`` after ``cursor``; ``strict``: a cursor we did not write is a 400, else the first page."""
    if cursor:
        values = decode(rows, cursor, order)
        if values is None and strict:
            raise invalid("cursor is not one this API gave out", field="cursor")
        if values is not None:
            rows = rows.filter(_after(values, order))
    page = list(rows.order_by(*order)[: limit + 1])
    if len(page) <= limit:
        return Page(page, None)
    return Page(page[:limit], encode(page[limit - 1], order))


def cursor_after(rows: QuerySet[Row], pk: str, kind: str, order: tuple[str, ...] = NEWEST_FIRST) -> str:
    """A cursor that continues after the row ``pk``: for lists paged by ``before=<id>`` in earlier releases."""
    row = rows.filter(pk=pk).first()
    if row is None:
        raise not_found(kind, pk, field="before")
    return encode(row, order)
