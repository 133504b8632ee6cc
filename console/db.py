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

import functools
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.db import connection, connections

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
