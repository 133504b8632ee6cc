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
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Generator, Mapping
from types import TracebackType
from typing import Any, Unpack

import httpx

from . import _calls as calls
from . import client as sync
from ._calls import Body, ExecOptions, SandboxOptions, Services
from ._http import AsyncSender, Call, RetryPolicy, Settings
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

ProgressCallback = Callable[["AsyncLaunch"], Awaitable[None] | None]


class AsyncClient(ClientBase[AsyncSender]):
    def __init__(self, url: str | None = None, api_key: str | None = None, *, timeout_s: float = 60.0,
                 max_retries: int | None = None, retry: RetryPolicy | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(AsyncSender(Settings.resolve(url, api_key, timeout_s=timeout_s, max_retries=max_retries, retry=retry), transport))
        self.sandboxes = AsyncSandboxes(self._sender)
        self.launches = AsyncLaunches(self._sender)
        self.snapshots = AsyncSnapshots(self._sender)

    async def close(self) -> None:
        await self._sender.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        await self.close()


class AsyncSandboxes(Resource[AsyncSender]):
    async def create(self, *, wait_timeout_s: float = 300.0, **options: Unpack[SandboxOptions]) -> AsyncSandbox:
        sandbox = AsyncSandbox(self._sender, await self._sender.json(calls.create_sandbox(options)))
        if options.get("wait", True):
            await sandbox.wait_started(timeout_s=wait_timeout_s)
        return sandbox

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        return AsyncSandbox(self._sender, await self._sender.json(calls.get_sandbox(sandbox_id)))

    def ref(self, sandbox_id: str) -> AsyncSandbox:
        return AsyncSandbox(self._sender, {"id": sandbox_id})

    async def list(self, *, state: str | None = None, label: str | None = None, limit: int = 100,
                   cursor: str | None = None) -> Page[AsyncSandbox]:
        data = await self._sender.json(calls.list_sandboxes(state, label, limit, cursor))
        return Page([AsyncSandbox(self._sender, row) for row in data["sandboxes"]], data.get("next_cursor"))

    async def list_all(self, *, state: str | None = None, label: str | None = None, page_size: int = 500) -> AsyncIterator[AsyncSandbox]:
        cursor: str | None = None
        while True:
            page = await self.list(state=state, label=label, limit=page_size, cursor=cursor)
            for sandbox in page:
                yield sandbox
            if not page.next_cursor:
                return
            cursor = page.next_cursor

    async def kill(self, sandbox_id: str, *, wait: bool = True) -> AsyncSandbox:
        return AsyncSandbox(self._sender, await self._sender.json(calls.destroy_sandbox(sandbox_id, wait)))

    destroy = kill


class AsyncSandbox(SandboxFields):
    def __init__(self, sender: AsyncSender, data: Mapping[str, Any]) -> None:
        self._sender = sender
        self._apply(data)
        self.files = AsyncFiles(sender, self.id)

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

    async def snapshot(self, *, name: str, services: Services = (), labels: Mapping[str, str] | None = None,
                       idempotency_key: str | None = None, wait: bool = True, timeout_s: float | None = 600.0) -> AsyncSnapshot:
        data = await self._sender.json(calls.snapshot_sandbox(self.id, name, labels, services, idempotency_key))
        snapshot = AsyncSnapshot(self._sender, data)
        return await snapshot.wait(timeout_s=timeout_s) if wait else snapshot

    async def kill(self, *, wait: bool = True) -> AsyncSandbox:
        self._apply(await self._sender.json(calls.destroy_sandbox(self.id, wait)))
        return self

    destroy = kill

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        await self.kill(wait=False)


class AsyncExecStream:
    """A streamed command: ``async for`` its ``ExecChunk``s as they come; then ``result``."""

    def __init__(self, sender: AsyncSender, call: Call, encoding: str = "text") -> None:
        self._sender, self._call, self._encoding = sender, call, encoding
        self._events: AsyncGenerator[ExecChunk, None] | None = None
        self.result: ExecResult | None = None

    def __aiter__(self) -> AsyncIterator[ExecChunk]:
        if self._events is None:
            self._events = self._read()
        return self._events

    async def _read(self) -> AsyncGenerator[ExecChunk, None]:
        async with self._sender.stream(self._call) as response:
            async for line in response.aiter_lines():
                event = calls.stream_event(line, self._encoding)
                if isinstance(event, ExecResult):
                    self.result = event
                elif event is not None:
                    yield event

    async def close(self) -> None:
        if self._events is not None:
            await self._events.aclose()

    async def __aenter__(self) -> AsyncExecStream:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        await self.close()


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


class AsyncLaunches(Resource[AsyncSender]):
    async def create(self, *, count: int, **options: Unpack[SandboxOptions]) -> AsyncLaunch:
        return AsyncLaunch(self._sender, await self._sender.json(calls.create_launch(count, options)))

    async def get(self, launch_id: str) -> AsyncLaunch:
        return AsyncLaunch(self._sender, await self._sender.json(calls.get_launch(launch_id)))

    async def list(self, *, limit: int = 50) -> list[AsyncLaunch]:
        return [AsyncLaunch(self._sender, row) for row in await self._sender.json(calls.list_launches(limit))]

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

    def wait(self, *, timeout_s: float | None = None, poll_s: float = 0.25, on_progress: ProgressCallback | None = None) -> AsyncLaunchWait:
        """Wait until no sandbox is still queued or creating: ``await`` it for the list of the
        launch's sandboxes, or ``async for`` them page by page.  ``on_progress(launch)``
        (a function or a coroutine function) is called after every poll."""
        return AsyncLaunchWait(self, timeout_s, poll_s, on_progress)

    async def _settle(self, timeout_s: float | None, poll_s: float, on_progress: ProgressCallback | None) -> None:
        deadline = Deadline(timeout_s, f"launch {self.id}")
        await self.refresh()
        while True:
            if on_progress is not None:
                outcome = on_progress(self)
                if outcome is not None:
                    await outcome
            if self.settled:
                return
            await asyncio.sleep(deadline.next_poll(poll_s))
            await self.refresh()

    async def sandboxes(self, *, state: str | None = None, page_size: int = 1000) -> AsyncIterator[AsyncSandbox]:
        cursor: str | None = None
        while True:
            data = await self._sender.json(calls.launch_sandboxes(self.id, state, page_size, cursor))
            for row in data["sandboxes"]:
                yield AsyncSandbox(self._sender, row)
            cursor = data.get("next_cursor")
            if not cursor:
                return

    async def kill(self) -> AsyncLaunch:
        self._apply(await self._sender.json(calls.destroy_launch(self.id)))
        return self

    destroy = kill


class AsyncSnapshots(Resource[AsyncSender]):
    async def get(self, snapshot_id: str) -> AsyncSnapshot:
        return AsyncSnapshot(self._sender, await self._sender.json(calls.get_snapshot(snapshot_id)))

    async def list(self, *, state: str | None = None, label: str | None = None, limit: int = 100,
                   before: str | None = None) -> list[AsyncSnapshot]:
        rows = await self._sender.json(calls.list_snapshots(state, label, limit, before))
        return [AsyncSnapshot(self._sender, row) for row in rows]

    async def list_all(self, *, state: str | None = None, label: str | None = None, page_size: int = 500) -> AsyncIterator[AsyncSnapshot]:
        before: str | None = None
        while True:
            page = await self.list(state=state, label=label, limit=page_size, before=before)
            for snapshot in page:
                yield snapshot
            if len(page) < page_size:
                return
            before = page[-1].id

    async def delete(self, snapshot_id: str) -> AsyncSnapshot:
        return AsyncSnapshot(self._sender, await self._sender.json(calls.delete_snapshot(snapshot_id)))


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
    """``await launch.wait()`` -> every sandbox in a list; ``async for child in launch.wait()`` -> one by one."""

    def __init__(self, launch: AsyncLaunch, timeout_s: float | None, poll_s: float, on_progress: ProgressCallback | None) -> None:
        self._launch, self._timeout_s, self._poll_s, self._on_progress = launch, timeout_s, poll_s, on_progress

    async def _all(self) -> list[AsyncSandbox]:
        return [sandbox async for sandbox in self]

    def __await__(self) -> Generator[Any, None, list[AsyncSandbox]]:
        return self._all().__await__()

    async def __aiter__(self) -> AsyncIterator[AsyncSandbox]:
        await self._launch._settle(self._timeout_s, self._poll_s, self._on_progress)
        async for sandbox in self._launch.sandboxes():
            yield sandbox


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
