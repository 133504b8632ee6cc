"""AsyncClient: the same surface with coroutines and async iteration, against the real API."""

from __future__ import annotations

import asyncio
import time

import pytest

from forkyard import AsyncClient, AsyncLaunch, Conflict, NotFound
from tests.support.stack import Stack
from tests.support.stack import Team as StackTeam

pytestmark = pytest.mark.root


def test_sandbox_lifecycle(stack: Stack) -> None:
    async def scenario() -> None:
        async with AsyncClient(stack.url, stack.teams[0].key) as fy:
            sandbox = await fy.sandboxes.create(template="base", size="tiny", ttl_s=120, labels={"case": "async"})
            assert sandbox.running
            results = await asyncio.gather(*(sandbox.exec(f"echo {index}") for index in range(10)))
            assert [result.stdout for result in results] == [f"{index}\n" for index in range(10)]

            chunks = []
            stream = sandbox.exec_stream("echo a; sleep 0.3; echo b")
            async for chunk in stream:
                chunks.append((time.monotonic(), chunk.data))
            assert [data for _, data in chunks] == ["a\n", "b\n"] and chunks[1][0] - chunks[0][0] >= 0.2
            assert stream.result is not None and stream.result.exit_code == 0

            await sandbox.files.write("/data/x.txt", b"async bytes")
            assert await sandbox.files.read("/data/x.txt") == b"async bytes"
            assert [entry.name for entry in (await sandbox.files.list("/data")).entries] == ["x.txt"]
            archive = b"".join([chunk async for chunk in sandbox.files.download_stream("/data")])
            assert archive == await sandbox.files.download("/data")

            assert (await sandbox.pause()).state == "paused"
            assert (await sandbox.resume()).state == "running"

            page = await fy.sandboxes.list(label="case=async")
            assert [item.id for item in page] == [sandbox.id]
            assert [item.id async for item in fy.sandboxes.list_all(label="case=async")] == [sandbox.id]

            assert (await sandbox.kill()).state == "destroyed"
            with pytest.raises(Conflict):
                await sandbox.exec("true")
            with pytest.raises(NotFound):
                await fy.sandboxes.get("sb_missing")
            assert (await fy.me()).team_name == "Team A"
            assert "base" in [template.name for template in await fy.templates.list()]

    asyncio.run(scenario())


def test_launch_wait_awaited_and_iterated(stack: Stack, team_b: StackTeam) -> None:
    async def scenario() -> None:
        async with AsyncClient(stack.url, stack.teams[0].key) as fy, AsyncClient(stack.url, team_b.key) as fy_b:
            launch = await fy.launches.create(template="base", size="tiny", count=12, ttl_s=120)
            try:
                polls: list[int] = []

                async def on_progress(current: AsyncLaunch) -> None:
                    polls.append(current.progress.running)

                children = await launch.wait(timeout_s=120, poll_s=0.05, on_progress=on_progress)
                assert len(children) == 12 and polls[-1] == 12 and launch.progress.failed == 0
                iterated = [child.id async for child in launch.wait(timeout_s=10)]
                assert sorted(iterated) == sorted(child.id for child in children)
                outputs = await asyncio.gather(*(child.exec("hostname") for child in children))
                assert len({output.stdout for output in outputs}) == 12
                with pytest.raises(NotFound):
                    await fy_b.launches.get(launch.id)
                with pytest.raises(NotFound):
                    await fy_b.sandboxes.ref(children[0].id).exec("id")
            finally:
                await launch.kill()
            assert launch.state in ("stopping", "stopped")

    asyncio.run(scenario())
