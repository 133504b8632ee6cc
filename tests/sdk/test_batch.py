"""Batches and launches through the SDK and the CLI: exec_many, kill_all, wait() as sandboxes arrive,
labels that change, and options the SDK does not know."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from forkyard import (
    AsyncClient,
    BatchResult,
    Client,
    Conflict,
    InvalidRequest,
    Launch,
    NotFound,
    Sandbox,
    Service,
    Snapshot,
    UnknownOption,
)
from tests.sdk.conftest import Run
from tests.support.stack import Stack

pytestmark = pytest.mark.root


@pytest.fixture
def tag() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture
def four(fy: Client, tag: str) -> Iterator[list[Sandbox]]:
    made = [fy.sandboxes.create(template="base", size="tiny", ttl_s=300, labels={"many": tag}) for _ in range(4)]
    yield made
    fy.sandboxes.kill_all(label=f"many:{tag}")


def test_exec_many_by_label_ids_and_launch(fy: Client, fy_b: Client, four: list[Sandbox], tag: str) -> None:
    batch = fy.exec_many("echo $((6*7)); hostname >&2", label=f"many:{tag}", timeout=30)
    results = list(batch)
    assert sorted(result.sandbox_id for result in results) == sorted(sandbox.id for sandbox in four)
    assert all(isinstance(result, BatchResult) and result.ok and result.stdout == "42\n" for result in results)
    assert len({result.stderr for result in results}) == 4
    assert batch.summary is not None and (batch.summary.sandboxes, batch.summary.succeeded) == (4, 4)

    theirs = fy_b.sandboxes.create(template="base", size="tiny", ttl_s=120)
    try:
        mixed = {result.sandbox_id: result for result in fy.exec_many(["sh", "-c", "exit 5"], sandbox_ids=[four[0], theirs.id])}
        assert mixed[four[0].id].exit_code == 5 and not mixed[four[0].id].ok
        assert isinstance(mixed[theirs.id].error, NotFound) and mixed[theirs.id].error.code == "sandbox_not_found"
        assert mixed[theirs.id].result is None and mixed[theirs.id].exit_code is None
    finally:
        theirs.kill()

    with fy.launches.create(template="base", size="tiny", count=3, ttl_s=120) as launch:
        children = list(launch.wait(timeout_s=120))
        by_launch = list(fy.exec_many("cat /etc/hostname", launch=launch))
        assert sorted(result.sandbox_id for result in by_launch) == sorted(child.id for child in children)
    assert launch.state in ("stopping", "stopped"), "leaving the block tore the launch down"

    with pytest.raises(InvalidRequest) as refused:
        list(fy.exec_many("true"))
    assert refused.value.field == "sandbox_ids"


def test_async_exec_many_and_kill_all(stack: Stack, four: list[Sandbox], tag: str) -> None:
    async def scenario() -> None:
        async with AsyncClient(stack.url, stack.teams[0].key) as fy:
            batch = fy.exec_many("pwd", sandbox_ids=[sandbox.id for sandbox in four], workdir="/tmp")
            results = [result async for result in batch]
            assert [result.stdout for result in results] == ["/tmp\n"] * 4
            assert batch.summary is not None and batch.summary.succeeded == 4
            killed = await fy.sandboxes.kill_all(label=f"many={tag}")
            assert (killed.count, killed.stopping, killed.destroyed) == (4, 4, 0)
            with pytest.raises(InvalidRequest) as refused:
                await fy.sandboxes.kill_all()
            assert refused.value.code == "filter_required"

    asyncio.run(scenario())


def test_the_cli_runs_a_command_in_every_sandbox_of_a_label_and_kills_them(
    cli: Run, fy: Client, four: list[Sandbox], tag: str
) -> None:
    ran = cli("exec", "--label", f"many:{tag}", "--", "sh", "-c", "echo out; echo err >&2")
    assert ran.returncode == 0, ran.stderr
    assert sorted(ran.stdout.splitlines()) == sorted(f"{sandbox.id}: out" for sandbox in four)
    assert "4 sandboxes: 4 succeeded, 0 failed, 0 could not run it" in ran.stderr
    assert all(f"{sandbox.id}: err" in ran.stderr for sandbox in four)
    failing = cli("exec", "--label", f"many:{tag}", "exit 3")
    assert failing.returncode == 1 and failing.stderr.count(": exit 3") == 4
    lines = cli("--json", "exec", "--label", f"many:{tag}", "echo hi").stdout.splitlines()
    assert [json.loads(line)["result"]["stdout"] for line in lines] == ["hi\n"] * 4
    usage = cli("exec", "--label", "a:b", "--launch", "launch_x", "true")
    assert usage.returncode == 2 and "usage:" in usage.stderr
    assert cli("kill").returncode == 2
    killed = cli("kill", "--label", f"many:{tag}")
    assert killed.returncode == 0 and killed.stdout.startswith("asked 4 sandboxes to stop"), killed.stdout
    for sandbox in four:
        assert sandbox.refresh().state in ("stopping", "destroyed")


def test_labels_change(fy: Client, four: list[Sandbox], tag: str) -> None:
    sandbox = four[0].update(labels={"many": f"{tag}-moved", "phase": "eval"})
    assert sandbox.labels == {"many": f"{tag}-moved", "phase": "eval"}
    assert [item.id for item in fy.sandboxes.list(label=f"many:{tag}-moved")] == [sandbox.id]
    assert len(list(fy.exec_many("true", label=f"many:{tag}"))) == 3


def test_unknown_options_are_errors_and_aliases_are_not(fy: Client, four: list[Sandbox]) -> None:
    sandbox = four[0]
    timed = sandbox.exec("sleep 5", timeout=0.3)
    assert timed.timed_out, "timeout is timeout_s's other name"
    assert sandbox.exec("pwd", workdir="/tmp").stdout == "/tmp\n"
    for bad in ({"tiemout": 1}, {"usr": "nobody"}, {"timeout": 1, "timeout_s": 2}, {"workdir": "/", "cwd": "/"}):
        with pytest.raises(UnknownOption) as raised:
            sandbox.exec("true", **bad)  # type: ignore[arg-type]  # what a typo looks like at run time
        assert isinstance(raised.value, TypeError) and isinstance(raised.value, InvalidRequest)
        assert raised.value.field == next(iter(bad)) and next(iter(bad)) in str(raised.value)
    with pytest.raises(UnknownOption):
        sandbox.exec_stream("true", tiemout=1)  # type: ignore[call-arg]
    with pytest.raises(UnknownOption) as raised:
        fy.sandboxes.create(template="base", size="tiny", ttl=60)  # type: ignore[call-arg]
    assert raised.value.field == "ttl" and "ttl_s" in raised.value.message
    with pytest.raises(UnknownOption):
        fy.launches.create(template="base", count=2, sizes="tiny")  # type: ignore[call-arg]
    with pytest.raises(UnknownOption):
        fy.exec_many("true", label="a:b", timeout_ms=5)  # type: ignore[call-arg]


@pytest.fixture(scope="module")
def snapshots(stack: Stack) -> Iterator[dict[str, Snapshot]]:
    """A snapshot whose forks become ready only after a few seconds, and one whose forks never do."""
    with Client(stack.url, stack.teams[0].key) as fy:
        source = fy.sandboxes.create(template="base", size="tiny", ttl_s=300)
        source.exec("mkdir -p /srv && echo up > /srv/index.html")
        made = {
            "slow": source.snapshot(name="slow", services=[Service.tcp("web", "sleep 3; httpd -f -p 8080 -h /srv", 8080)]),
            "never": source.snapshot(name="never", services=[Service.tcp("never", "sleep 600", 9999, timeout_s=1)]),
        }
        source.kill()
        yield made
        for snapshot in made.values():
            try:
                snapshot.delete()
            except Conflict:
                pass


def test_wait_hands_out_each_sandbox_as_it_becomes_ready(fy: Client, snapshots: dict[str, Snapshot]) -> None:
    """A fork is ready only once its service answers (3 s), and a host makes a launch's sandboxes a
    batch at a time (16 at once): the first ones come while the last are still being made."""
    count = 40
    with fy.launches.create(snapshot=snapshots["slow"].id, count=count, size="tiny", ttl_s=300) as launch:
        polls: list[Launch] = []
        arrived: list[tuple[Sandbox, int]] = []
        for child in launch.wait(timeout_s=300, poll_s=0.05, on_progress=lambda current: polls.append(current)):
            arrived.append((child, launch.progress.pending))
        assert len(arrived) == count and len({child.id for child, _ in arrived}) == count
        assert all(child.running for child, _ in arrived)
        assert arrived[0][1] > 0, "the first sandbox came only once every one had started"
        assert launch.progress.running == count


def test_wait_reports_the_sandboxes_that_failed_at_the_end(fy: Client, snapshots: dict[str, Snapshot]) -> None:
    async_children: list[Any] = []
    with fy.launches.create(snapshot=snapshots["never"].id, count=3, size="tiny", ttl_s=120) as launch:
        children = list(launch.wait(timeout_s=120))
        assert len(children) == 3 and {child.state for child in children} == {"failed"}
        assert {child.error.code for child in children if child.error} == {"service_not_ready"}

        async def scenario() -> None:
            async with AsyncClient(fy.url, fy._sender.settings.api_key) as client:
                again = await client.launches.get(launch.id)
                async_children.extend(await again.wait(timeout_s=60))

        asyncio.run(scenario())
    assert sorted(child.id for child in async_children) == sorted(child.id for child in children)
