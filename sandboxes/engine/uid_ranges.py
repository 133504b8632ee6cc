"""Host uid ranges: one for each sandbox, never two at once, reused only once nothing of the last is left.

Root inside a sandbox is an unprivileged host uid, the first of a range of
``uid_count`` ids (``uid_base + n * uid_count``, n >= 1).  The kernel keeps
several counts per host uid (pipe buffers, epoll watches, locked memory) and
per owner of a user namespace (inotify instances, message queue bytes,
pending signals, user namespaces): when every sandbox's root was the same
host uid and every sandbox's user namespace was owned by host root, one
sandbox holding 128 inotify instances made ``inotify_init1`` fail in every
other sandbox, and for host root itself.  A range of its own, and a user
namespace owned by it (native/zygote.c), give each sandbox counts of its own.

Range 0 (``uid_base`` itself) owns the template and snapshot layers on disk
(each sandbox sees them through idmapped mounts) and is no sandbox's:
sandboxes an older engine made run in it and keep it until they go.

A range is *held* from the create that claims it until its sandbox's cgroup
is gone: nothing in a sandbox can leave its cgroup, and the kernel removes a
cgroup only once no process is left in it, so a cgroup gone means no process
of the sandbox can still hold the range.  A sandbox whose cgroup could not be
removed keeps its range (the engine tries again later).  Then the range
*cools* for ``cooldown_s``: some of a dead sandbox's kernel objects (its IPC
namespace with its message queues, its user namespaces) are freed by kernel
workers after its last process.  Then it is *free*; the lowest free range is
handed out first.

Nothing here is stored: every sandbox's record names its range (tombstones
too), and at start :meth:`UidRanges.rebuild` makes the same picture again from
the records and the cgroups that exist (recovery.py has run by then: what it
killed was killed just now, and cools from now).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

# Host uids no sandbox range may overlap: systemd's DynamicUser= services run
# as uids it allocates from this block.
RESERVED_HOST_UIDS = ((0x7FFE0000, 0x7FFEFFFF),)
LAST_HOST_UID = 2**32 - 2  # (uid_t)-1 is no uid


@dataclass(frozen=True)
class RangeRecord:
    """What rebuilding needs of a sandbox's record."""

    sandbox_id: str
    root_uid: int
    live: bool  # the engine holds the sandbox (adopted, or being created)
    cgroup_exists: bool
    ended_at: float


class UidRanges:
    """The ranges in use, cooling and free.  Single-threaded: the engine's loop owns it."""

    def __init__(self, base: int, count: int, ranges: int = 0, cooldown_s: float = 60.0) -> None:
        if count <= 0 or base < 0:
            raise ValueError("uid_base and uid_count must be positive")
        fits = (LAST_HOST_UID + 1 - base) // count - 1  # ranges 1..fits end at or below LAST_HOST_UID
        self.base = base
        self.count = count
        self.last = min(ranges, fits) if ranges > 0 else fits
        self.cooldown_s = cooldown_s
        self.held: dict[int, str] = {}  # index -> sandbox id
        self._cooling: list[tuple[float, int]] = []  # (free from, index), a heap
        self._cooling_set: set[int] = set()
        self._free: list[int] = []  # a heap: released, cooled ranges below _fresh
        self._fresh = 1  # every index from here on has not been handed out since start
        self._reserved = sum(max(0, min(self.last, (high - base) // count) - max(1, -(-(low - base - count + 1) // count)) + 1)
                             for low, high in RESERVED_HOST_UIDS)  # fmt: skip

    # --- numbers --------------------------------------------------------------------

    def host_uid(self, index: int) -> int:
        return self.base + index * self.count

    def index_of(self, host_uid: int) -> int | None:
        """The range whose root is ``host_uid``; None for range 0 or no range of ours."""
        offset = host_uid - self.base
        if offset <= 0 or offset % self.count:
            return None
        index = offset // self.count
        return index if index <= self.last else None

    def _usable(self, index: int) -> bool:
        first, end = self.host_uid(index), self.host_uid(index) + self.count - 1
        return not any(first <= high and low <= end for low, high in RESERVED_HOST_UIDS)

    # --- handing out and taking back ---------------------------------------------------------

    def claim(self, sandbox_id: str, now: float) -> int | None:
        """The root uid of a range for ``sandbox_id`` (the lowest free one), or None if none is free."""
        self._rested(now)
        if self._free:
            index = heapq.heappop(self._free)
        else:
            while self._fresh <= self.last and not self._usable(self._fresh):
                self._fresh += 1
            if self._fresh > self.last:
                return None
            index = self._fresh
            self._fresh += 1
        self.held[index] = sandbox_id
        return self.host_uid(index)

    def release(self, root_uid: int, sandbox_id: str, now: float) -> bool:
        """The sandbox's cgroup is gone: its range cools, then is free.  Only
        its holder releases it (a stale release changes nothing)."""
        index = self.index_of(root_uid)
        if index is None or self.held.get(index) != sandbox_id:
            return False
        del self.held[index]
        self._cool(index, now + self.cooldown_s)
        return True

    def _rested(self, now: float) -> None:
        """Ranges whose rest is over are free."""
        while self._cooling and self._cooling[0][0] <= now:
            _, index = heapq.heappop(self._cooling)
            self._cooling_set.discard(index)
            heapq.heappush(self._free, index)

    def _cool(self, index: int, until: float) -> None:
        heapq.heappush(self._cooling, (until, index))
        self._cooling_set.add(index)

    def holder(self, root_uid: int) -> str | None:
        index = self.index_of(root_uid)
        return self.held.get(index) if index is not None else None

    # --- at start ------------------------------------------------------------------------------

    def rebuild(self, records: list[RangeRecord], now: float) -> None:
        """From every record that names a range (tombstones included): held if
        its sandbox is live or its cgroup exists, cooling if it ended less
        than ``cooldown_s`` ago, free otherwise."""
        self.held.clear()
        self._cooling.clear()
        self._cooling_set.clear()
        cooling: dict[int, float] = {}
        highest = 0
        for record in records:
            index = self.index_of(record.root_uid)
            if index is None:
                continue
            highest = max(highest, index)
            if record.live or record.cgroup_exists:
                self.held[index] = record.sandbox_id
            elif record.ended_at + self.cooldown_s > now:
                cooling[index] = max(cooling.get(index, 0.0), record.ended_at + self.cooldown_s)
        for index, until in cooling.items():
            if index not in self.held:
                self._cool(index, until)
        self._fresh = highest + 1
        self._free = [
            index
            for index in range(1, self._fresh)
            if index not in self.held and index not in self._cooling_set and self._usable(index)
        ]
        heapq.heapify(self._free)

    def status(self, now: float | None = None) -> dict[str, int]:
        if now is not None:
            self._rested(now)
        cooling = len(self._cooling_set)
        return {
            "held": len(self.held),
            "cooling": cooling,
            "free": self.last - self._reserved - len(self.held) - cooling,
            "ranges": self.last - self._reserved,
        }
