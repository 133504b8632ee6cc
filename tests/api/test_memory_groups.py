"""A launch whose sandboxes share memory cgroups (``memory_group_size``): the opt-in for launches of thousands.

Through the API: the members land in groups of that size on their host, each
group's memory cgroup limited to its members' sum (read from the kernel), each
member still running commands; the teardown takes the groups with it.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from sandboxes.engine.cgroups import CgroupsV1, detect
from tests.engine.engines import wait_for
from tests.support.stack import launch_members, wait_for_launch

pytestmark = pytest.mark.root
MIB = 1024 * 1024


def groups_on_the_engine(stack: Any) -> dict[str, list[str]]:
    """The engine's sandboxes by memory group (the stack's one host)."""
    with stack.engine.client() as engine:
        records = engine.list()
    found: dict[str, list[str]] = {}
    for record in records:
        group = record.get("memory_group")
        if group:
            found.setdefault(group, []).append(record["key"])
    return found


def group_limit(stack: Any, group: str) -> int:
    cgroups = detect(stack.engine.config)
    name = "memory.limit_in_bytes" if isinstance(cgroups, CgroupsV1) else "memory.max"
    return int((cgroups.group_directory(f"mg-{group}") / name).read_text())


def test_a_launch_in_memory_groups_runs_and_goes(stack: Any, api: httpx.Client) -> None:
    made = api.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": 8, "memory_group_size": 4})
    assert made.status_code == 201, made.text
    launch = made.json()
    assert launch["memory_group_size"] == 4
    wait_for_launch(api, launch["id"], {"ready"})
    members = {member["id"] for member in launch_members(api, launch["id"])}
    groups = groups_on_the_engine(stack)
    ours = {group: set(keys) & members for group, keys in groups.items() if set(keys) & members}
    assert sorted(len(keys) for keys in ours.values()) == [4, 4], ours
    for group in ours:
        assert group_limit(stack, group) == 4 * 128 * MIB
    for member in members:
        assert api.post(f"/api/v1/sandboxes/{member}/exec", json={"cmd": "echo grouped"}).json()["stdout"] == "grouped\n"
    assert api.get(f"/api/v1/sandboxes/{next(iter(members))}/metrics").status_code == 200
    api.delete(f"/api/v1/launches/{launch['id']}")
    wait_for_launch(api, launch["id"], {"stopped"})
    cgroups = detect(stack.engine.config)
    wait_for(lambda: not any(cgroups.group_directory(f"mg-{group}").exists() for group in ours), "the groups to go")


def cpu_quota(directory: Any, v1: bool) -> int:
    """The CPU quota the kernel holds for a cgroup, in microseconds a 100 ms period; -1 for none."""
    if v1:
        return int((directory / "cpu.cfs_quota_us").read_text())
    quota = (directory / "cpu.max").read_text().split()[0]
    return -1 if quota == "max" else int(quota)


def test_a_launch_may_put_its_groups_cpu_quota_on_the_group(stack: Any, api: httpx.Client) -> None:
    made = api.post(
        "/api/v1/launches",
        json={"template": "base", "size": "tiny", "count": 4, "memory_group_size": 2, "memory_group_cpu": "group"},
    )
    assert made.status_code == 201, made.text
    launch = made.json()
    assert launch["memory_group_cpu"] == "group"
    wait_for_launch(api, launch["id"], {"ready"})
    members = {member["id"] for member in launch_members(api, launch["id"])}
    ours = {group: set(keys) & members for group, keys in groups_on_the_engine(stack).items() if set(keys) & members}
    cgroups = detect(stack.engine.config)
    v1 = isinstance(cgroups, CgroupsV1)
    with stack.engine.client() as engine:
        engine_ids = {record["key"]: record["id"] for record in engine.list()}
    for group, keys in ours.items():
        group_name = f"mg-{group}"
        first = f"{group_name}/fy-{engine_ids[next(iter(keys))]}"
        member = cgroups.directory("cpu", first) if v1 else cgroups.directories(first)[0]
        assert cpu_quota(member.parent, v1) == 2 * 100_000, "the group's quota: its two members' cores"
        assert cpu_quota(member, v1) == -1, "a member has no quota of its own"
    for member_id in members:
        assert api.post(f"/api/v1/sandboxes/{member_id}/exec", json={"cmd": "echo shared"}).json()["stdout"] == "shared\n"
    api.delete(f"/api/v1/launches/{launch['id']}")
    wait_for_launch(api, launch["id"], {"stopped"})


def test_a_bad_group_cpu_is_refused(api: httpx.Client) -> None:
    for body in ({"memory_group_size": 4, "memory_group_cpu": "both"}, {"memory_group_cpu": "group"}):
        answer = api.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": 2, **body})
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_request", answer.text
        assert "memory_group_cpu" in answer.text, answer.text


def test_a_bad_group_size_is_refused(api: httpx.Client) -> None:
    for size in (0, 5000, True):
        answer = api.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": 2, "memory_group_size": size})
        assert answer.status_code == 400 and answer.json()["error"]["field"] == "memory_group_size", answer.text
