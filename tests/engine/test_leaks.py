"""A thousand create/exec/destroy cycles leave the host as they found it."""

from __future__ import annotations

import concurrent.futures
import os

import pytest

from tests.engine.engines import snapshot_host

pytestmark = [pytest.mark.root, pytest.mark.slow]

CYCLES = int(os.environ.get("FORKYARD_LEAK_CYCLES", "1000"))


def test_create_exec_destroy_cycles_leak_nothing(engine_process):
    with engine_process.client() as client:
        client.create(template="base", size="tiny", ttl_s=60)  # warm: first-use allocations are not leaks
        for sandbox in client.list():
            client.destroy(sandbox["id"])
    before = snapshot_host(engine_process)

    def cycles(count: int) -> int:
        done = 0
        with engine_process.client() as client:
            for index in range(count):
                sandbox = client.create(template="base", size="tiny", ttl_s=120)["id"]
                result = client.exec(sandbox, f"echo {index} > /tmp/i && cat /tmp/i")
                assert result.stdout == f"{index}\n".encode()
                client.destroy(sandbox)
                done += 1
        return done

    workers = 4
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        completed = sum(pool.map(cycles, [CYCLES // workers] * workers))
    assert completed == CYCLES // workers * workers

    after = snapshot_host(engine_process)
    leaks = after.leaks_since(before)
    assert leaks == {}, f"after {completed} cycles: {leaks}"
    with engine_process.client() as client:
        info = client.info()
        assert info["sandboxes"] == 0
        assert info["counters"]["create_failed"] == 0
        # Every sandbox's uid range was given back (resting or free, none held).
        assert info["uid_ranges"]["held"] == 0, info["uid_ranges"]
