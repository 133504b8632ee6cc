"""Launches through the SDK: dozens of real sandboxes in one call, waited for and torn down."""

from __future__ import annotations

import time

import pytest

from forkyard import Client, Launch, WaitTimeout

pytestmark = pytest.mark.root

COUNT = 40


def test_launch_wait_exec_kill(fy: Client) -> None:
    launch = fy.launches.create(template="base", size="tiny", count=COUNT, ttl_s=300, labels={"case": "launch"})
    try:
        assert launch.id.startswith("launch_") and launch.count == COUNT and launch.labels == {"case": "launch"}
        seen: list[tuple[int, int]] = []

        def on_progress(current: Launch) -> None:
            seen.append((current.progress.running, current.progress.pending))

        children = list(launch.wait(timeout_s=120, poll_s=0.05, on_progress=on_progress))
        assert seen and seen[-1] == (COUNT, 0)
        assert [running for running, _ in seen] == sorted(running for running, _ in seen)  # progress only grows
        assert launch.settled and launch.progress.running == COUNT and launch.progress.failed == 0
        assert launch.rate_per_s > 0 and launch.elapsed_s > 0

        assert len(children) == COUNT and len({child.id for child in children}) == COUNT
        assert all(child.running and child.launch == launch.id for child in children)
        hostnames = {child.exec("hostname").stdout for child in children[:: COUNT // 8]}
        assert len(hostnames) == len(children[:: COUNT // 8])  # each its own machine

        paged = list(launch.sandboxes(page_size=7))
        assert sorted(child.id for child in paged) == sorted(child.id for child in children)  # children came as they were ready
        assert [child.id for child in launch.sandboxes(state="running", page_size=1000)] == [child.id for child in paged]
        assert launch.id in [item.id for item in fy.launches.list()]
    finally:
        launch.kill()
    assert launch.state in ("stopping", "stopped")
    deadline = time.monotonic() + 60
    while fy.launches.get(launch.id).progress.ended < COUNT and time.monotonic() < deadline:
        time.sleep(0.2)
    assert fy.launches.get(launch.id).progress.ended == COUNT


def test_launch_idempotency_key(fy: Client) -> None:
    key = f"sdk-launch-{time.monotonic_ns()}"
    first = fy.launches.create(template="base", size="tiny", count=3, ttl_s=60, idempotency_key=key)
    try:
        again = fy.launches.create(template="base", size="tiny", count=3, ttl_s=60, idempotency_key=key)
        assert again.id == first.id
        assert len(list(first.wait(timeout_s=60))) == 3
    finally:
        fy.launches.kill(first.id)


def test_wait_times_out(fy: Client) -> None:
    launch = fy.launches.create(template="base", size="tiny", count=30, ttl_s=60)
    try:
        with pytest.raises(WaitTimeout) as raised:
            list(launch.wait(timeout_s=0.0001, poll_s=0.01))
        assert raised.value.code == "wait_timeout" and isinstance(raised.value, TimeoutError)
    finally:
        launch.kill()


def test_a_launch_in_memory_groups_with_the_groups_cpu(fy: Client) -> None:
    launch = fy.launches.create(template="base", size="tiny", count=4, ttl_s=300, memory_group_size=2, memory_group_cpu="group")
    try:
        assert (launch.memory_group_size, launch.memory_group_cpu) == (2, "group")
        children = list(launch.wait(timeout_s=120))
        assert len(children) == 4 and all(child.exec("echo grouped").stdout == "grouped\n" for child in children)
        assert fy.launches.get(launch.id).memory_group_cpu == "group"
    finally:
        launch.kill()
