"""32,752 at once (issue 16): one launch of the board's whole wordmark, real sandboxes, through the API.

Not in the default run (``-m scale``: it takes the machine for a quarter of
an hour and needs ``kernel.pid_max`` raised): ``scripts/test -m scale
tests/api/test_scale.py``, with ``FORKYARD_SCALE_COUNT`` for another count
(the host's proven maximum where 32,752 does not fit). The launch's
sandboxes share memory cgroups 64 at a time (``memory_group_size``: what
makes the kernel's memory per sandbox flat as their number grows), each
group with one CPU quota (``memory_group_cpu: "group"``: no quota write, and
so no kernel walk of every CPU cgroup, per create), on a
stack of its own set as a host of idle tiny sandboxes needs: the memory
limits overcommitted 512 times (32,752 x 128 MiB promise 4 TiB; only idle
memory makes that work) and the kernel's measured ~400 KiB per grouped
sandbox as admission's cost. A sample of them runs a command; the teardown must leave the engine's processes,
mounts, cgroups and sockets as they were, and the kernel's unreclaimable
memory within 5 % of where it started (bench/leak_bench.py's census).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.leak_bench import HOST_WIDE, census, grown, settle
from tests.support.stack import Stack, launch_members, running_stack, wait_for_launch

# The launch alone takes minutes here: far past the suite's 300 s per test.
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.scale, pytest.mark.timeout(3600)]
COUNT = int(os.environ.get("FORKYARD_SCALE_COUNT", "32752"))


@pytest.fixture
def scale_stack(work_dir: Path) -> Iterator[Stack]:
    stack = Stack(
        work_dir / "scale-stack",
        env={"FORKYARD_MEMORY_OVERCOMMIT": "512", "FORKYARD_SANDBOX_OVERHEAD_KIB": "400"},
        engine_env={"FORKYARD_ENGINE_SANDBOX_OVERHEAD_KIB": "400", "FORKYARD_ENGINE_MAX_SANDBOXES": str(COUNT + 1000)},
        warm_pools="",
    )
    with running_stack(stack) as running:
        yield running


def test_a_launch_of_the_whole_wordmark_runs_and_goes_leaving_nothing(scale_stack: Stack) -> None:
    stack = scale_stack
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    assert pid_max > 2 * COUNT, f"kernel.pid_max is {pid_max}: raise it (sysctl kernel.pid_max=4194304)"
    stack.set_limits(stack.teams[0], requests_per_second=100000, max_sandboxes=COUNT + 1000, max_launch_count=COUNT)
    api = stack.client()
    settle()
    before = census(stack.engine)
    started = time.monotonic()
    launch = api.post(
        "/api/v1/launches",
        json={"template": "base", "size": "tiny", "count": COUNT, "ttl_s": 3600, "memory_group_size": 64, "memory_group_cpu": "group"},
        timeout=300,
    ).json()
    done = wait_for_launch(api, launch["id"], {"ready", "failed"}, timeout_s=3600)
    ran_s = time.monotonic() - started
    assert done["progress"]["running"] == COUNT, done
    members = launch_members(api, launch["id"])
    for member in random.sample(members, 100):
        answer = api.post(f"/api/v1/sandboxes/{member['id']}/exec", json={"cmd": "echo alive"}, timeout=120)
        assert answer.json()["stdout"] == "alive\n", answer.text
    api.delete(f"/api/v1/launches/{launch['id']}")
    wait_for_launch(api, launch["id"], {"stopped"}, timeout_s=3600)
    settle()
    after = census(stack.engine)
    print(f"{COUNT} running in {ran_s:.0f} s")
    # This engine's own counts, exactly: host-wide ones move with whatever else runs on the machine, and the
    # control plane keeps a pool of connections to its engine (the sockets it holds between calls).
    left = {name: counts for name, counts in grown(before, after).items() if name not in (*HOST_WIDE, "engine_sockets")}
    assert not left, left
    assert after["slab_unreclaimable_kib"] <= before["slab_unreclaimable_kib"] * 1.05
