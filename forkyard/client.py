"""The synchronous client: ``Client`` and the sandboxes and launches it hands out (see ``forkyard``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Mapping
from types import TracebackType
from typing import Any, Unpack

import httpx

from . import _calls as calls
from ._calls import Body, ExecOptions, SandboxOptions, Services
from ._http import Call, RetryPolicy, Sender, Settings
from ._pages import Page
from ._resources import ClientBase, Resource
from ._waiting import Deadline, backoff, raise_if_failed, raise_if_snapshot_failed
from .models import (
    ExecChunk,
    ExecResult,
    FileListing,
    FileWritten,
    LaunchFields,
    SandboxFields,
    SnapshotFields,
)


class Client(ClientBase[Sender]):
    """A connection to a forkyard API.

    ``url`` and ``api_key`` default to ``FORKYARD_URL`` (else
    ``http://127.0.0.1:8000``) and ``FORKYARD_API_KEY``.  ``max_retries`` (0
    disables retries) and ``retry`` tune the retry policy; ``transport`` is an
    ``httpx`` transport, for tests.  Use it as a context manager, or ``close()``.
    """

    def __init__(self, url: str | None = None, api_key: str | None = None, *, timeout_s: float = 60.0,
                 max_retries: int | None = None, retry: RetryPolicy | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        super().__init__(Sender(Settings.resolve(url, api_key, timeout_s=timeout_s, max_retries=max_retries, retry=retry), transport))
        self.sandboxes = Sandboxes(self._sender)
        self.launches = Launches(self._sender)
        self.snapshots = Snapshots(self._sender)

    def close(self) -> None:
        self._sender.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.close()


class Sandboxes(Resource[Sender]):
    """``fy.sandboxes``: create, find and destroy sandboxes."""

    def create(self, *, wait_timeout_s: float = 300.0, **options: Unpack[SandboxOptions]) -> Sandbox:
        """Create a sandbox from a template or a snapshot; it comes back running.

        Options: ``template`` or ``snapshot``, ``size`` (or ``cpu`` and
        ``memory_mib``), ``ttl_s``, ``network_policy``, ``env``, ``labels``,
        ``idempotency_key``, ``wait`` (default True: return once it runs,
        polling up to ``wait_timeout_s`` if the server answers before).
        Raises ``InvalidRequest``, ``NotFound`` (template, snapshot, policy),
        ``RateLimited`` (quota), ``NoCapacity``, or ``Unavailable`` with the
        sandbox's own error code if its host could not start it.
        """
        sandbox = Sandbox(self._sender, self._sender.json(calls.create_sandbox(options)))
        if options.get("wait", True):
            sandbox.wait_started(timeout_s=wait_timeout_s)
        return sandbox

    def get(self, sandbox_id: str) -> Sandbox:
        return Sandbox(self._sender, self._sender.json(calls.get_sandbox(sandbox_id)))

    def ref(self, sandbox_id: str) -> Sandbox:
        """A ``Sandbox`` for an id, without asking the API: exec and files work at once,
        the other fields are empty until ``refresh()``."""
        return Sandbox(self._sender, {"id": sandbox_id})

    def list(self, *, state: str | None = None, label: str | None = None, limit: int = 100, cursor: str | None = None) -> Page[Sandbox]:
        """One page of the team's sandboxes, newest first.  ``label`` is ``key=value`` or ``key``;
        pass the page's ``next_cursor`` as ``cursor`` for the next one."""
        data = self._sender.json(calls.list_sandboxes(state, label, limit, cursor))
        return Page([Sandbox(self._sender, row) for row in data["sandboxes"]], data.get("next_cursor"))

    def list_all(self, *, state: str | None = None, label: str | None = None, page_size: int = 500) -> Iterator[Sandbox]:
        """Every matching sandbox, following ``next_cursor`` page by page."""
        cursor: str | None = None
        while True:
            page = self.list(state=state, label=label, limit=page_size, cursor=cursor)
            yield from page
            if not page.next_cursor:
                return
            cursor = page.next_cursor

    def kill(self, sandbox_id: str, *, wait: bool = True) -> Sandbox:
        """Destroy a sandbox (idempotent); with ``wait``, answer once it is gone."""
        return Sandbox(self._sender, self._sender.json(calls.destroy_sandbox(sandbox_id, wait)))

    destroy = kill


class Sandbox(SandboxFields):
    """One sandbox: its fields (``id``, ``state``, ``host``, ``labels``, ...) and what it can do."""

    def __init__(self, sender: Sender, data: Mapping[str, Any]) -> None:
        self._sender = sender
        self._apply(data)
        self.files = Files(sender, self.id)

    def refresh(self) -> Sandbox:
        """Reload the fields from the API."""
        self._apply(self._sender.json(calls.get_sandbox(self.id)))
        return self

    def wait_started(self, *, timeout_s: float = 300.0, poll_s: float = 0.1) -> Sandbox:
        """Poll until it is no longer queued or creating; raise if it failed to start."""
        deadline = Deadline(timeout_s, f"sandbox {self.id} to start")
        while self.starting:
            time.sleep(deadline.next_poll(poll_s))
            self.refresh()
        raise_if_failed(self)
        return self

    def exec(self, cmd: str | list[str], **options: Unpack[ExecOptions]) -> ExecResult:
        """Run a command and wait for it: a string runs under ``/bin/sh -c``, a list is argv.

        Options: ``cwd``, ``env``, ``stdin`` (str or bytes), ``timeout_s``
        (default 60), ``max_output_bytes``, ``output`` (``text`` or ``base64``).
        A timeout is a result (``timed_out``), not an error.  A sandbox that is
        not running raises ``Conflict`` (``sandbox_not_running``).
        """
        return ExecResult.from_api(self._sender.json(calls.run(self.id, cmd, options)))

    def exec_stream(self, cmd: str | list[str], **options: Unpack[ExecOptions]) -> ExecStream:
        """Run a command and yield its output as it comes (``ExecChunk``s); the stream's
        ``result`` holds the exit code once the iteration is over."""
        return ExecStream(self._sender, calls.run(self.id, cmd, options, stream=True), options.get("output", "text"))

    def pause(self) -> Sandbox:
        """Freeze every process in it (billed at the paused rate)."""
        self._apply(self._sender.json(calls.sandbox_action(self.id, "pause")))
        return self

    def resume(self) -> Sandbox:
        self._apply(self._sender.json(calls.sandbox_action(self.id, "resume")))
        return self

    def snapshot(self, *, name: str, services: Services = (), labels: Mapping[str, str] | None = None,
                 idempotency_key: str | None = None, wait: bool = True, timeout_s: float | None = 600.0) -> Snapshot:
        """Save its filesystem as a snapshot to fork from (``fy.launches.create(snapshot=snap.id, count=N)``).

        Memory is not saved: ``services`` (``Service.tcp(...)``, ``Service.http(...)``,
        ``Service.exec(...)``) are started in every fork, which runs only once they
        answer.  The sandbox keeps running (a paused one stays paused).  With
        ``wait`` (the default) it returns once the snapshot is ready, and raises
        ``SnapshotFailed`` if it could not be taken (``WaitTimeout`` after ``timeout_s``).
        A sandbox that is not running raises ``Conflict`` (``sandbox_not_running``).
        """
        data = self._sender.json(calls.snapshot_sandbox(self.id, name, labels, services, idempotency_key))
        snapshot = Snapshot(self._sender, data)
        return snapshot.wait(timeout_s=timeout_s) if wait else snapshot

    def kill(self, *, wait: bool = True) -> Sandbox:
        """Destroy it (idempotent); with ``wait``, return once it is gone."""
        self._apply(self._sender.json(calls.destroy_sandbox(self.id, wait)))
        return self

    destroy = kill

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.kill(wait=False)


class ExecStream:
    """A streamed command: iterate for ``ExecChunk``s as they come; then ``result``.

    The request is sent when the iteration starts, so errors such as
    ``NotFound`` or ``Conflict`` are raised there.  Leaving a ``with`` block
    (or ``close()``) early hangs up.
    """

    def __init__(self, sender: Sender, call: Call, encoding: str = "text") -> None:
        self._sender, self._call, self._encoding = sender, call, encoding
        self._events: Generator[ExecChunk, None, None] | None = None
        self.result: ExecResult | None = None

    def __iter__(self) -> Iterator[ExecChunk]:
        if self._events is None:
            self._events = self._read()
        return self._events

    def _read(self) -> Generator[ExecChunk, None, None]:
        with self._sender.stream(self._call) as response:
            for line in response.iter_lines():
                event = calls.stream_event(line, self._encoding)
                if isinstance(event, ExecResult):
                    self.result = event
                elif event is not None:
                    yield event

    def close(self) -> None:
        if self._events is not None:
            self._events.close()

    def __enter__(self) -> ExecStream:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.close()


class Files:
    """``sandbox.files``: read, write, list and remove files; move directories as tar."""

    def __init__(self, sender: Sender, sandbox_id: str) -> None:
        self._sender, self._sandbox_id = sender, sandbox_id

    def read(self, path: str) -> bytes:
        return self._sender.content(calls.read_file(self._sandbox_id, path))

    def write(self, path: str, data: Body, *, mode: int = 0o644, make_parents: bool = True) -> FileWritten:
        """Write bytes (or text as UTF-8, an open binary file, an iterator of chunks) to ``path``."""
        return FileWritten.from_api(self._sender.json(calls.write_file(self._sandbox_id, path, data, mode, make_parents)))

    def list(self, path: str = "/") -> FileListing:
        return FileListing.from_api(self._sender.json(calls.list_files(self._sandbox_id, path)))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._sender.json(calls.remove_file(self._sandbox_id, path, recursive))

    def download(self, path: str = "/") -> bytes:
        """``path`` (a directory or a file) as an uncompressed tar archive."""
        return self._sender.content(calls.download(self._sandbox_id, path))

    def download_stream(self, path: str = "/", chunk_size: int = 256 * 1024) -> Iterator[bytes]:
        """The same tar archive, chunk by chunk, for trees too big to hold in memory."""
        with self._sender.stream(calls.download(self._sandbox_id, path)) as response:
            yield from response.iter_bytes(chunk_size)

    def upload(self, path: str, tar: Body) -> dict[str, Any]:
        """Unpack a tar archive (bytes, an open file, chunks) into the directory ``path``."""
        result: dict[str, Any] = self._sender.json(calls.upload(self._sandbox_id, path, tar))
        return result


class Launches(Resource[Sender]):
    """``fy.launches``: many sandboxes in one call."""

    def create(self, *, count: int, **options: Unpack[SandboxOptions]) -> Launch:
        """Launch ``count`` sandboxes from a ``template`` or a ``snapshot`` (same options as
        ``sandboxes.create``).  It answers at once; follow it with ``wait()``."""
        return Launch(self._sender, self._sender.json(calls.create_launch(count, options)))

    def get(self, launch_id: str) -> Launch:
        return Launch(self._sender, self._sender.json(calls.get_launch(launch_id)))

    def list(self, *, limit: int = 50) -> list[Launch]:
        """The team's latest launches, newest first."""
        return [Launch(self._sender, row) for row in self._sender.json(calls.list_launches(limit))]

    def kill(self, launch_id: str) -> Launch:
        """Tear a launch down: every sandbox in it, whatever its state."""
        return Launch(self._sender, self._sender.json(calls.destroy_launch(launch_id)))

    destroy = kill


class Launch(LaunchFields):
    """One launch: ``progress`` (requested, queued, creating, running, failed, ended), ``rate_per_s``..."""

    def __init__(self, sender: Sender, data: Mapping[str, Any]) -> None:
        self._sender = sender
        self._apply(data)

    def refresh(self) -> Launch:
        self._apply(self._sender.json(calls.get_launch(self.id)))
        return self

    def wait(self, *, timeout_s: float | None = None, poll_s: float = 0.25,
             on_progress: Callable[[Launch], None] | None = None) -> Iterator[Sandbox]:
        """Block until no sandbox is still queued or creating, then iterate over them all.

        ``on_progress(launch)`` is called after every poll.  Raises ``WaitTimeout``
        after ``timeout_s``.  The sandboxes come page by page (running and failed ones alike).
        """
        deadline = Deadline(timeout_s, f"launch {self.id}")
        self.refresh()
        while True:
            if on_progress is not None:
                on_progress(self)
            if self.settled:
                return self.sandboxes()
            time.sleep(deadline.next_poll(poll_s))
            self.refresh()

    def sandboxes(self, *, state: str | None = None, page_size: int = 1000) -> Iterator[Sandbox]:
        """The launch's sandboxes in launch order, optionally only those in ``state``."""
        cursor: str | None = None
        while True:
            data = self._sender.json(calls.launch_sandboxes(self.id, state, page_size, cursor))
            for row in data["sandboxes"]:
                yield Sandbox(self._sender, row)
            cursor = data.get("next_cursor")
            if not cursor:
                return

    def kill(self) -> Launch:
        """Tear it down: every sandbox in it, whatever its state."""
        self._apply(self._sender.json(calls.destroy_launch(self.id)))
        return self

    destroy = kill


class Snapshots(Resource[Sender]):
    """``fy.snapshots``: saved sandbox states to fork from."""

    def get(self, snapshot_id: str) -> Snapshot:
        return Snapshot(self._sender, self._sender.json(calls.get_snapshot(snapshot_id)))

    def list(self, *, state: str | None = None, label: str | None = None, limit: int = 100,
             before: str | None = None) -> list[Snapshot]:
        """The team's snapshots, newest first (deleted ones are not listed).  ``label`` is ``key=value``
        or ``key``; pass the last one's id as ``before`` for the next page."""
        return [Snapshot(self._sender, row) for row in self._sender.json(calls.list_snapshots(state, label, limit, before))]

    def list_all(self, *, state: str | None = None, label: str | None = None, page_size: int = 500) -> Iterator[Snapshot]:
        """Every matching snapshot, page by page."""
        before: str | None = None
        while True:
            page = self.list(state=state, label=label, limit=page_size, before=before)
            yield from page
            if len(page) < page_size:
                return
            before = page[-1].id

    def delete(self, snapshot_id: str) -> Snapshot:
        """Delete a snapshot: its saved-state billing ends now.  Refused with ``Conflict``
        (``snapshot_in_use``, ``details["forks_alive"]``) while sandboxes forked from it live."""
        return Snapshot(self._sender, self._sender.json(calls.delete_snapshot(snapshot_id)))


class Snapshot(SnapshotFields):
    """One snapshot: its fields (``id``, ``state``, ``size_bytes``, ``forks_alive``, ``services``...) and what it can do."""

    def __init__(self, sender: Sender, data: Mapping[str, Any]) -> None:
        self._sender = sender
        self._apply(data)

    def refresh(self) -> Snapshot:
        self._apply(self._sender.json(calls.get_snapshot(self.id)))
        return self

    def wait(self, *, timeout_s: float | None = 600.0) -> Snapshot:
        """Poll (backing off from 0.1 s to 2 s) until it is no longer creating; raise ``SnapshotFailed``
        if it failed, ``WaitTimeout`` after ``timeout_s``."""
        deadline = Deadline(timeout_s, f"snapshot {self.id} to be ready")
        delays = backoff()
        while self.creating:
            time.sleep(deadline.next_poll(next(delays)))
            self.refresh()
        raise_if_snapshot_failed(self)
        return self

    def delete(self) -> Snapshot:
        """Delete it (see ``fy.snapshots.delete``)."""
        self._apply(self._sender.json(calls.delete_snapshot(self.id)))
        return self
