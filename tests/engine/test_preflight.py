"""Host preflight on the real kernel: the engine reports the host's limits as /proc has them, raises a short
one, and names the one the kernel will not raise.  The computation itself is tested on a fake tree
(tests/engine/unit/test_preflight.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sandboxes.engine import preflight
from sandboxes.engine.cgroups import favor_moves_plan
from sandboxes.engine.client import EngineClient
from sandboxes.engine.config import EngineConfig
from tests.engine.networks import net_engine
from tests.support.engine import EngineProcess

pytestmark = pytest.mark.root
__all__ = ["net_engine"]  # a fixture
PROC_SYS = Path("/proc/sys")


def _value(name: str) -> int:
    return int((PROC_SYS / name.replace(".", "/")).read_text().split()[0])


def _limits(info: dict) -> dict[str, dict]:
    return {limit["name"]: limit for limit in info["preflight"]["limits"]}


def test_the_engine_reports_the_hosts_limits_as_the_kernel_has_them(engine: EngineClient) -> None:
    info = engine.info()
    found = _limits(info)
    for name in (
        "kernel.pid_max",
        "kernel.threads-max",
        "user.max_net_namespaces",
        "fs.file-max",
        "fs.inotify.max_user_instances",
    ):
        assert found[name]["value"] == _value(name), name
    assert found["memory cgroup ids"]["value"] == preflight.MEMORY_CGROUP_IDS
    assert found["memory cgroup ids"]["in_use"] > 0  # /proc/cgroups counts this engine's own parent at least
    # Its start raised what its max_sandboxes needs and root may raise: nothing of those is short now.
    for name in ("kernel.pid_max", "kernel.threads-max", "fs.file-max", "user.max_net_namespaces"):
        assert found[name]["status"] == "ok", found[name]
        assert found[name]["value"] >= found[name]["need"]
    # Per user, and each sandbox is a user of its own: nothing to raise for 40,000 of them.
    assert found["fs.inotify.max_user_instances"]["per_user"] and found["fs.inotify.max_user_instances"]["need"] == 1
    assert info["preflight"]["fits"] <= info["max_sandboxes"]
    assert info["sandbox_overhead_kib"]["default_kib"] == 600 and info["sandbox_overhead_kib"]["kib"] >= 600
    # Its start made moves into cgroups cheap (cgroups.favor_moves), and the kernel has the option now.
    assert info["cgroup_moves"] in ("set", "already"), info["cgroup_moves"]
    assert favor_moves_plan(Path("/proc/self/mountinfo").read_text()) == "already"


def test_a_short_limit_is_raised_in_proc_and_one_the_kernel_refuses_is_reported_never_lowered() -> None:
    # fs.nr_open, a ceiling for any process's descriptors: raised by 64 for the test, and put back.
    nr_open = PROC_SYS / "fs/nr_open"
    original = int(nr_open.read_text())
    wanted = (original + 64 - preflight.ENGINE_FILES) // 2  # the need: the engine's own, and two a sandbox
    only = tuple(limit for limit in preflight.LIMITS if limit.name == "fs.nr_open")
    config = EngineConfig(max_sandboxes=wanted)
    try:
        report = preflight.raise_short(preflight.check(config, limits=only), config, limits=only)
        finding = report.findings[0]
        assert (finding.status, finding.before, finding.value) == ("raised", original, original + 64)
        assert int(nr_open.read_text()) == original + 64
    finally:
        if int(nr_open.read_text()) == original + 64:
            nr_open.write_text(str(original))  # the test's own change, undone
    # pid_max past the kernel's ceiling (4,194,304 on 64-bit): the kernel refuses the write, and it is said so.
    pid_max = next(limit for limit in preflight.LIMITS if limit.name == "kernel.pid_max")
    unbounded = (dataclasses.replace(pid_max, maximum=preflight.SYSCTL_MAX, suggested=0),)
    before = _value("kernel.pid_max")
    config = EngineConfig(max_sandboxes=3_000_000)
    report = preflight.raise_short(preflight.check(config, limits=unbounded), config, limits=unbounded)
    finding = report.findings[0]
    assert finding.status == "short" and "could not write it (Invalid argument)" in finding.how, finding
    assert _value("kernel.pid_max") == before
    # Memory cgroup ids are not a setting: 65,535, dying cgroups included, whatever is needed.
    ids = tuple(limit for limit in preflight.LIMITS if limit.name == "memory cgroup ids")
    config = EngineConfig(max_sandboxes=70_000)
    finding = preflight.raise_short(preflight.check(config, limits=ids), config, limits=ids).findings[0]
    assert finding.status == "short" and finding.fits <= preflight.MEMORY_CGROUP_IDS
    assert "65,535 memory cgroup ids, dying cgroups included" in finding.how


def test_the_network_limits_are_raised_once_a_sandbox_has_a_network(net_engine: EngineProcess) -> None:
    with net_engine.client() as client:
        assert not client.info()["preflight"]["networks"]
        sandbox = client.create(template="base", size="tiny", network={"egress": []})["id"]
        try:
            info = client.info()
            assert info["preflight"]["networks"]
            found = _limits(info)
            for level in ("gc_thresh1", "gc_thresh2", "gc_thresh3"):
                name = f"net.ipv4.neigh.default.{level}"
                assert found[name]["status"] == "ok", found[name]
                assert _value(name) >= found[name]["need"]
        finally:
            client.destroy(sandbox)
