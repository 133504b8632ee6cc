"""The embedded broker: kombu's filesystem transport, made safe for concurrent use.

Upstream writes each message straight into its final file name; a worker
polling the directory can pick the file up before it is written and crash on
an empty message.  Here a message is written under a temporary name (which the
reader ignores) and renamed into place: rename is atomic, so a reader sees a
whole message or none.

Like every virtual transport, this one cannot return a message to the queue
when a worker dies holding it; forkyard's reconciliation re-queues sandboxes
whose commands were lost (see sandboxes.lifecycle.reconcile).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
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
            raise filesystem.ChannelError(f"Cannot add file {final!r} to directory") from error


class Transport(filesystem.Transport):
    """A broker directory that disappears (or turns into something else) is a
    lost connection, which Celery survives by reconnecting, not a crash."""

    Channel = Channel
    connection_errors = filesystem.Transport.connection_errors + (OSError,)
    channel_errors = filesystem.Transport.channel_errors + (OSError,)


TRANSPORT_ALIASES["fyfs"] = "console.broker:Transport"
