"""Database work from async views.

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
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.db import connections

P = ParamSpec("P")
T = TypeVar("T")


def _recycle_connections() -> None:
    for connection in connections.all(initialized_only=True):
        connection.close_if_unusable_or_obsolete()


def db(function: Callable[P, T]) -> Callable[P, Awaitable[T]]:
    @functools.wraps(function)
    def checked(*args: P.args, **kwargs: P.kwargs) -> T:
        _recycle_connections()
        return function(*args, **kwargs)

    return sync_to_async(checked, thread_sensitive=False)
