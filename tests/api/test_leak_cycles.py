"""Create/exec/destroy cycles through the engine leave the host as they found it (PRODUCT.md, "Goals").

The same loop and census as ``bench/leak_bench.py`` (which runs the full
10,000 cycles; the figures are in docs/benchmarks.md), kept short here:
``FORKYARD_LEAK_CYCLES`` cycles, 300 by default, over 4 clients at once, after
a warm-up. Back at baseline exactly: the engine's sandboxes, the processes in
its cgroups and their namespaces, processes running as a sandbox uid anywhere
on the host, the user and network namespaces the host refers to, zombies,
mounts, cgroups, control sockets, the engine's file descriptors and threads,
the state directory's files and bytes, the firewall ruleset; and the kernel's
unreclaimable slab no more than a few percent above its start, once settled.

It drives the engine directly (the ``engine_process`` fixture), not the API:
it lives here only because tests/engine belongs to the engine's own work
(tests/engine/test_leaks.py runs a plainer loop of its own).
"""

from __future__ import annotations

import os

import pytest

from bench import leak_bench

pytestmark = [pytest.mark.root, pytest.mark.slow]

CYCLES = int(os.environ.get("FORKYARD_LEAK_CYCLES", "300"))
SLAB_TOLERANCE_PCT = 5.0


def test_create_exec_destroy_cycles_leave_the_host_at_its_baseline(engine_process):
    result = leak_bench.measure(engine_process, CYCLES, clients=4, warmup=40)
    before, after = result["before"], result["after"]
    assert result["loop"]["cycles"] == CYCLES and result["create_failed"] == 0
    assert result["grown"] == {}, f"after {CYCLES} cycles: {result['grown']}"
    assert (after["live_sandboxes"], after["sandbox_processes"]) == (before["live_sandboxes"], before["sandbox_processes"])
    # Processes of sandbox uids outside any engine's cgroup cannot all be told apart from another
    # engine's on this host (an idle file writer of the API tests' engine ending meanwhile): a leak of
    # ours shows as more of them, never fewer.
    assert after["sandbox_uid_processes"] <= before["sandbox_uid_processes"], (before, after)
    # Every cycle's sandbox is remembered as a tombstone (kept a day, by design), nothing else.
    assert result["tombstones_added"] == CYCLES
    # A leak grows it; the machine's other work may shrink it (a test session beside this one freeing its
    # sandboxes), which says nothing of ours.
    assert result["slab_change_pct"] <= SLAB_TOLERANCE_PCT, (
        f"unreclaimable slab {before['slab_unreclaimable_kib']} -> {after['slab_unreclaimable_kib']} KiB "
        f"({result['slab_change_pct']:+} %; other engines' processes before/after: {result['foreign_processes']}; "
        f"settling: {result['settle']})"
    )
