"""Database work from async views.

``sync_to_async`` defaults to one "thread-sensitive" thread, which Django's
ASGI handler makes anew for every request: every request would then open (and
close) its own database connection.  Our database calls need no thread
affinity, so they run on asgiref's shared pool, whose threads keep their
connections between requests (CONN_MAX_AGE).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from asgiref.sync import sync_to_async

T = TypeVar("T")


def db(function: Callable[..., T]) -> Callable[..., Any]:
    return sync_to_async(function, thread_sensitive=False)
