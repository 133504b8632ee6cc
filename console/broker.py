"""The embedded broker: kombu's filesystem transport, made safe for concurrent use.

Upstream writes each message straight into its final file name; a worker
polling the directory can pick the file up before it is written and crash on
an empty message.  Here a message is written under a temporary name (which the
reader ignores) and renamed into place: rename is atomic, so a reader sees a
whole message or none.

Upstream also polls: a consumer lists the directory, sleeps the polling
interval, lists it again.  Here a consumer waits on inotify for a message to
be renamed into the directory and looks at once, so a command reaches its
worker in well under a millisecond and an idle worker costs nothing; it still
looks every ``FALLBACK_S`` in case an event was missed (or inotify is
unavailable, when it polls like upstream).

Like every virtual transport, this one cannot return a message to the queue
when a worker dies holding it; forkyard's reconciliation re-queues sandboxes
whose commands were lost (see sandboxes.lifecycle.reconcile).
"""

from __future__ import annotations

import ctypes
import os
import select
import uuid
from queue import Empty
from time import monotonic
from typing import Any

from kombu.connection import Connection
from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    # Upstream's own signature; its stubs ignore the same mismatch with the abstract channel.
    def _put(self, queue: str, payload: dict[str, Any], **kwargs: Any) -> None:  # type: ignore[override]
        from time import monotonic

        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        temporary = os.path.join(self.data_folder_out, f".incoming-{uuid.uuid4()}")
        try:
            with open(temporary, "wb") as handle:
                handle.write(str_to_bytes(dumps(payload)))
            os.rename(temporary, final)
        except OSError as error:
            try:
                os.unlink(temporary)
            except OSError:
                pass
            raise ChannelError(f"Cannot add file {final!r} to directory") from error


IN_MOVED_TO = 0x00000080
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
FALLBACK_S = 0.5


class _Arrivals:
    """inotify on a directory: wait until something is renamed into it."""

    def __init__(self, directory: str) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if libc.inotify_add_watch(self.fd, os.fsencode(directory), IN_MOVED_TO) < 0:
            error = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(error, f"inotify_add_watch {directory}")

    def clear(self) -> None:
        try:
            while os.read(self.fd, 65536):
                pass
        except BlockingIOError:
            pass

    def wait(self, timeout: float) -> None:
        select.select([self.fd], [], [], max(0.0, timeout))

    def close(self) -> None:
        os.close(self.fd)


class Transport(filesystem.Transport):
    """A broker directory that disappears (or turns into something else) is a
    lost connection, which Celery survives by reconnecting, not a crash."""

    Channel = Channel
    connection_errors = filesystem.Transport.connection_errors + (OSError,)
    channel_errors = filesystem.Transport.channel_errors + (OSError,)
    _arrivals: _Arrivals | None = None
    _watching = False

    def _arrivals_for(self) -> _Arrivals | None:
        if not self._watching:
            self._watching = True
            assert self.client is not None  # a transport is made for its connection
            folder = (self.client.transport_options or {}).get("data_folder_in")
            try:
                self._arrivals = _Arrivals(folder) if folder else None
            except OSError:
                self._arrivals = None  # no inotify here: poll like upstream
        return self._arrivals

    # Upstream's virtual transport has this signature; its stubs ignore the same mismatch with the base transport.
    def drain_events(self, connection: Connection, timeout: float | None = None) -> None:  # type: ignore[override]
        arrivals = self._arrivals_for()
        if arrivals is None:
            return super().drain_events(connection, timeout)
        assert self.cycle is not None  # made in the transport's __init__
        started = monotonic()
        while True:
            arrivals.clear()  # before looking: whatever lands after this wakes the wait below
            try:
                self.cycle.get(self._deliver, timeout=timeout)
                return None
            except Empty:
                waited = monotonic() - started
                if timeout is not None and waited >= timeout:
                    raise TimeoutError() from None
                arrivals.wait(FALLBACK_S if timeout is None else min(FALLBACK_S, timeout - waited))

    def close_connection(self, connection: Connection) -> None:
        if self._arrivals is not None:
            self._arrivals.close()
            self._arrivals, self._watching = None, False
        super().close_connection(connection)


TRANSPORT_ALIASES["fyfs"] = "console.broker:Transport"
