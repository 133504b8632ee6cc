"""Execs with a key: a command runs at most once per sandbox and key.

A caller that retries (its connection dropped, its worker restarted) sends
the same ``key``; the engine does not run the command again:

* while the first exec runs, the retry waits for it, then gets its result
  and its output (``replayed: true``): the output is spooled while the
  command runs, to an unnamed file of the engine's state directory (0600,
  gone once closed), so that the engine's memory stays bounded;
* once it ended, the retry gets its exit status, signal and timings
  (``replayed: true``) and *no output*: the spool is closed as soon as the
  first exec and every retry that waited for it have been answered.
  Content is never kept after it was delivered;
* a first exec whose caller went away was killed (execution.py): a retry
  gets ``caller_left: true`` and signal 9, and what it printed until then if
  it waited for it.

Results are kept in memory only, ``KEY_TTL_S`` after the exec ended (at most
``MAX_KEYS``, the oldest forgotten first): a restarted engine forgets them.
An exec that failed before its command ran (the sandbox went, say) gives its
key back, so that a retry can run it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO

from .errors import InvalidRequest
from .execution import READ_CHUNK, ExecResult, Flow, OutputCallback

KEY_TTL_S = 600.0
MAX_KEYS = 100_000
MAX_KEY_LENGTH = 255


def validate_key(key: object) -> str:
    if key is None or key == "":
        return ""
    if not isinstance(key, str) or len(key) > MAX_KEY_LENGTH:
        raise InvalidRequest(f"key must be a string of 1 to {MAX_KEY_LENGTH} characters", field="key")
    return key


class OutputSpool:
    """A running keyed exec's output, on disk, for the retries that wait for it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.files: dict[str, IO[bytes]] = {}
        self.closed = False

    def add(self, stream: str, data: bytes) -> None:
        if self.closed:
            return
        try:
            spool = self.files.get(stream)
            if spool is None:
                # O_TMPFILE: no name, mode 0600, gone with its last descriptor.
                spool = self.files[stream] = tempfile.TemporaryFile(dir=self.directory, buffering=0)
            view = memoryview(data)
            while view:
                written = spool.write(view)
                if not written:
                    raise OSError("the spool took nothing")
                view = view[written:]
        except OSError:
            self.close()  # a full disk: retries get the result without the output

    async def replay(self, on_output: OutputCallback, flow: Flow | None) -> None:
        """Send it all to one more caller: stdout, then stderr, paced by ``flow``."""
        for stream in ("stdout", "stderr"):
            spool = self.files.get(stream)
            if spool is None:
                continue
            offset = 0
            while chunk := os.pread(spool.fileno(), READ_CHUNK, offset):
                offset += len(chunk)
                on_output(stream, chunk)
                if flow is not None and flow.congested():
                    await flow.drained()

    def close(self) -> None:
        self.closed = True
        for spool in self.files.values():
            spool.close()
        self.files.clear()


@dataclasses.dataclass
class KeyedExec:
    outcome: asyncio.Future[ExecResult]
    spool: OutputSpool
    waiting: int = 0  # retries waiting for it, or reading its spool
    ended: bool = False

    def release(self) -> None:
        """Close the spool once the exec ended and no retry still needs it."""
        if self.ended and self.waiting == 0:
            self.spool.close()


class ExecKeys:
    def __init__(self, spool_directory: Path) -> None:
        self.spool_directory = spool_directory
        self.execs: dict[tuple[str, str], KeyedExec] = {}
        self.expiring: deque[tuple[float, tuple[str, str]]] = deque()

    def status(self) -> dict[str, int]:
        """What ``info`` shows: keys kept, execs with a key running, retries waiting for one."""
        return {
            "kept": len(self.execs),
            "running": sum(1 for keyed in self.execs.values() if not keyed.ended),
            "waiting": sum(keyed.waiting for keyed in self.execs.values()),
        }

    def _forget_old(self) -> None:
        now = time.monotonic()
        while self.expiring and (self.expiring[0][0] < now or len(self.expiring) > MAX_KEYS):
            _, slot = self.expiring.popleft()
            self.execs.pop(slot, None)

    def forget_sandbox(self, sandbox_id: str) -> None:
        for slot in [slot for slot in self.execs if slot[0] == sandbox_id]:
            keyed = self.execs.pop(slot)
            if keyed.ended:
                keyed.spool.close()

    async def run(
        self,
        sandbox_id: str,
        key: str,
        on_output: OutputCallback | None,
        flow: Flow | None,
        execute: Callable[[OutputCallback], Awaitable[ExecResult]],
    ) -> ExecResult:
        """Run ``execute`` (given where its output goes) once per sandbox and key."""
        self._forget_old()
        slot = (sandbox_id, key)
        earlier = self.execs.get(slot)
        if earlier is not None:
            return await self._retry(earlier, on_output, flow)
        keyed = KeyedExec(asyncio.get_running_loop().create_future(), OutputSpool(self.spool_directory))
        self.execs[slot] = keyed
        kept: dict[str, list[bytes]] = {"stdout": [], "stderr": []}

        def tee(stream: str, data: bytes) -> None:
            keyed.spool.add(stream, data)
            if on_output is not None:
                on_output(stream, data)
            else:
                kept[stream].append(data)

        started = time.perf_counter()
        try:
            result = await execute(tee)
        except (asyncio.CancelledError, ConnectionError):
            # Its caller went away: the command was killed.  A retry gets that news.
            duration_ms = (time.perf_counter() - started) * 1000
            keyed.outcome.set_result(
                ExecResult(128 + signal.SIGKILL, b"", b"", duration_ms, signal=signal.SIGKILL, caller_left=True)
            )
            self._ended(slot, keyed)
            raise
        except BaseException as error:
            # It did not run (or the sandbox went): the key is free again.
            self.execs.pop(slot, None)
            keyed.outcome.set_exception(error)
            keyed.outcome.exception()  # retrieved: nobody may be waiting
            keyed.ended = True
            keyed.release()
            raise
        keyed.outcome.set_result(dataclasses.replace(result, stdout=b"", stderr=b""))
        self._ended(slot, keyed)
        if on_output is None:
            result.stdout, result.stderr = b"".join(kept["stdout"]), b"".join(kept["stderr"])
        return result

    def _ended(self, slot: tuple[str, str], keyed: KeyedExec) -> None:
        keyed.ended = True
        keyed.release()
        self.expiring.append((time.monotonic() + KEY_TTL_S, slot))

    async def _retry(self, keyed: KeyedExec, on_output: OutputCallback | None, flow: Flow | None) -> ExecResult:
        keyed.waiting += 1
        try:
            result = await asyncio.shield(keyed.outcome)
            kept: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
            if not keyed.spool.closed:  # it still ran when we came: its output too
                await keyed.spool.replay(on_output or (lambda stream, data: kept[stream].append(data)), flow)
        finally:
            keyed.waiting -= 1
            keyed.release()
        return dataclasses.replace(result, replayed=True, stdout=b"".join(kept["stdout"]), stderr=b"".join(kept["stderr"]))
