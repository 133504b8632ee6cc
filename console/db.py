"""Database work from async views, and turns for SQLite's one writer.

``sync_to_async`` defaults to one "thread-sensitive" thread, which Django's
ASGI handler makes anew for every request: every request would then open (and
close) its own database connection.  Our database calls need no thread
affinity, so they run on asgiref's shared pool, whose threads keep their
connections between requests (CONN_MAX_AGE).

Django checks and recycles connections at the start and end of a request,
in the request's own thread: never in these.  So each call does it first: a
connection that failed (the database restarted, a backend was terminated) is
dropped and the call opens a new one, instead of failing for as long as the
thread lives.  Without an error behind it the check costs no query.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.db import connection, connections, models
from django.db.models import Model

P = ParamSpec("P")
T = TypeVar("T")


def _recycle_connections() -> None:
    for each in connections.all(initialized_only=True):
        each.close_if_unusable_or_obsolete()


def db(function: Callable[P, T]) -> Callable[P, Awaitable[T]]:
    @functools.wraps(function)
    def checked(*args: P.args, **kwargs: P.kwargs) -> T:
        _recycle_connections()
        return function(*args, **kwargs)

    return sync_to_async(checked, thread_sensitive=False)


# Work a request started and does not wait for (a teardown's records): two threads of its own. On the
# shared pool (a few threads on a small host) a teardown of thousands, each chunk's write waiting its
# turn for SQLite's one writer, held every thread and left requests waiting minutes for one.
_background = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fy-background")


def db_background(function: Callable[P, T]) -> Callable[P, Awaitable[T]]:
    """As :func:`db`, on the background pool: for database work no request is waiting for."""

    @functools.wraps(function)
    async def run(*args: P.args, **kwargs: P.kwargs) -> T:
        def checked() -> T:
            _recycle_connections()
            return function(*args, **kwargs)

        return await asyncio.get_running_loop().run_in_executor(_background, checked)

    return run


def truncate_write_ahead_log() -> None:
    """SQLite: copy the write-ahead log into the database and cut the log to nothing, so that what it
    held of values since cleared (a sandbox's env) goes with it.  A no-op elsewhere, and when busy."""
    if connection.vendor == "sqlite":
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")


_sqlite_writer = threading.Lock()


@contextmanager
def one_writer() -> Iterator[None]:
    """Around a write transaction that threads of one process run side by side.

    On SQLite this process's threads take turns for the write lock here, in
    order; left to SQLite's busy handler, which sleeps up to 100 ms between
    tries, a writer among several could wait seconds (and the board's pixels
    with it). Other databases lock rows, not the file: no turn-taking."""
    if connection.vendor != "sqlite":
        yield
        return
    with _sqlite_writer:
        yield


def update_each(model: type[Model], fields: Sequence[str], rows: Sequence[tuple[Any, Sequence[Any]]]) -> None:
    """Many rows updated, each with its own values of ``fields``: ``rows`` are (primary key, values).

    One parametrised UPDATE run for every row (the driver's executemany: a
    loop in C on SQLite, a pipeline on PostgreSQL), in place of
    ``bulk_update``'s one statement with a CASE per field, whose building in
    Python cost a worker more than the rest of a launch's record (see
    docs/benchmarks.md). Values go through each field's own conversion, as
    the ORM's would; the caller holds the rows (locked, or SQLite's one
    writer) and knows they may move."""
    if not rows:
        return
    meta = model._meta
    columns = [field for field in (meta.get_field(name) for name in fields) if isinstance(field, models.Field)]
    if len(columns) != len(fields) or meta.pk is None:
        raise ValueError(f"not columns of {meta.label}: {fields}")
    quote = connection.ops.quote_name
    sets = ", ".join(f"{quote(str(field.column))} = %s" for field in columns)
    statement = f"UPDATE {quote(meta.db_table)} SET {sets} WHERE {quote(str(meta.pk.column))} = %s"
    params = [
        [field.get_db_prep_save(value, connection) for field, value in zip(columns, values, strict=True)] + [pk]
        for pk, values in rows
    ]
    with connection.cursor() as cursor:
        cursor.executemany(statement, params)


def insert_each(model: type[Model], rows: Sequence[dict[str, Any] | Model]) -> int:
    """Many new rows in one parametrised INSERT run for each (the driver's executemany), skipping a row a
    unique constraint already holds (``ON CONFLICT DO NOTHING``, as ``bulk_create(ignore_conflicts=True)``);
    how many went in.

    ``bulk_create`` builds one statement with a placeholder per value in
    Python, which cost a worker's launch record more than its other queries
    (docs/benchmarks.md). A row is a dict of field names or a model instance
    not saved yet; every column a dict leaves out gets its field's default,
    and values go through each field's own conversion, as the ORM's would;
    the model's ``save()`` is not called."""
    if not rows:
        return 0
    meta = model._meta
    columns = [field for field in meta.concrete_fields if field is not meta.auto_field]
    names = {field.attname for field in columns} | {field.name for field in columns}
    unknown = {name for row in rows if isinstance(row, dict) for name in row} - names
    if unknown:
        raise ValueError(f"not columns of {meta.label}: {sorted(unknown)}")
    quote = connection.ops.quote_name
    statement = (
        f"INSERT INTO {quote(meta.db_table)} ({', '.join(quote(str(field.column)) for field in columns)}) "
        f"VALUES ({', '.join(['%s'] * len(columns))}) ON CONFLICT DO NOTHING"
    )

    def value(field: models.Field[Any, Any], row: dict[str, Any] | Model) -> Any:
        if isinstance(row, Model):
            given = getattr(row, field.attname)
        elif field.attname in row:
            given = row[field.attname]
        elif field.name in row:
            given = row[field.name]
            given = given.pk if isinstance(given, Model) else given
        else:
            given = field.get_default()
        return field.get_db_prep_save(given, connection)

    with connection.cursor() as cursor:
        cursor.executemany(statement, [[value(field, row) for field in columns] for row in rows])
        count: int = cursor.rowcount
        return max(0, count)
