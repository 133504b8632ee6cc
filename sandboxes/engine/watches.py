"""Watching a directory of a sandbox: its changes as events, bounded, never holding the engine.

One inotify instance serves every watch of the engine (the kernel limits
instances per user to a few hundred, and the engine is one user for every
sandbox), read on the event loop as it becomes readable, a bounded read at a
time.  A watch:

1. resolves its directory in the sandbox's root as every file call does
   (``Tree.open``: ``RESOLVE_IN_ROOT``, no magic links, no other mounts,
   ``O_DIRECTORY``), in a worker thread, then adds the inotify watch on
   *that* directory (through the handle's ``/proc/self/fd`` link, so no name
   is looked up again) with ``IN_ONLYDIR``;
2. gets each event for its directory into a queue of its own, bounded
   (``MAX_QUEUED``): past it, events are counted, not kept, and the next
   event it hands out is ``overflow`` with that count.  The kernel's own
   queue overflowing (``IN_Q_OVERFLOW``, shared by every watch) is reported
   the same way to every watch;
3. ends when its caller hangs up, its ``timeout_s`` passes, its directory is
   deleted or moved away or unmounted (``IN_IGNORED``, ``IN_DELETE_SELF``,
   ``IN_MOVE_SELF``), or the sandbox stops running.

Events: ``created``, ``modified``, ``attributes``, ``deleted``,
``moved_from``/``moved_to`` (with the ``cookie`` that pairs them), each with
the entry's ``name`` (as the sandbox wrote it: any bytes, invalid UTF-8
shown as U+FFFD) and ``is_dir``.  A sandbox writing as fast as it can costs
the engine one bounded read per turn of its loop and a watch at most
``MAX_QUEUED`` events held.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import os
from typing import Any

from inotify_simple import INotify, parse_events
from inotify_simple import flags as inotify_flags

from .errors import InvalidPath, NoCapacity
from .trees import display_name

MAX_QUEUED = 1024  # events held per watch before they are counted as dropped
MAX_WATCHES = 4096  # watches open at once, per engine
READ_BYTES = 64 * 1024  # one read per turn of the loop: whole events, at most this many bytes

_KINDS = (
    (inotify_flags.CREATE, "created"),
    (inotify_flags.MODIFY, "modified"),
    (inotify_flags.ATTRIB, "attributes"),
    (inotify_flags.DELETE, "deleted"),
    (inotify_flags.MOVED_FROM, "moved_from"),
    (inotify_flags.MOVED_TO, "moved_to"),
)
_ENDS = inotify_flags.IGNORED | inotify_flags.DELETE_SELF | inotify_flags.MOVE_SELF | inotify_flags.UNMOUNT
MASK = 0
for _flag, _ in _KINDS:
    MASK |= _flag
MASK |= inotify_flags.DELETE_SELF | inotify_flags.MOVE_SELF | inotify_flags.ONLYDIR


class Watch:
    """One caller's watch: a bounded queue of its directory's events."""

    def __init__(self, watches: Watches, descriptor: int, path: str) -> None:
        self.watches = watches
        self.descriptor = descriptor
        self.path = path
        self.queue: collections.deque[dict[str, Any]] = collections.deque()
        self.dropped = 0  # events not kept since the last overflow event
        self.ended: str | None = None  # why the directory's watch ended (deleted, moved, unmounted)
        self.ready = asyncio.Event()

    def add(self, event: dict[str, Any]) -> None:
        if len(self.queue) >= MAX_QUEUED:
            self.dropped += 1
        else:
            self.queue.append(event)
        self.ready.set()

    def overflowed(self, count: int = 1) -> None:
        self.dropped += count
        self.ready.set()

    def end(self, reason: str) -> None:
        if self.ended is None:
            self.ended = reason
        self.ready.set()

    def take(self) -> list[dict[str, Any]]:
        """What is queued, an ``overflow`` event first if anything was dropped."""
        events = []
        if self.dropped:
            events.append({"type": "overflow", "dropped": self.dropped})
            self.dropped = 0
        events.extend(self.queue)
        self.queue.clear()
        self.ready.clear()
        return events

    def close(self) -> None:
        self.watches.remove(self)


class Watches:
    """The engine's inotify instance and the watches on it (used on the event loop only)."""

    def __init__(self) -> None:
        self.inotify: INotify | None = None
        self.by_descriptor: dict[int, set[Watch]] = {}
        self.count = 0

    def add(self, directory_fd: int, path: str) -> Watch:
        """Watch the directory ``directory_fd`` (an fd resolved in the sandbox's root; the caller closes it)."""
        if self.count >= MAX_WATCHES:
            raise NoCapacity(f"the engine holds {MAX_WATCHES} watches already: try again later", limit=MAX_WATCHES)
        if self.inotify is None:
            self.inotify = INotify(nonblocking=True)
            asyncio.get_running_loop().add_reader(self.inotify.fileno(), self._read)
        try:
            descriptor = self.inotify.add_watch(f"/proc/self/fd/{directory_fd}", MASK)
        except OSError as error:
            if error.errno == errno.ENOTDIR:
                raise InvalidPath(f"{path} is not a directory: watch a directory", path=path) from None
            if error.errno == errno.ENOSPC:
                raise NoCapacity("the host's inotify watches are all in use: try again later") from None
            raise InvalidPath(f"{path} cannot be watched: {os.strerror(error.errno or errno.EIO)}", path=path) from None
        watch = Watch(self, descriptor, path)
        self.by_descriptor.setdefault(descriptor, set()).add(watch)
        self.count += 1
        return watch

    def remove(self, watch: Watch) -> None:
        holders = self.by_descriptor.get(watch.descriptor)
        if holders is None or watch not in holders:
            return
        holders.discard(watch)
        self.count -= 1
        if not holders:
            # Not yet ignored by the kernel (that removes the entry): ours to remove.
            del self.by_descriptor[watch.descriptor]
            if self.inotify is not None:
                try:
                    self.inotify.rm_watch(watch.descriptor)
                except OSError:
                    pass  # the kernel ended it meanwhile (its IN_IGNORED is on its way)

    def _read(self) -> None:
        assert self.inotify is not None
        try:
            data = os.read(self.inotify.fileno(), READ_BYTES)
        except BlockingIOError:
            return
        for event in parse_events(data):
            if event.mask & inotify_flags.Q_OVERFLOW:
                for holders in self.by_descriptor.values():
                    for watch in holders:
                        watch.overflowed()
                continue
            watchers = self.by_descriptor.get(event.wd)
            if not watchers:
                continue
            if event.mask & _ENDS:
                reason = (
                    "deleted"
                    if event.mask & inotify_flags.DELETE_SELF
                    else "moved"
                    if event.mask & inotify_flags.MOVE_SELF
                    else "unmounted"
                )
                for watch in watchers:
                    watch.end(reason)
                if event.mask & inotify_flags.IGNORED:
                    self.by_descriptor.pop(event.wd, None)
                    self.count -= len(watchers)
                continue
            kind = next((name for flag, name in _KINDS if event.mask & flag), None)
            if kind is None:
                continue
            message: dict[str, Any] = {
                "type": kind,
                "name": display_name(event.name),
                "is_dir": bool(event.mask & inotify_flags.ISDIR),
            }
            if event.cookie:
                message["cookie"] = event.cookie
            for watch in watchers:
                watch.add(message)

    def close(self) -> None:
        if self.inotify is not None:
            try:
                asyncio.get_running_loop().remove_reader(self.inotify.fileno())
            except RuntimeError:
                pass
            self.inotify.close()
            self.inotify = None
        self.by_descriptor.clear()
        self.count = 0
