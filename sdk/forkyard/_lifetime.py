"""Sandboxes that die with their client: a client's own lease, heartbeaten, and ended on exit.

``Client(lease=True)`` (or ``lease=LeaseOptions(grace_s=...)``) takes a lease
with its first create or launch, names it in every create and launch it
makes, heartbeats it every ``grace_s / 3`` (a thread; ``AsyncClient``: a
task), and ends it when the client closes: every sandbox it made goes.  A
client that dies without closing (SIGKILL, a lost machine) stops
heartbeating, and the server destroys its sandboxes ``grace_s`` later.

``kill_on_exit=True`` takes such a lease too, and ends it however the
process ends: at exit (normal, an uncaught exception, Ctrl-C's
``KeyboardInterrupt``) and on SIGTERM, whose handler ends the lease and then
does what the signal did before (by default: the process dies of it).

Without either, what a ``with`` block opened (a client, a sandbox, a launch)
is closed on SIGTERM as on Ctrl-C: while one is open in the main thread and
SIGTERM would otherwise kill the process outright, SIGTERM unwinds it
instead (``Unwinding``): the blocks close, killing what they made, and the
process then exits with 143, as a process killed by SIGTERM reports.
``AsyncClient``'s blocks do the same through the running loop: SIGTERM
cancels the task that entered the outermost one, as ``asyncio.run`` does
on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import threading
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any

from . import _calls as calls
from ._http import AsyncSender, RetryPolicy, Sender, Settings
from .errors import Conflict, ForkyardError, NotFound
from .models import Lease


@dataclass(frozen=True)
class LeaseOptions:
    """A client's own lease: ``grace_s`` (60) is how long its sandboxes outlive a client that went
    silent; it is heartbeaten every ``grace_s / 3``."""

    grace_s: int = 60

    @property
    def every_s(self) -> float:
        return self.grace_s / 3


def lease_options(lease: bool | LeaseOptions | None, kill_on_exit: bool) -> LeaseOptions | None:
    """The lease a client keeps, if any: ``kill_on_exit`` needs one (it is what it ends)."""
    if isinstance(lease, LeaseOptions):
        return lease
    return LeaseOptions() if lease or kill_on_exit else None


OVER = (NotFound, Conflict)  # a heartbeat's answer for a lease that is gone or over: stop beating


class LeaseKeeper:
    """A sync client's lease: taken on first use, heartbeaten from a daemon thread, ended by ``end()``."""

    def __init__(self, sender: Sender, options: LeaseOptions) -> None:
        self.sender, self.options = sender, options
        self.lease: Lease | None = None
        self.lost: ForkyardError | None = None  # why heartbeats stopped (the lease expired or was ended)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def lease_id(self) -> str:
        """The lease's id, taken now if this is the first create or launch."""
        with self._lock:
            if self.lease is None:
                self.lease = Lease.from_api(self.sender.json(calls.create_lease(grace_s=self.options.grace_s)))
                self._thread = threading.Thread(target=self._beat, name=f"forkyard-lease-{self.lease.id}", daemon=True)
                self._thread.start()
            return self.lease.id

    def _beat(self) -> None:
        while not self._stop.wait(self.options.every_s):
            lease = self.lease
            if lease is None:
                return  # ended meanwhile
            try:
                self.lease = Lease.from_api(self.sender.json(calls.heartbeat_lease(lease.id)))
            except OVER as error:
                self.lost = error
                return
            except ForkyardError:
                continue  # a blip: the next heartbeat may get through, and the grace allows for two missed
            except RuntimeError:
                return  # the client was closed under us

    def end(self) -> None:
        """Stop heartbeating and end the lease (its sandboxes go); a failure leaves it to expire."""
        self._stop.set()
        with self._lock:
            lease, self.lease = self.lease, None
        if lease is not None and self.lost is None:
            try:
                self.sender.json(calls.end_lease(lease.id))
            except ForkyardError:
                pass  # it expires grace_s after its last heartbeat anyway


class AsyncLeaseKeeper:
    """An async client's lease: taken on first use, heartbeaten by a task, ended by ``end()``."""

    def __init__(self, sender: AsyncSender, options: LeaseOptions) -> None:
        self.sender, self.options = sender, options
        self.lease: Lease | None = None
        self.lost: ForkyardError | None = None
        self._lock: asyncio.Lock | None = None
        self._task: asyncio.Task[None] | None = None

    async def lease_id(self) -> str:
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if self.lease is None:
                self.lease = Lease.from_api(await self.sender.json(calls.create_lease(grace_s=self.options.grace_s)))
                self._task = asyncio.ensure_future(self._beat())
            return self.lease.id

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.options.every_s)
            lease = self.lease
            if lease is None:
                return
            try:
                self.lease = Lease.from_api(await self.sender.json(calls.heartbeat_lease(lease.id)))
            except OVER as error:
                self.lost = error
                return
            except ForkyardError:
                continue

    async def end(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        lease, self.lease = self.lease, None
        if lease is not None and self.lost is None:
            try:
                await self.sender.json(calls.end_lease(lease.id))
            except ForkyardError:
                pass


def end_lease_now(settings: Settings, lease_id: str) -> None:
    """End a lease from an exit path (a signal handler, atexit) with a client of its own: the client's
    may be closed, or held half way through a request by the very frame the signal interrupted."""
    quick = replace(settings, timeout_s=10.0, retry=RetryPolicy(max_retries=2, budget_s=10.0))
    sender = Sender(quick)
    try:
        sender.json(calls.end_lease(lease_id))
    except ForkyardError:
        pass  # it expires grace_s after its last heartbeat anyway
    finally:
        sender.close()


class ExitGuard:
    """``kill_on_exit``: the client's lease ended at exit and on SIGTERM (its handler installed from the
    main thread, and chained to the one before it)."""

    def __init__(self, settings: Settings, keeper: LeaseKeeper | AsyncLeaseKeeper) -> None:
        self.settings, self.keeper = settings, keeper
        self.done = False
        self.previous: Any = None
        atexit.register(self.run)
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self.on_signal)

    def run(self) -> None:
        if self.done:
            return
        self.done = True
        lease = self.keeper.lease
        if lease is not None:
            end_lease_now(self.settings, lease.id)

    def on_signal(self, number: int, frame: FrameType | None) -> None:
        self.run()
        previous = self.previous
        if callable(previous):
            previous(number, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(number, signal.SIG_DFL)  # what the signal would have done: the process dies of it
            os.kill(os.getpid(), number)

    def close(self) -> None:
        """The client closed (and ended its lease itself): nothing left to do at exit."""
        self.done = True
        atexit.unregister(self.run)
        if self.previous is not None and signal.getsignal(signal.SIGTERM) == self.on_signal:
            signal.signal(signal.SIGTERM, self.previous)


TERMINATED = 128 + signal.SIGTERM  # the exit status of a process SIGTERM killed


class Unwinding:
    """SIGTERM turned into an unwinding of the SDK's open ``with`` blocks, while there are any.

    Only from the main thread, and only while SIGTERM's disposition is the
    default (a program's own handler, or ``kill_on_exit``'s, is left alone)."""

    depth = 0
    installed = False
    task: asyncio.Task[Any] | None = None
    loop: asyncio.AbstractEventLoop | None = None
    signalled = False

    @classmethod
    def _ours(cls) -> bool:
        return threading.current_thread() is threading.main_thread()

    @classmethod
    def enter(cls) -> None:
        if not cls._ours():
            return
        if cls.depth == 0 and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, cls._raise)
            cls.installed = True
        cls.depth += 1

    @classmethod
    def leave(cls) -> None:
        if not cls._ours() or cls.depth == 0:
            return
        cls.depth -= 1
        if cls.depth == 0 and cls.installed:
            cls.installed = False
            if signal.getsignal(signal.SIGTERM) == cls._raise:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)

    @classmethod
    def _raise(cls, number: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills at once
        cls.installed = False
        raise SystemExit(TERMINATED)

    @classmethod
    def enter_async(cls) -> None:
        if not cls._ours():
            return
        if cls.depth == 0 and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            loop = asyncio.get_running_loop()
            cls.task, cls.loop, cls.signalled = asyncio.current_task(), loop, False
            try:
                loop.add_signal_handler(signal.SIGTERM, cls._cancel)
                cls.installed = True
            except (NotImplementedError, RuntimeError):
                cls.task = cls.loop = None
        cls.depth += 1

    @classmethod
    def _cancel(cls) -> None:
        if cls.loop is not None:
            cls.loop.remove_signal_handler(signal.SIGTERM)  # a second SIGTERM kills at once
        cls.installed, cls.signalled = False, True
        if cls.task is not None:
            cls.task.cancel()

    @classmethod
    def leave_async(cls) -> None:
        """Leaving a block; raises ``SystemExit(143)`` when the outermost one closes after a SIGTERM."""
        if not cls._ours() or cls.depth == 0:
            return
        cls.depth -= 1
        if cls.depth:
            return
        if cls.installed and cls.loop is not None:
            cls.loop.remove_signal_handler(signal.SIGTERM)
        cls.installed, cls.task, cls.loop = False, None, None
        if cls.signalled:
            cls.signalled = False
            raise SystemExit(TERMINATED)
