"""The synchronous client: ``Client`` and the sandboxes and launches it hands out (see ``forkyard``)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from datetime import datetime
from types import TracebackType
from typing import IO, Any, Generic, Literal, Self, TypeVar, Unpack, cast

import httpx

from . import _calls as calls
from . import _grading, _trees
from ._calls import MAX_WAIT_S, Body, ExecOptions, PortAuth, ProcessOptions, SandboxOptions, Services
from ._desktop import BROWSER_PORT, BROWSER_WAIT_S, DesktopActions, forwarded, screenshot_body
from ._http import Call, RetryPolicy, Sender, Settings
from ._lifetime import ExitGuard, LeaseKeeper, LeaseOptions, Unwinding, lease_options
from ._pages import Page, every
from ._resources import ClientBase, Resource
from ._waiting import Arrivals, Deadline, backoff, raise_if_failed, raise_if_snapshot_failed
from .errors import Conflict, NotFound, Unavailable
from .models import (
    BatchResult,
    BatchSummary,
    DesktopState,
    ExecChunk,
    ExecResult,
    ExposedPort,
    FileEntry,
    FileListing,
    FileRenamed,
    FileWritten,
    Killed,
    LaunchFields,
    Lease,
    LiveView,
    Metrics,
    ProcessFields,
    ProcessOutput,
    SandboxFields,
    Screenshot,
    SnapshotFields,
    WatchEvent,
)

Item = TypeVar("Item")
Last = TypeVar("Last")


class Client(ClientBase[Sender]):
    """A connection to a forkyard API.

    ``url`` and ``api_key`` default to ``FORKYARD_URL`` (else
    ``http://127.0.0.1:8000``) and ``FORKYARD_API_KEY``.  ``max_retries`` (0
    disables retries) and ``retry`` tune the retry policy; ``transport`` is an
    ``httpx`` transport, for tests.  Use it as a context manager, or ``close()``.

    ``lease=True`` (or ``lease=LeaseOptions(grace_s=...)``): the sandboxes and
    launches this client makes live only while it does.  It takes a lease with
    its first create or launch, names it in each, heartbeats it from a thread
    every ``grace_s / 3``, and ends it on ``close()``, which destroys them; a
    process killed outright stops heartbeating, and they are destroyed
    ``grace_s`` (60) later.  ``kill_on_exit=True`` takes such a lease and ends
    it however the process ends: at exit (Ctrl-C included) and on SIGTERM.

    ``direct`` (default on; ``FORKYARD_DIRECT=0`` turns it off): a sandbox's
    commands and files go straight to the host that runs it, to its gateway,
    with the short-lived data token the API gave for it (``data_path``), and
    through the API whenever that cannot be used; both answer the same.
    """

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout_s: float = 60.0,
        max_retries: int | None = None,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
        lease: bool | LeaseOptions | None = None,
        kill_on_exit: bool = False,
        direct: bool | None = None,
    ) -> None:
        super().__init__(
            Sender(
                Settings.resolve(url, api_key, timeout_s=timeout_s, max_retries=max_retries, retry=retry, direct=direct),
                transport,
            )
        )
        options = lease_options(lease, kill_on_exit)
        self._keeper = LeaseKeeper(self._sender, options) if options is not None else None
        self._guard = ExitGuard(self._sender.settings, self._keeper) if kill_on_exit and self._keeper is not None else None
        self.sandboxes = Sandboxes(self._sender, self._keeper)
        self.launches = Launches(self._sender, self._keeper)
        self.snapshots = Snapshots(self._sender)
        self.grades: _grading.Grades[Sender] = _grading.Grades(self._sender)
        self.endpoints = Endpoints(self._sender)
        self._inference: Any = None

    @property
    def inference(self) -> Any:
        """The official ``openai.OpenAI`` client pointed at this forkyard (``<url>/api/v1/inference``, this key):
        ``fy.inference.chat.completions.create(model=..., messages=...)``. Needs ``forkyard[openai]``."""
        if self._inference is None:
            self._inference = _grading.inference_client(self._sender.settings, asynchronous=False)
        return self._inference

    @property
    def lease(self) -> Lease | None:
        """This client's own lease as its last heartbeat left it (None until its first create or launch)."""
        return self._keeper.lease if self._keeper is not None else None

    def exec_many(
        self,
        cmd: str | list[str],
        *,
        sandbox_ids: Iterable[str | Sandbox] | None = None,
        launch: str | Launch | None = None,
        label: str | None = None,
        **options: Unpack[ExecOptions],
    ) -> ExecBatch:
        """Run one command in many sandboxes, named by exactly one of ``sandbox_ids`` (ids or sandboxes),
        ``launch`` (its live sandboxes) or ``label`` (``key:value``: the team's live sandboxes with it).

        Iterate for a ``BatchResult`` per sandbox as each finishes (its ``result``, or the ``error`` that
        kept it from running); then ``summary``.  Options as ``exec``; with an ``idempotency_key`` the
        batch sent again runs nothing twice.  At most 10,000 sandboxes (``InvalidRequest``,
        ``batch_too_large``, before anything runs).
        """
        return ExecBatch(self._sender, calls.run_many(cmd, sandbox_ids=sandbox_ids, launch=launch, label=label, options=options))

    def close(self) -> None:
        """End this client's lease, if it has one (its sandboxes go), and its connections."""
        try:
            if self._keeper is not None:
                self._keeper.end()
            if self._guard is not None:
                self._guard.close()
        finally:
            if self._inference is not None:
                self._inference.close()
            self._sender.close()

    def __enter__(self) -> Client:
        Unwinding.enter()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        try:
            self.close()
        finally:
            Unwinding.leave()


def _with_lease(options: Mapping[str, Any], keeper: LeaseKeeper | None, where: str) -> SandboxOptions:
    """A create's or a launch's options, checked, and naming the client's own lease unless they name one."""
    checked = calls.sandbox_options(options, where)  # an unknown option is refused before a lease is taken for it
    if keeper is not None and "lease" not in checked:
        checked["lease"] = keeper.lease_id()
    return checked


class Endpoints(_grading.Endpoints[Sender]):
    def wait_ready(self, endpoint: str | _grading.DedicatedEndpoint, *, timeout_s: float = 600.0) -> _grading.DedicatedEndpoint:
        """Until the endpoint answers (``ready``); ``ForkyardError`` (``endpoint_failed``) if it failed."""
        endpoint_id = endpoint if isinstance(endpoint, str) else endpoint.id
        return _grading.wait_ready(self._sender, endpoint_id, timeout_s=timeout_s)


class Sandboxes(Resource[Sender]):
    """``fy.sandboxes``: create, find and destroy sandboxes."""

    def __init__(self, sender: Sender, keeper: LeaseKeeper | None = None) -> None:
        super().__init__(sender)
        self._keeper = keeper

    def create(self, *, wait_timeout_s: float = 300.0, **options: Unpack[SandboxOptions]) -> Sandbox:
        """Create a sandbox from a template or a snapshot; it comes back running.

        Options: ``template`` or ``snapshot``, ``size`` (or ``cpu`` and
        ``memory_mib``), ``ttl_s``, ``network_policy``, ``env``, ``labels``,
        ``idempotency_key``, ``lease``, ``wait`` (default True: return once it
        runs, polling up to ``wait_timeout_s`` if the server answers before).
        An option it does not know raises ``UnknownOption``.  Raises
        ``InvalidRequest``, ``NotFound`` (template, snapshot, policy, lease),
        ``RateLimited`` (quota), ``NoCapacity``, or ``Unavailable`` with the
        sandbox's own error code if its host could not start it.  A sandbox
        whose wait fails (``WaitTimeout``, Ctrl-C) is killed before the error
        goes on: no sandbox starts behind an error.  ``with`` it to kill it
        at the block's end.
        """
        call = calls.create_sandbox(_with_lease(options, self._keeper, "sandboxes.create"))
        sandbox = Sandbox(self._sender, self._sender.json(call))
        if options.get("wait", True) and sandbox.starting:
            try:
                sandbox.wait_started(timeout_s=wait_timeout_s)
            except BaseException:
                if sandbox.starting:
                    sandbox.kill(wait=False)
                raise
        raise_if_failed(sandbox)
        return sandbox

    def get(self, sandbox_id: str) -> Sandbox:
        return Sandbox(self._sender, self._sender.json(calls.get_sandbox(sandbox_id)))

    def ref(self, sandbox_id: str) -> Sandbox:
        """A ``Sandbox`` for an id, without asking the API: exec and files work at once,
        the other fields are empty until ``refresh()``."""
        return Sandbox(self._sender, {"id": sandbox_id})

    def list(
        self, *, state: str | None = None, label: str | None = None, limit: int = 100, cursor: str | None = None
    ) -> Page[Sandbox]:
        """One page of the team's sandboxes, newest first.  ``label`` is ``key=value`` or ``key``;
        pass the page's ``next_cursor`` as ``cursor`` for the next one."""
        data = self._sender.json(calls.list_sandboxes(state, label, limit, cursor))
        return Page([Sandbox(self._sender, row) for row in data["sandboxes"]], data.get("next_cursor"))

    def list_all(self, *, state: str | None = None, label: str | None = None, page_size: int = 500) -> Iterator[Sandbox]:
        """Every matching sandbox, following ``next_cursor`` page by page."""
        return every(lambda cursor: self.list(state=state, label=label, limit=page_size, cursor=cursor))

    def kill(self, sandbox_id: str, *, wait: bool = True) -> Sandbox:
        """Destroy a sandbox (idempotent); with ``wait``, answer once it is gone."""
        return Sandbox(self._sender, self._sender.json(calls.destroy_sandbox(sandbox_id, wait)))

    destroy = kill

    def kill_all(self, *, label: str | None = None, launch: str | Launch | None = None) -> Killed:
        """Destroy every live sandbox of the team with a ``label`` (``key:value``), or of a ``launch`` (torn
        down: it makes no more), in one call; how many were asked to stop.  Give exactly one: the server
        refuses neither (``filter_required``), so that nothing kills everything by accident."""
        launch_id = None if launch is None else str(getattr(launch, "id", launch))
        return Killed.from_api(self._sender.json(calls.destroy_sandboxes(label, launch_id)))


class Sandbox(SandboxFields):
    """One sandbox: its fields (``id``, ``state``, ``host``, ``labels``, ...) and what it can do."""

    def __init__(self, sender: Sender, data: Mapping[str, Any]) -> None:
        self._sender = sender
        self._apply(data)
        self.files = Files(sender, self.id)
        self.processes = Processes(sender, self.id)
        self.ports = Ports(sender, self.id)
        self.desktop = Desktop(sender, self.id)

    def _apply(self, data: Mapping[str, Any]) -> None:
        super()._apply(data)
        self._sender.routes.learn(data)  # its data path: exec and files straight to its host

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

    def snapshot(
        self,
        *,
        name: str,
        services: Services = (),
        labels: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
        wait: bool = True,
        timeout_s: float | None = 600.0,
    ) -> Snapshot:
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

    def update(
        self,
        *,
        labels: Mapping[str, str] | None = None,
        ttl_s: int | None = None,
        expires_at: datetime | None = None,
        idle_timeout_s: int | None = None,
    ) -> Sandbox:
        """Change it: ``labels`` replaces its labels (a launch's member keeps its ``launch`` label);
        ``ttl_s`` (seconds from now) or ``expires_at`` (a time with its zone) moves its expiry, within the
        team's maximum TTL (``InvalidRequest``, code ``ttl_over_maximum``); ``idle_timeout_s``: destroyed
        after this many seconds without an exec or a file call (0: never). Only what is given changes."""
        self._apply(self._sender.json(calls.update_sandbox(self.id, labels, ttl_s, expires_at, idle_timeout_s)))
        return self

    def metrics(self) -> Metrics:
        """What the kernel reports about it now (CPU time and share, memory and its peak, processes, disk used,
        OOM kills); a sandbox that is not running or paused raises ``Conflict`` (``sandbox_not_running``)."""
        return Metrics.from_api(self._sender.json(calls.sandbox_metrics(self.id)))

    def grade(self, cmd: str | list[str], *, reward_file: str | None = None, timeout_s: float = 600) -> _grading.Reward:
        """A test-based reward: run the check ``cmd`` here; the reward is the ``reward`` of the JSON object it
        writes to ``reward_file``, or (without one) 1.0 for exit code 0, else 0.0. A failure that is not the
        check's (the sandbox gone, a timeout) raises, never a reward of 0."""
        return _grading.Reward.from_api(
            self._sender.json(_grading.grade_sandbox(self.id, cmd, reward_file=reward_file, timeout_s=timeout_s))
        )

    def kill(self, *, wait: bool = True) -> Sandbox:
        """Destroy it (idempotent); with ``wait``, return once it is gone."""
        self._apply(self._sender.json(calls.destroy_sandbox(self.id, wait)))
        return self

    destroy = kill

    def __enter__(self) -> Sandbox:
        Unwinding.enter()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        try:
            self.kill(wait=False)
        finally:
            Unwinding.leave()


class LineStream(Generic[Item, Last]):
    """An answer of newline-delimited JSON, read as it comes: iterate for its items; its one ``last``
    line (a result, a summary) is kept once the iteration is over.

    The request is sent when the iteration starts, so errors such as
    ``NotFound`` or ``Conflict`` are raised there.  Leaving a ``with`` block
    (or ``close()``) early hangs up.
    """

    def __init__(self, sender: Sender, call: Call, parse: Callable[[str], Item | Last | None], last: type[Last]) -> None:
        self._sender, self._call, self._parse, self._last_type = sender, call, parse, last
        self._events: Generator[Item, None, None] | None = None
        self.last: Last | None = None

    def __iter__(self) -> Iterator[Item]:
        if self._events is None:
            self._events = self._read()
        return self._events

    def _read(self) -> Generator[Item, None, None]:
        with self._sender.stream(self._call) as response:
            for line in response.iter_lines():
                event = self._parse(line)
                if isinstance(event, self._last_type):
                    self.last = event
                elif event is not None:
                    yield cast(Item, event)  # neither None nor the last line's type: an item

    def close(self) -> None:
        if self._events is not None:
            self._events.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.close()


class ExecStream(LineStream[ExecChunk, ExecResult]):
    """A streamed command: iterate for ``ExecChunk``s as they come; then ``result`` (its exit code...)."""

    def __init__(self, sender: Sender, call: Call, encoding: str = "text") -> None:
        super().__init__(sender, call, lambda line: calls.stream_event(line, encoding), ExecResult)

    @property
    def result(self) -> ExecResult | None:
        return self.last


class ExecBatch(LineStream[BatchResult, BatchSummary]):
    """A command in many sandboxes: iterate for a ``BatchResult`` per sandbox as each finishes; then
    ``summary``.  Hanging up early (``close()``, leaving a ``with`` block) ends the commands still running."""

    def __init__(self, sender: Sender, call: Call) -> None:
        super().__init__(sender, call, calls.batch_line, BatchSummary)

    @property
    def summary(self) -> BatchSummary | None:
        return self.last


class WatchStream(LineStream[WatchEvent, WatchEvent]):
    """A watched directory: iterate for its ``WatchEvent``s; the last one (``end``) is ``end``."""

    def __init__(self, sender: Sender, call: Call) -> None:
        super().__init__(sender, call, _watch_item, _WatchEnd)

    @property
    def end(self) -> WatchEvent | None:
        return self.last


class _WatchEnd(WatchEvent):
    """The ``end`` line, told apart from the items by its type."""


def _watch_item(line: str | bytes) -> WatchEvent | None:
    event = calls.watch_line(line)
    if event is not None and event.type == "end":
        return _WatchEnd(**vars(event))
    return event


class Files:
    """``sandbox.files``: read, write, list, stat, rename, watch and remove files; move directories as tar."""

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

    def stat(self, path: str) -> FileEntry:
        """The entry at ``path`` itself (a symlink is described, with ``link_target``, not followed);
        nothing there raises ``NotFound`` (``file_not_found``)."""
        return FileEntry.from_api(self._sender.json(calls.stat_file(self._sandbox_id, path)))

    def exists(self, path: str) -> bool:
        """Is there anything at ``path`` (a dangling symlink counts: it is there)?  False too when a
        component of it is a file (``not_a_directory``), as ``os.path.exists`` answers."""
        try:
            self.stat(path)
        except (NotFound, Conflict) as error:
            if error.code not in ("file_not_found", "not_a_directory"):
                raise  # the sandbox itself is not found, or not running
            return False
        return True

    def rename(self, path: str, target: str, *, replace: bool = False) -> FileRenamed:
        """Rename ``path`` to ``target`` within the sandbox.  Without ``replace``, an existing
        ``target`` raises ``Conflict`` (``file_exists``)."""
        return FileRenamed.from_api(self._sender.json(calls.rename_file(self._sandbox_id, path, target, replace)))

    def mkdir(self, path: str) -> None:
        """Make a directory and its parents (``mkdir -p``): one already there is fine."""
        self._sender.json(calls.make_directory(self._sandbox_id, path))

    def watch(self, path: str = "/", *, timeout_s: float | None = None) -> WatchStream:
        """The directory's changes as ``WatchEvent``s, as they come (``ready`` first, once the watch
        is in place): iterate, and leave the ``with`` block (or ``close()``) to stop watching.  It also
        ends after ``timeout_s``, when the directory goes or the sandbox stops (``end`` then says why)."""
        return WatchStream(self._sender, calls.watch(self._sandbox_id, path, timeout_s))

    def upload_dir(self, local: str | os.PathLike[str], remote: str) -> dict[str, Any]:
        """Copy the local directory ``local``'s contents into ``remote`` in one call (a tar archive,
        made in memory or a temporary file; links are sent as links)."""
        with _trees.pack(local) as archive:
            return self.upload(remote, archive)

    def download_dir(self, remote: str, local: str | os.PathLike[str]) -> int:
        """Copy the sandbox's directory ``remote`` into the local directory ``local`` in one call; how
        many entries.  An entry that would land outside ``local`` (an absolute name, ``..``, a link
        leading out) or is a device or FIFO raises ``UnsafeArchive`` before anything is written."""
        with _trees.spool() as archive:
            for chunk in self.download_stream(remote):
                archive.write(chunk)
            archive.seek(0)
            return _trees.unpack(archive, local)


class Ports:
    """``sandbox.ports``: its TCP ports at preview URLs (``http://{port}-{sandbox}.{preview domain}/``)."""

    def __init__(self, sender: Sender, sandbox_id: str) -> None:
        self._sender, self._sandbox_id = sender, sandbox_id

    def expose(self, port: int, *, auth: PortAuth = "key", token_ttl_s: int | None = None) -> ExposedPort:
        """Reach ``port`` at a URL (``.url``): HTTP, streamed answers and websockets.  ``auth``: ``key``
        (send the team's API key in ``X-Forkyard-Key``), ``token`` (``.token_url``, signed, expiring after
        ``token_ttl_s``, an hour unless given) or ``public``.  Again: its ``auth`` changes, old tokens end.
        Until something listens there the URL answers 502 ``port_not_listening`` (``wait_for_port``)."""
        return ExposedPort.from_api(self._sender.json(calls.expose_port(self._sandbox_id, port, auth, token_ttl_s)))

    def list(self) -> list[ExposedPort]:
        """Its exposed ports, by number (a ``token`` port with a fresh signed URL)."""
        return [ExposedPort.from_api(row) for row in self._sender.json(calls.list_ports(self._sandbox_id))["ports"]]

    def close(self, port: int) -> None:
        """Its URL answers 404 from now on."""
        self._sender.json(calls.close_port(self._sandbox_id, port))

    def wait_for_port(self, port: int, *, timeout_s: float = 30.0) -> None:
        """Until something in the sandbox accepts connections on ``port`` (exposed or not);
        ``WaitTimeout`` after ``timeout_s``."""
        deadline = Deadline(timeout_s, f"port {port} of {self._sandbox_id} to listen")
        while True:
            answer = self._sender.json(calls.wait_port(self._sandbox_id, port, min(MAX_WAIT_S, deadline.left())))
            if answer["listening"]:
                return
            deadline.next_poll(0.0)  # raises once the time is up


class Desktop(DesktopActions[DesktopState]):
    """``sandbox.desktop``: the screen and input of a sandbox made from the desktop environment.  Every
    action helper (``click``, ``type``, ``key``, ``drag``, ``scroll``, ...) answers with the screen size
    and the cursor; ``act`` sends several actions in one request."""

    def __init__(self, sender: Sender, sandbox_id: str) -> None:
        self._sender, self._sandbox_id = sender, sandbox_id

    def info(self) -> DesktopState:
        return DesktopState.from_answer(self._sender.json(calls.desktop_info(self._sandbox_id)))

    def screenshot(
        self,
        *,
        scale: float | None = None,
        max_width: int | None = None,
        max_height: int | None = None,
        format: Literal["png", "jpeg"] = "png",
        quality: int | None = None,
    ) -> Screenshot:
        """The screen, full size or scaled down (``scale``, or to fit ``max_width``/``max_height``)."""
        body = screenshot_body(scale, max_width, max_height, format, quality)
        return Screenshot.from_answer(self._sender.json(calls.desktop_screenshot(self._sandbox_id, body)))

    def act(self, *actions: Mapping[str, Any]) -> DesktopState:
        """Actions as the API takes them (``{"type": "click", "x": 10, "y": 20}``, ...), in order."""
        return DesktopState.from_answer(self._sender.json(calls.desktop_actions(self._sandbox_id, actions)))

    def cursor(self) -> tuple[int, int]:
        state = self.info()
        return state.cursor_x, state.cursor_y

    def live_view(self, mode: Literal["view", "control"] = "view", *, token_ttl_s: int | None = None) -> LiveView:
        """A signed URL of the desktop in a browser (noVNC): ``view`` watches only, ``control`` takes input."""
        return LiveView.from_api(self._sender.json(calls.desktop_view(self._sandbox_id, mode, token_ttl_s)))

    def browser(self) -> contextlib.AbstractContextManager[str]:
        """``with sandbox.desktop.browser() as url:`` the sandbox's Chromium (DevTools protocol) at a local
        ``http://127.0.0.1:<port>`` while the block runs, for ``playwright.chromium.connect_over_cdp(url)``
        (needs ``forkyard[forward]``).  A fork is handed over before its browser answers (the desktop
        environment does not hold a sandbox back for it): this waits for it first, up to a minute."""
        return self._browser()

    @contextlib.contextmanager
    def _browser(self) -> Iterator[str]:
        Ports(self._sender, self._sandbox_id).wait_for_port(BROWSER_PORT, timeout_s=BROWSER_WAIT_S)
        with forwarded(self._sender.settings, self._sandbox_id, BROWSER_PORT) as url:
            yield url


class Processes:
    """``sandbox.processes``: commands started without waiting for them, and terminals."""

    def __init__(self, sender: Sender, sandbox_id: str) -> None:
        self._sender, self._sandbox_id = sender, sandbox_id

    def start(self, cmd: str | list[str], **options: Unpack[ProcessOptions]) -> Process:
        """Start a command (a string runs under ``/bin/sh -c``, a list is argv) and return once it runs.

        Options: ``cwd``, ``env``, ``timeout_s``, ``pty`` (``{"rows": 24, "cols": 80}``: on a
        terminal), ``output`` (``text`` or ``base64``).  A program that cannot start is an exited
        process (exit code 127 or 126, the reason on its stderr).  At most 32 per sandbox:
        ``RateLimited`` (``too_many_processes``) beyond."""
        return Process(self._sender, self._sandbox_id, self._sender.json(calls.start_process(self._sandbox_id, cmd, options)))

    def list(self) -> list[Process]:
        """Running ones, and exited ones not yet waited for; oldest first."""
        data = self._sender.json(calls.list_processes(self._sandbox_id))
        return [Process(self._sender, self._sandbox_id, row) for row in data["processes"]]

    def get(self, pid: int) -> Process:
        """A process by its pid (inside the sandbox), its output not read yet."""
        return Process(self._sender, self._sandbox_id, {"pid": pid}).refresh()


class Process(ProcessFields):
    """A background process: its fields (``pid``, ``state``, ``exit_code``, ...) and what can be done to it.

    ``output()`` hands out what it wrote since the last call; ``wait()`` until it exits (which
    reaps it: its last output then comes from ``output()``); ``signal()``, ``kill()``;
    ``write()`` to its stdin or terminal, ``resize()`` its terminal.
    """

    def __init__(self, sender: Sender, sandbox_id: str, data: Mapping[str, Any]) -> None:
        self._sender, self.sandbox_id = sender, sandbox_id
        self._encoding = str(data.get("encoding", "text"))
        if "state" in data:
            self._answered(data)
        else:
            self._apply(data)

    def refresh(self) -> Process:
        """Reload its state (and read its new output, kept for ``output()``)."""
        if not self._reaped:
            call = calls.get_process(self.sandbox_id, self.pid, *self._offsets, self._encoding)
            self._answered(self._sender.json(call))
        return self

    def output(self) -> ProcessOutput:
        """What it wrote since the last call (each of ``stdout`` and ``stderr`` a ``ProcessStream``)."""
        self.refresh()
        return self._take()

    def wait(self, timeout_s: float | None = None) -> Process:
        """Until it exits, or ``timeout_s`` passes (it is then returned still running).  An exit seen
        here reaps it: the API forgets it, and what it wrote that was not read comes from ``output()``."""
        deadline = Deadline(timeout_s, f"process {self.pid} to exit")
        while not self._reaped:
            call = calls.wait_process(self.sandbox_id, self.pid, min(MAX_WAIT_S, deadline.left()), *self._offsets, self._encoding)
            self._answered(self._sender.json(call))
            self._reaped = self.state == "exited"
            if deadline.left() <= 0:
                break
        return self

    def signal(self, signal: str | int = "TERM", *, group: bool = False) -> Process:
        """Send it a signal (a name such as ``TERM``, ``INT``, ``KILL``, or a number); ``group``: its whole
        process group.  One that no longer runs raises ``Conflict`` (``process_not_running``)."""
        self._apply(self._sender.json(calls.signal_process(self.sandbox_id, self.pid, signal, group)))
        return self

    def kill(self) -> Process:
        """SIGKILL to it and its process group."""
        return self.signal("KILL", group=True)

    def write(self, data: str | bytes, *, eof: bool = False) -> int:
        """Write to its stdin (or terminal); ``eof`` then closes its stdin (a terminal gets ^D).  Bytes written."""
        answer = self._sender.json(calls.process_input(self.sandbox_id, self.pid, data, eof))
        self._apply(answer)
        return int(answer["written"])

    def resize(self, rows: int, cols: int) -> Process:
        """Its terminal's new size (a process started with ``pty``)."""
        self._apply(self._sender.json(calls.resize_process(self.sandbox_id, self.pid, rows, cols)))
        return self


class Launches(Resource[Sender]):
    """``fy.launches``: many sandboxes in one call."""

    def __init__(self, sender: Sender, keeper: LeaseKeeper | None = None) -> None:
        super().__init__(sender)
        self._keeper = keeper

    def create(
        self, *, count: int, memory_group_size: int = 1, memory_group_cpu: str = "each", **options: Unpack[SandboxOptions]
    ) -> Launch:
        """Launch ``count`` sandboxes from a ``template`` or a ``snapshot`` (same options as
        ``sandboxes.create``).  It answers at once; follow it with ``wait()``, or ``with`` it
        to tear it down at the block's end.  ``memory_group_size``: for launches of thousands, its
        sandboxes share a memory cgroup that many at a time on each host; ``memory_group_cpu="group"``:
        and one CPU quota a group (the API's fields say the trades)."""
        options = _with_lease(options, self._keeper, "launches.create")
        call = calls.create_launch(count, options, memory_group_size, memory_group_cpu)
        return Launch(self._sender, self._sender.json(call))

    def get(self, launch_id: str) -> Launch:
        return Launch(self._sender, self._sender.json(calls.get_launch(launch_id)))

    def list(self, *, limit: int = 50, cursor: str | None = None) -> Page[Launch]:
        """The team's launches, newest first, a page at a time (pass ``next_cursor`` back as ``cursor``)."""
        data = self._sender.json(calls.list_launches(limit, cursor))
        return Page([Launch(self._sender, row) for row in data["launches"]], data.get("next_cursor"))

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

    def metrics(self) -> Metrics:
        """Its running and paused members' metrics, summed (``Metrics``: ``sandboxes`` measured)."""
        return Metrics.from_api(self._sender.json(calls.launch_metrics(self.id)))

    def wait(
        self, *, timeout_s: float | None = None, poll_s: float = 0.25, on_progress: Callable[[Launch], None] | None = None
    ) -> Iterator[Sandbox]:
        """Iterate over the launch's sandboxes, each as it becomes ready; once none is still queued or
        creating, the ones that failed (or ended) come last, so that every sandbox is handed out once.

        The web server pushes them (``GET /launches/{id}/arrivals``) as it is iterated
        (``list(launch.wait())`` waits for them all); a stream cut off is asked for again after
        ``poll_s``, without handing anyone out twice.  ``on_progress(launch)`` is called whenever the
        progress moved (every 2 s at least).  Raises ``WaitTimeout`` after ``timeout_s``.
        """
        deadline = Deadline(timeout_s, f"launch {self.id}")
        arrivals = Arrivals(self.id)
        while True:
            try:
                with self._sender.stream(arrivals.call) as response:
                    for line in response.iter_lines():
                        event = arrivals.read(line)
                        if event is not None:
                            kind, data = event
                            if kind == "sandbox":
                                yield Sandbox(self._sender, data)
                                continue
                            self._apply(data)
                            if on_progress is not None:
                                on_progress(self)
                            if kind == "end":
                                return
                        deadline.check()
            except Unavailable as error:
                arrivals.again(error)
            time.sleep(deadline.next_poll(poll_s))

    def _pages(self, call: Callable[[str | None], Call]) -> Iterator[Sandbox]:
        """The sandboxes of every page of a listing of its members."""
        cursor: str | None = None
        while True:
            data = self._sender.json(call(cursor))
            for row in data["sandboxes"]:
                yield Sandbox(self._sender, row)
            cursor = data.get("next_cursor")
            if not cursor:
                return

    def sandboxes(self, *, state: str | None = None, page_size: int = 1000) -> Iterator[Sandbox]:
        """The launch's sandboxes in launch order, optionally only those in ``state``."""
        return self._pages(lambda cursor: calls.launch_sandboxes(self.id, state, page_size, cursor))

    def kill(self) -> Launch:
        """Tear it down: every sandbox in it, whatever its state."""
        self._apply(self._sender.json(calls.destroy_launch(self.id)))
        return self

    destroy = kill

    def __enter__(self) -> Launch:
        Unwinding.enter()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        try:
            self.kill()
        finally:
            Unwinding.leave()


class Snapshots(Resource[Sender]):
    """``fy.snapshots``: saved sandbox states to fork from."""

    def get(self, snapshot_id: str) -> Snapshot:
        return Snapshot(self._sender, self._sender.json(calls.get_snapshot(snapshot_id)))

    def list(
        self,
        *,
        state: str | None = None,
        label: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
        before: str | None = None,
    ) -> Page[Snapshot]:
        """The team's snapshots, newest first (deleted ones are not listed), a page at a time: pass
        ``next_cursor`` back as ``cursor``.  ``label`` is ``key=value`` or ``key``.  (``before``, a
        snapshot id, is the older way to page.)"""
        data = self._sender.json(calls.list_snapshots(state, label, limit, cursor, before))
        return Page([Snapshot(self._sender, row) for row in data["snapshots"]], data.get("next_cursor"))

    def list_all(self, *, state: str | None = None, label: str | None = None, page_size: int = 500) -> Iterator[Snapshot]:
        """Every matching snapshot, page by page."""
        return every(lambda cursor: self.list(state=state, label=label, limit=page_size, cursor=cursor))

    def delete(self, snapshot_id: str) -> Snapshot:
        """Delete a snapshot: its saved-state billing ends now.  Refused with ``Conflict``
        (``snapshot_in_use``, ``details["forks_alive"]``) while sandboxes forked from it live."""
        return Snapshot(self._sender, self._sender.json(calls.delete_snapshot(snapshot_id)))

    def import_image(
        self,
        archive: str | os.PathLike[str] | bytes | IO[bytes],
        *,
        name: str,
        kind: calls.ImageKind = "auto",
        user: str | None = None,
    ) -> Snapshot:
        """An image as a snapshot of the team's, ready when this returns: ``archive`` is a path, bytes or a
        binary file of ``podman save --format oci-archive``, ``docker save``, or a root filesystem's
        tarball (``kind="tar"``), streamed, never read whole.  Fork it (``snapshot=``) or build on it
        (``TemplateSpec(f"snapshot:{snap.id}")``).  ``InvalidRequest`` (``invalid_image``) if it is none."""
        if isinstance(archive, (str, os.PathLike)):
            with open(archive, "rb") as stream:
                return self.import_image(stream, name=name, kind=kind, user=user)
        return Snapshot(self._sender, self._sender.json(calls.import_image(archive, name, kind, user)))


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
