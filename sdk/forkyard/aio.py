"""The asynchronous client: ``AsyncClient`` mirrors ``Client`` with ``async`` methods.

```python
from forkyard import AsyncClient

async with AsyncClient() as fy:
    sb = await fy.sandboxes.create(template="base", size="tiny")
    print((await sb.exec("uname -sr")).stdout)
    async for chunk in sb.exec_stream("for i in 1 2 3; do echo $i; sleep 1; done"):
        print(chunk.data, end="")
    snap = await sb.snapshot(name="deps-installed")     # waits until it is ready
    launch = await fy.launches.create(snapshot=snap.id, count=100)
    async for child in launch.wait():
        ...
    await sb.kill()
```

The requests are the same as the sync client's (``_calls``); so are the
docstrings, which are copied over from ``forkyard.client`` at import.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable, Generator, Iterable, Mapping
from datetime import datetime
from types import TracebackType
from typing import Any, Generic, Literal, Self, TypeVar, Unpack, cast

import httpx

from . import _calls as calls
from . import _grading, _trees
from . import client as sync
from ._calls import MAX_WAIT_S, Body, ExecOptions, PortAuth, ProcessOptions, SandboxOptions, Services
from ._desktop import BROWSER_PORT, BROWSER_WAIT_S, DesktopActions, async_forwarded, screenshot_body
from ._http import AsyncSender, Call, RetryPolicy, Settings
from ._lifetime import AsyncLeaseKeeper, ExitGuard, LeaseOptions, Unwinding, lease_options
from ._pages import Page, every_async
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

ProgressCallback = Callable[["AsyncLaunch"], Awaitable[None] | None]
Item = TypeVar("Item")
Last = TypeVar("Last")


class AsyncEndpoints(_grading.Endpoints[AsyncSender]):
    async def wait_ready(
        self, endpoint: str | _grading.DedicatedEndpoint, *, timeout_s: float = 600.0
    ) -> _grading.DedicatedEndpoint:
        """Until the endpoint answers (``ready``); ``ForkyardError`` (``endpoint_failed``) if it failed."""
        endpoint_id = endpoint if isinstance(endpoint, str) else endpoint.id
        return await _grading.wait_ready_async(self._sender, endpoint_id, timeout_s=timeout_s)


class AsyncClient(ClientBase[AsyncSender]):
    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout_s: float = 60.0,
        max_retries: int | None = None,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        lease: bool | LeaseOptions | None = None,
        kill_on_exit: bool = False,
        direct: bool | None = None,
    ) -> None:
        super().__init__(
            AsyncSender(
                Settings.resolve(url, api_key, timeout_s=timeout_s, max_retries=max_retries, retry=retry, direct=direct),
                transport,
            )
        )
        options = lease_options(lease, kill_on_exit)
        self._keeper = AsyncLeaseKeeper(self._sender, options) if options is not None else None
        self._guard = ExitGuard(self._sender.settings, self._keeper) if kill_on_exit and self._keeper is not None else None
        self.sandboxes = AsyncSandboxes(self._sender, self._keeper)
        self.launches = AsyncLaunches(self._sender, self._keeper)
        self.snapshots = AsyncSnapshots(self._sender)
        self.grades: _grading.Grades[AsyncSender] = _grading.Grades(self._sender)
        self.endpoints = AsyncEndpoints(self._sender)
        self._inference: Any = None

    @property
    def inference(self) -> Any:
        """The official ``openai.AsyncOpenAI`` client pointed at this forkyard (``<url>/api/v1/inference``, this
        key): what a judge that takes an ``AsyncOpenAI`` client takes. Needs ``forkyard[openai]``."""
        if self._inference is None:
            self._inference = _grading.inference_client(self._sender.settings, asynchronous=True)
        return self._inference

    @property
    def lease(self) -> Lease | None:
        return self._keeper.lease if self._keeper is not None else None

    def exec_many(
        self,
        cmd: str | list[str],
        *,
        sandbox_ids: Iterable[str | AsyncSandbox] | None = None,
        launch: str | AsyncLaunch | None = None,
        label: str | None = None,
        **options: Unpack[ExecOptions],
    ) -> AsyncExecBatch:
        return AsyncExecBatch(
            self._sender, calls.run_many(cmd, sandbox_ids=sandbox_ids, launch=launch, label=label, options=options)
        )

    async def close(self) -> None:
        try:
            if self._keeper is not None:
                await self._keeper.end()
            if self._guard is not None:
                self._guard.close()
        finally:
            if self._inference is not None:
                await self._inference.close()
            await self._sender.close()

    async def __aenter__(self) -> AsyncClient:
        Unwinding.enter_async()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        try:
            await self.close()
        finally:
            Unwinding.leave_async()


async def _with_lease(options: Mapping[str, Any], keeper: AsyncLeaseKeeper | None, where: str) -> SandboxOptions:
    checked = calls.sandbox_options(options, where)  # an unknown option is refused before a lease is taken for it
    if keeper is not None and "lease" not in checked:
        checked["lease"] = await keeper.lease_id()
    return checked


class AsyncSandboxes(Resource[AsyncSender]):
    def __init__(self, sender: AsyncSender, keeper: AsyncLeaseKeeper | None = None) -> None:
        super().__init__(sender)
        self._keeper = keeper

    async def create(self, *, wait_timeout_s: float = 300.0, **options: Unpack[SandboxOptions]) -> AsyncSandbox:
        call = calls.create_sandbox(await _with_lease(options, self._keeper, "sandboxes.create"))
        sandbox = AsyncSandbox(self._sender, await self._sender.json(call))
        if options.get("wait", True) and sandbox.starting:
            try:
                await sandbox.wait_started(timeout_s=wait_timeout_s)
            except BaseException:
                if sandbox.starting:
                    await sandbox.kill(wait=False)
                raise
        raise_if_failed(sandbox)
        return sandbox

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        return AsyncSandbox(self._sender, await self._sender.json(calls.get_sandbox(sandbox_id)))

    def ref(self, sandbox_id: str) -> AsyncSandbox:
        return AsyncSandbox(self._sender, {"id": sandbox_id})

    async def list(
        self, *, state: str | None = None, label: str | None = None, limit: int = 100, cursor: str | None = None
    ) -> Page[AsyncSandbox]:
        data = await self._sender.json(calls.list_sandboxes(state, label, limit, cursor))
        return Page([AsyncSandbox(self._sender, row) for row in data["sandboxes"]], data.get("next_cursor"))

    def list_all(
        self, *, state: str | None = None, label: str | None = None, page_size: int = 500
    ) -> AsyncIterator[AsyncSandbox]:
        return every_async(lambda cursor: self.list(state=state, label=label, limit=page_size, cursor=cursor))

    async def kill(self, sandbox_id: str, *, wait: bool = True) -> AsyncSandbox:
        return AsyncSandbox(self._sender, await self._sender.json(calls.destroy_sandbox(sandbox_id, wait)))

    destroy = kill

    async def kill_all(self, *, label: str | None = None, launch: str | AsyncLaunch | None = None) -> Killed:
        launch_id = None if launch is None else str(getattr(launch, "id", launch))
        return Killed.from_api(await self._sender.json(calls.destroy_sandboxes(label, launch_id)))


class AsyncSandbox(SandboxFields):
    def __init__(self, sender: AsyncSender, data: Mapping[str, Any]) -> None:
        self._sender = sender
        self._apply(data)
        self.files = AsyncFiles(sender, self.id)
        self.processes = AsyncProcesses(sender, self.id)
        self.ports = AsyncPorts(sender, self.id)
        self.desktop = AsyncDesktop(sender, self.id)

    def _apply(self, data: Mapping[str, Any]) -> None:
        super()._apply(data)
        self._sender.routes.learn(data)  # its data path: exec and files straight to its host

    async def refresh(self) -> AsyncSandbox:
        self._apply(await self._sender.json(calls.get_sandbox(self.id)))
        return self

    async def wait_started(self, *, timeout_s: float = 300.0, poll_s: float = 0.1) -> AsyncSandbox:
        deadline = Deadline(timeout_s, f"sandbox {self.id} to start")
        while self.starting:
            await asyncio.sleep(deadline.next_poll(poll_s))
            await self.refresh()
        raise_if_failed(self)
        return self

    async def exec(self, cmd: str | list[str], **options: Unpack[ExecOptions]) -> ExecResult:
        return ExecResult.from_api(await self._sender.json(calls.run(self.id, cmd, options)))

    def exec_stream(self, cmd: str | list[str], **options: Unpack[ExecOptions]) -> AsyncExecStream:
        return AsyncExecStream(self._sender, calls.run(self.id, cmd, options, stream=True), options.get("output", "text"))

    async def pause(self) -> AsyncSandbox:
        self._apply(await self._sender.json(calls.sandbox_action(self.id, "pause")))
        return self

    async def resume(self) -> AsyncSandbox:
        self._apply(await self._sender.json(calls.sandbox_action(self.id, "resume")))
        return self

    async def snapshot(
        self,
        *,
        name: str,
        services: Services = (),
        labels: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
        wait: bool = True,
        timeout_s: float | None = 600.0,
    ) -> AsyncSnapshot:
        data = await self._sender.json(calls.snapshot_sandbox(self.id, name, labels, services, idempotency_key))
        snapshot = AsyncSnapshot(self._sender, data)
        return await snapshot.wait(timeout_s=timeout_s) if wait else snapshot

    async def update(
        self,
        *,
        labels: Mapping[str, str] | None = None,
        ttl_s: int | None = None,
        expires_at: datetime | None = None,
        idle_timeout_s: int | None = None,
    ) -> AsyncSandbox:
        """Change it: ``labels`` replaces its labels (a launch's member keeps its ``launch`` label);
        ``ttl_s`` (seconds from now) or ``expires_at`` (a time with its zone) moves its expiry, within the
        team's maximum TTL (``InvalidRequest``, code ``ttl_over_maximum``); ``idle_timeout_s``: destroyed
        after this many seconds without an exec or a file call (0: never). Only what is given changes."""
        self._apply(await self._sender.json(calls.update_sandbox(self.id, labels, ttl_s, expires_at, idle_timeout_s)))
        return self

    async def metrics(self) -> Metrics:
        """What the kernel reports about it now (CPU time and share, memory and its peak, processes, disk used,
        OOM kills); a sandbox that is not running or paused raises ``Conflict`` (``sandbox_not_running``)."""
        return Metrics.from_api(await self._sender.json(calls.sandbox_metrics(self.id)))

    async def grade(self, cmd: str | list[str], *, reward_file: str | None = None, timeout_s: float = 600) -> _grading.Reward:
        """A test-based reward (as ``Sandbox.grade``)."""
        return _grading.Reward.from_api(
            await self._sender.json(_grading.grade_sandbox(self.id, cmd, reward_file=reward_file, timeout_s=timeout_s))
        )

    async def kill(self, *, wait: bool = True) -> AsyncSandbox:
        self._apply(await self._sender.json(calls.destroy_sandbox(self.id, wait)))
        return self

    destroy = kill

    async def __aenter__(self) -> AsyncSandbox:
        Unwinding.enter_async()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        try:
            await self.kill(wait=False)
        finally:
            Unwinding.leave_async()


class AsyncLineStream(Generic[Item, Last]):
    """An answer of newline-delimited JSON, read as it comes: ``async for`` its items; its one ``last``
    line (a result, a summary) is kept once the iteration is over."""

    def __init__(self, sender: AsyncSender, call: Call, parse: Callable[[str], Item | Last | None], last: type[Last]) -> None:
        self._sender, self._call, self._parse, self._last_type = sender, call, parse, last
        self._events: AsyncGenerator[Item, None] | None = None
        self.last: Last | None = None

    def __aiter__(self) -> AsyncIterator[Item]:
        if self._events is None:
            self._events = self._read()
        return self._events

    async def _read(self) -> AsyncGenerator[Item, None]:
        async with self._sender.stream(self._call) as response:
            async for line in response.aiter_lines():
                event = self._parse(line)
                if isinstance(event, self._last_type):
                    self.last = event
                elif event is not None:
                    yield cast(Item, event)  # neither None nor the last line's type: an item

    async def close(self) -> None:
        if self._events is not None:
            await self._events.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        await self.close()


class AsyncExecStream(AsyncLineStream[ExecChunk, ExecResult]):
    """A streamed command: ``async for`` its ``ExecChunk``s as they come; then ``result``."""

    def __init__(self, sender: AsyncSender, call: Call, encoding: str = "text") -> None:
        super().__init__(sender, call, lambda line: calls.stream_event(line, encoding), ExecResult)

    @property
    def result(self) -> ExecResult | None:
        return self.last


class AsyncExecBatch(AsyncLineStream[BatchResult, BatchSummary]):
    """A command in many sandboxes: ``async for`` a ``BatchResult`` per sandbox as each finishes; then ``summary``."""

    def __init__(self, sender: AsyncSender, call: Call) -> None:
        super().__init__(sender, call, calls.batch_line, BatchSummary)

    @property
    def summary(self) -> BatchSummary | None:
        return self.last


class AsyncWatchStream(AsyncLineStream[WatchEvent, WatchEvent]):
    """A watched directory: ``async for`` its ``WatchEvent``s; the last one (``end``) is ``end``."""

    def __init__(self, sender: AsyncSender, call: Call) -> None:
        super().__init__(sender, call, sync._watch_item, sync._WatchEnd)

    @property
    def end(self) -> WatchEvent | None:
        return self.last


class AsyncFiles:
    def __init__(self, sender: AsyncSender, sandbox_id: str) -> None:
        self._sender, self._sandbox_id = sender, sandbox_id

    async def read(self, path: str) -> bytes:
        return await self._sender.content(calls.read_file(self._sandbox_id, path))

    async def write(self, path: str, data: Body, *, mode: int = 0o644, make_parents: bool = True) -> FileWritten:
        return FileWritten.from_api(await self._sender.json(calls.write_file(self._sandbox_id, path, data, mode, make_parents)))

    async def list(self, path: str = "/") -> FileListing:
        return FileListing.from_api(await self._sender.json(calls.list_files(self._sandbox_id, path)))

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._sender.json(calls.remove_file(self._sandbox_id, path, recursive))

    async def download(self, path: str = "/") -> bytes:
        return await self._sender.content(calls.download(self._sandbox_id, path))

    async def download_stream(self, path: str = "/", chunk_size: int = 256 * 1024) -> AsyncIterator[bytes]:
        async with self._sender.stream(calls.download(self._sandbox_id, path)) as response:
            async for chunk in response.aiter_bytes(chunk_size):
                yield chunk

    async def upload(self, path: str, tar: Body) -> dict[str, Any]:
        result: dict[str, Any] = await self._sender.json(calls.upload(self._sandbox_id, path, tar))
        return result

    async def stat(self, path: str) -> FileEntry:
        return FileEntry.from_api(await self._sender.json(calls.stat_file(self._sandbox_id, path)))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except (NotFound, Conflict) as error:
            if error.code not in ("file_not_found", "not_a_directory"):
                raise  # the sandbox itself is not found, or not running
            return False
        return True

    async def rename(self, path: str, target: str, *, replace: bool = False) -> FileRenamed:
        return FileRenamed.from_api(await self._sender.json(calls.rename_file(self._sandbox_id, path, target, replace)))

    async def mkdir(self, path: str) -> None:
        await self._sender.json(calls.make_directory(self._sandbox_id, path))

    def watch(self, path: str = "/", *, timeout_s: float | None = None) -> AsyncWatchStream:
        return AsyncWatchStream(self._sender, calls.watch(self._sandbox_id, path, timeout_s))

    async def upload_dir(self, local: str | os.PathLike[str], remote: str) -> dict[str, Any]:
        archive = await asyncio.to_thread(_trees.pack, local)
        try:
            return await self.upload(remote, await asyncio.to_thread(archive.read))
        finally:
            archive.close()

    async def download_dir(self, remote: str, local: str | os.PathLike[str]) -> int:
        with _trees.spool() as archive:
            async for chunk in self.download_stream(remote):
                archive.write(chunk)
            archive.seek(0)
            return await asyncio.to_thread(_trees.unpack, archive, local)


class AsyncDesktop(DesktopActions[Awaitable[DesktopState]]):
    def __init__(self, sender: AsyncSender, sandbox_id: str) -> None:
        self._sender, self._sandbox_id = sender, sandbox_id

    async def info(self) -> DesktopState:
        return DesktopState.from_answer(await self._sender.json(calls.desktop_info(self._sandbox_id)))

    async def screenshot(
        self,
        *,
        scale: float | None = None,
        max_width: int | None = None,
        max_height: int | None = None,
        format: Literal["png", "jpeg"] = "png",
        quality: int | None = None,
    ) -> Screenshot:
        body = screenshot_body(scale, max_width, max_height, format, quality)
        return Screenshot.from_answer(await self._sender.json(calls.desktop_screenshot(self._sandbox_id, body)))

    def act(self, *actions: Mapping[str, Any]) -> Awaitable[DesktopState]:
        async def send() -> DesktopState:
            return DesktopState.from_answer(await self._sender.json(calls.desktop_actions(self._sandbox_id, actions)))

        return send()

    async def cursor(self) -> tuple[int, int]:
        state = await self.info()
        return state.cursor_x, state.cursor_y

    async def live_view(self, mode: Literal["view", "control"] = "view", *, token_ttl_s: int | None = None) -> LiveView:
        return LiveView.from_api(await self._sender.json(calls.desktop_view(self._sandbox_id, mode, token_ttl_s)))

    def browser(self) -> contextlib.AbstractAsyncContextManager[str]:
        """``async with sandbox.desktop.browser() as url:`` (see the sync client)."""
        return self._browser()

    @contextlib.asynccontextmanager
    async def _browser(self) -> AsyncIterator[str]:
        await AsyncPorts(self._sender, self._sandbox_id).wait_for_port(BROWSER_PORT, timeout_s=BROWSER_WAIT_S)
        async with async_forwarded(self._sender.settings, self._sandbox_id, BROWSER_PORT) as url:
            yield url


class AsyncPorts:
    """``sandbox.ports``: its TCP ports at preview URLs (``http://{port}-{sandbox}.{preview domain}/``)."""

    def __init__(self, sender: AsyncSender, sandbox_id: str) -> None:
        self._sender, self._sandbox_id = sender, sandbox_id

    async def expose(self, port: int, *, auth: PortAuth = "key", token_ttl_s: int | None = None) -> ExposedPort:
        """Reach ``port`` at a URL (``.url``): HTTP, streamed answers and websockets.  ``auth``: ``key``
        (send the team's API key in ``X-Forkyard-Key``), ``token`` (``.token_url``, signed, expiring after
        ``token_ttl_s``, an hour unless given) or ``public``.  Again: its ``auth`` changes, old tokens end.
        Until something listens there the URL answers 502 ``port_not_listening`` (``wait_for_port``)."""
        return ExposedPort.from_api(await self._sender.json(calls.expose_port(self._sandbox_id, port, auth, token_ttl_s)))

    async def list(self) -> list[ExposedPort]:
        """Its exposed ports, by number (a ``token`` port with a fresh signed URL)."""
        data = await self._sender.json(calls.list_ports(self._sandbox_id))
        return [ExposedPort.from_api(row) for row in data["ports"]]

    async def close(self, port: int) -> None:
        """Its URL answers 404 from now on."""
        await self._sender.json(calls.close_port(self._sandbox_id, port))

    async def wait_for_port(self, port: int, *, timeout_s: float = 30.0) -> None:
        """Until something in the sandbox accepts connections on ``port`` (exposed or not);
        ``WaitTimeout`` after ``timeout_s``."""
        deadline = Deadline(timeout_s, f"port {port} of {self._sandbox_id} to listen")
        while True:
            answer = await self._sender.json(calls.wait_port(self._sandbox_id, port, min(MAX_WAIT_S, deadline.left())))
            if answer["listening"]:
                return
            deadline.next_poll(0.0)  # raises once the time is up


class AsyncProcesses:
    def __init__(self, sender: AsyncSender, sandbox_id: str) -> None:
        self._sender, self._sandbox_id = sender, sandbox_id

    async def start(self, cmd: str | list[str], **options: Unpack[ProcessOptions]) -> AsyncProcess:
        data = await self._sender.json(calls.start_process(self._sandbox_id, cmd, options))
        return AsyncProcess(self._sender, self._sandbox_id, data)

    async def list(self) -> list[AsyncProcess]:
        data = await self._sender.json(calls.list_processes(self._sandbox_id))
        return [AsyncProcess(self._sender, self._sandbox_id, row) for row in data["processes"]]

    async def get(self, pid: int) -> AsyncProcess:
        return await AsyncProcess(self._sender, self._sandbox_id, {"pid": pid}).refresh()


class AsyncProcess(ProcessFields):
    def __init__(self, sender: AsyncSender, sandbox_id: str, data: Mapping[str, Any]) -> None:
        self._sender, self.sandbox_id = sender, sandbox_id
        self._encoding = str(data.get("encoding", "text"))
        if "state" in data:
            self._answered(data)
        else:
            self._apply(data)

    async def refresh(self) -> AsyncProcess:
        if not self._reaped:
            call = calls.get_process(self.sandbox_id, self.pid, *self._offsets, self._encoding)
            self._answered(await self._sender.json(call))
        return self

    async def output(self) -> ProcessOutput:
        await self.refresh()
        return self._take()

    async def wait(self, timeout_s: float | None = None) -> AsyncProcess:
        deadline = Deadline(timeout_s, f"process {self.pid} to exit")
        while not self._reaped:
            call = calls.wait_process(self.sandbox_id, self.pid, min(MAX_WAIT_S, deadline.left()), *self._offsets, self._encoding)
            self._answered(await self._sender.json(call))
            self._reaped = self.state == "exited"
            if deadline.left() <= 0:
                break
        return self

    async def signal(self, signal: str | int = "TERM", *, group: bool = False) -> AsyncProcess:
        self._apply(await self._sender.json(calls.signal_process(self.sandbox_id, self.pid, signal, group)))
        return self

    async def kill(self) -> AsyncProcess:
        return await self.signal("KILL", group=True)

    async def write(self, data: str | bytes, *, eof: bool = False) -> int:
        answer = await self._sender.json(calls.process_input(self.sandbox_id, self.pid, data, eof))
        self._apply(answer)
        return int(answer["written"])

    async def resize(self, rows: int, cols: int) -> AsyncProcess:
        self._apply(await self._sender.json(calls.resize_process(self.sandbox_id, self.pid, rows, cols)))
        return self


class AsyncLaunches(Resource[AsyncSender]):
    def __init__(self, sender: AsyncSender, keeper: AsyncLeaseKeeper | None = None) -> None:
        super().__init__(sender)
        self._keeper = keeper

    async def create(
        self, *, count: int, memory_group_size: int = 1, memory_group_cpu: str = "each", **options: Unpack[SandboxOptions]
    ) -> AsyncLaunch:
        options = await _with_lease(options, self._keeper, "launches.create")
        call = calls.create_launch(count, options, memory_group_size, memory_group_cpu)
        return AsyncLaunch(self._sender, await self._sender.json(call))

    async def get(self, launch_id: str) -> AsyncLaunch:
        return AsyncLaunch(self._sender, await self._sender.json(calls.get_launch(launch_id)))

    async def list(self, *, limit: int = 50, cursor: str | None = None) -> Page[AsyncLaunch]:
        data = await self._sender.json(calls.list_launches(limit, cursor))
        return Page([AsyncLaunch(self._sender, row) for row in data["launches"]], data.get("next_cursor"))

    async def kill(self, launch_id: str) -> AsyncLaunch:
        return AsyncLaunch(self._sender, await self._sender.json(calls.destroy_launch(launch_id)))

    destroy = kill


class AsyncLaunch(LaunchFields):
    def __init__(self, sender: AsyncSender, data: Mapping[str, Any]) -> None:
        self._sender = sender
        self._apply(data)

    async def refresh(self) -> AsyncLaunch:
        self._apply(await self._sender.json(calls.get_launch(self.id)))
        return self

    async def metrics(self) -> Metrics:
        """Its running and paused members' metrics, summed (``Metrics``: ``sandboxes`` measured)."""
        return Metrics.from_api(await self._sender.json(calls.launch_metrics(self.id)))

    def wait(
        self, *, timeout_s: float | None = None, poll_s: float = 0.25, on_progress: ProgressCallback | None = None
    ) -> AsyncLaunchWait:
        """``async for`` the launch's sandboxes, each as it becomes ready (the ones that failed or ended
        come last, once none is still queued or creating); or ``await`` it for the list of them all.
        ``on_progress(launch)`` (a function or a coroutine function) is called after every poll."""
        return AsyncLaunchWait(self, timeout_s, poll_s, on_progress)

    async def _arrivals(
        self, timeout_s: float | None, poll_s: float, on_progress: ProgressCallback | None
    ) -> AsyncIterator[AsyncSandbox]:
        deadline = Deadline(timeout_s, f"launch {self.id}")
        arrivals = Arrivals(self.id)
        while True:
            try:
                async with self._sender.stream(arrivals.call) as response:
                    async for line in response.aiter_lines():
                        event = arrivals.read(line)
                        if event is not None:
                            kind, data = event
                            if kind == "sandbox":
                                yield AsyncSandbox(self._sender, data)
                                continue
                            self._apply(data)
                            if on_progress is not None:
                                outcome = on_progress(self)
                                if outcome is not None:
                                    await outcome
                            if kind == "end":
                                return
                        deadline.check()
            except Unavailable as error:
                arrivals.again(error)
            await asyncio.sleep(deadline.next_poll(poll_s))

    async def _pages(self, call: Callable[[str | None], Call]) -> AsyncIterator[AsyncSandbox]:
        cursor: str | None = None
        while True:
            data = await self._sender.json(call(cursor))
            for row in data["sandboxes"]:
                yield AsyncSandbox(self._sender, row)
            cursor = data.get("next_cursor")
            if not cursor:
                return

    def sandboxes(self, *, state: str | None = None, page_size: int = 1000) -> AsyncIterator[AsyncSandbox]:
        return self._pages(lambda cursor: calls.launch_sandboxes(self.id, state, page_size, cursor))

    async def kill(self) -> AsyncLaunch:
        self._apply(await self._sender.json(calls.destroy_launch(self.id)))
        return self

    destroy = kill

    async def __aenter__(self) -> AsyncLaunch:
        Unwinding.enter_async()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        try:
            await self.kill()
        finally:
            Unwinding.leave_async()


class AsyncSnapshots(Resource[AsyncSender]):
    async def get(self, snapshot_id: str) -> AsyncSnapshot:
        return AsyncSnapshot(self._sender, await self._sender.json(calls.get_snapshot(snapshot_id)))

    async def list(
        self,
        *,
        state: str | None = None,
        label: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
        before: str | None = None,
    ) -> Page[AsyncSnapshot]:
        data = await self._sender.json(calls.list_snapshots(state, label, limit, cursor, before))
        return Page([AsyncSnapshot(self._sender, row) for row in data["snapshots"]], data.get("next_cursor"))

    def list_all(
        self, *, state: str | None = None, label: str | None = None, page_size: int = 500
    ) -> AsyncIterator[AsyncSnapshot]:
        return every_async(lambda cursor: self.list(state=state, label=label, limit=page_size, cursor=cursor))

    async def delete(self, snapshot_id: str) -> AsyncSnapshot:
        return AsyncSnapshot(self._sender, await self._sender.json(calls.delete_snapshot(snapshot_id)))

    async def import_image(
        self,
        archive: str | os.PathLike[str] | bytes | AsyncIterable[bytes],
        *,
        name: str,
        kind: calls.ImageKind = "auto",
        user: str | None = None,
    ) -> AsyncSnapshot:
        """An image as a snapshot (see the sync client): a path is read a chunk at a time off the loop."""
        body = _file_chunks(archive) if isinstance(archive, (str, os.PathLike)) else archive
        return AsyncSnapshot(self._sender, await self._sender.json(calls.import_image(body, name, kind, user)))


async def _file_chunks(path: str | os.PathLike[str], size: int = 1 << 20) -> AsyncIterator[bytes]:
    stream = await asyncio.to_thread(open, path, "rb")
    try:
        while chunk := await asyncio.to_thread(stream.read, size):
            yield chunk
    finally:
        stream.close()


class AsyncSnapshot(SnapshotFields):
    def __init__(self, sender: AsyncSender, data: Mapping[str, Any]) -> None:
        self._sender = sender
        self._apply(data)

    async def refresh(self) -> AsyncSnapshot:
        self._apply(await self._sender.json(calls.get_snapshot(self.id)))
        return self

    async def wait(self, *, timeout_s: float | None = 600.0) -> AsyncSnapshot:
        deadline = Deadline(timeout_s, f"snapshot {self.id} to be ready")
        delays = backoff()
        while self.creating:
            await asyncio.sleep(deadline.next_poll(next(delays)))
            await self.refresh()
        raise_if_snapshot_failed(self)
        return self

    async def delete(self) -> AsyncSnapshot:
        self._apply(await self._sender.json(calls.delete_snapshot(self.id)))
        return self


class AsyncLaunchWait:
    """``await launch.wait()`` -> every sandbox in a list; ``async for child in launch.wait()`` -> each as it is ready."""

    def __init__(self, launch: AsyncLaunch, timeout_s: float | None, poll_s: float, on_progress: ProgressCallback | None) -> None:
        self._launch, self._timeout_s, self._poll_s, self._on_progress = launch, timeout_s, poll_s, on_progress

    async def _all(self) -> list[AsyncSandbox]:
        return [sandbox async for sandbox in self]

    def __await__(self) -> Generator[Any, None, list[AsyncSandbox]]:
        return self._all().__await__()

    def __aiter__(self) -> AsyncIterator[AsyncSandbox]:
        return self._launch._arrivals(self._timeout_s, self._poll_s, self._on_progress)


def _copy_docstrings() -> None:
    """Give each async class and method the docstring of its sync twin, where it has none."""
    for name, value in list(globals().items()):
        twin = getattr(sync, name.removeprefix("Async"), None) if name.startswith("Async") else None
        if not isinstance(value, type) or twin is None:
            continue
        value.__doc__ = value.__doc__ or twin.__doc__
        for attribute, member in vars(value).items():
            original = getattr(twin, attribute, None)
            if callable(member) and not getattr(member, "__doc__", None) and original is not None:
                member.__doc__ = original.__doc__


_copy_docstrings()
