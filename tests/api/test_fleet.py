"""Three engines as three hosts, through the real API: a launch spreads over them, its teardown reaches every
one, admission counts what the hosts can hold (422 with what fits, 503 with Retry-After), and a host whose
engine is killed mid-launch has its share placed on the others.

One kernel serves all three (their total is this machine's): each engine has its own state directory,
cgroup parent, network pool and table, socket and TCP listener, and each host its own workers on its own
queues (``host.<name>`` and its interactive lane), as separate machines would.  Each engine may hold 60
sandboxes (``FORKYARD_ENGINE_MAX_SANDBOXES``), so the fleet holds 180; launches come in chunks of 10.
The in-process tests of the same logic, every race included, are tests/django/test_fleet.py.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.stack import Stack, launch_members, running_stack, wait_for_launch

pytestmark = [pytest.mark.root, pytest.mark.slow]
PER_HOST = 60
TINY = {"template": "base", "size": "tiny", "ttl_s": 600}


@pytest.fixture(scope="module")
def fleet(work_dir: Path) -> Iterator[Stack]:
    fleet = Stack(
        work_dir / "fleet",
        hosts=3,
        warm_pools="",  # pooled sandboxes would count in each host's room
        engine_env={"FORKYARD_ENGINE_MAX_SANDBOXES": str(PER_HOST)},
        env={"FORKYARD_LAUNCH_CHUNK": "10"},
    )
    with running_stack(fleet):
        yield fleet


@pytest.fixture
def client(fleet: Stack) -> Iterator[httpx.Client]:
    with fleet.client() as api:
        yield api


def _hosts(fleet: Stack) -> dict[str, dict[str, Any]]:
    """Every host's row as the control plane has it."""
    out = fleet.shell(
        "import json; from sandboxes.models import Host; print(json.dumps({h.name: {'state': h.state, "
        "'engine_sandboxes': h.engine_sandboxes, 'kernel_max_sandboxes': h.kernel_max_sandboxes} for h in Host.objects.all()}))"
    )
    hosts: dict[str, dict[str, Any]] = json.loads(out.strip().splitlines()[-1])
    return hosts


def _until(fleet: Stack, done: Any, what: str, timeout_s: float = 60) -> dict[str, dict[str, Any]]:
    """The hosts' rows once ``done(rows)`` holds (a guard against a hang, naming what did not happen)."""
    deadline = time.monotonic() + timeout_s
    while True:
        hosts = _hosts(fleet)
        if done(hosts):
            return hosts
        assert time.monotonic() < deadline, f"{what}: {hosts}"
        time.sleep(0.5)


def _emptied(fleet: Stack) -> None:
    """Until every host's engine has reported holding nothing (the last test's teardown reached them)."""
    names = set(fleet.engines())
    _until(fleet, lambda hosts: all(hosts[name]["engine_sandboxes"] == 0 for name in names), "the hosts are not empty")


def _teardown(client: httpx.Client, launch_id: str) -> None:
    assert client.delete(f"/api/v1/launches/{launch_id}").status_code == 200
    wait_for_launch(client, launch_id, {"stopped"})


def test_a_launch_spreads_over_the_hosts_and_its_teardown_reaches_every_one(fleet: Stack, client: httpx.Client) -> None:
    names = sorted(fleet.engines())
    _emptied(fleet)
    created = client.post("/api/v1/launches", json={**TINY, "count": 90})
    assert created.status_code == 201, created.text
    launch = wait_for_launch(client, created.json()["id"], {"ready", "failed"})
    assert launch["state"] == "ready" and launch["progress"]["running"] == 90
    placed = Counter(member["host"] for member in launch_members(client, launch["id"]))
    # Equal room on each: the chunks of 10 go round, 30 each.
    assert placed == {name: 30 for name in names}
    shares = client.get(f"/api/v1/launches/{launch['id']}/hosts").json()["hosts"]
    assert [(share["host"], share["running"]) for share in shares] == [(name, 30) for name in names]
    assert fleet.held_by_engines(launch["id"]) == {name: 30 for name in names}, "each engine holds what its row says"
    _teardown(client, launch["id"])
    assert fleet.held_by_engines(launch["id"]) == {name: 0 for name in names}, "the teardown reached every host"
    shares = client.get(f"/api/v1/launches/{launch['id']}/hosts").json()["hosts"]
    assert [(share["host"], share["running"], share["ended"]) for share in shares] == [(name, 0, 30) for name in names]


def test_admission_knows_what_the_hosts_can_hold(fleet: Stack, client: httpx.Client) -> None:
    _emptied(fleet)
    hosts = _hosts(fleet)
    assert all(hosts[name]["kernel_max_sandboxes"] == PER_HOST for name in fleet.engines()), "preflight: 60 fit each"
    too_many = client.post("/api/v1/launches", json={**TINY, "count": 3 * PER_HOST + 1})
    assert too_many.status_code == 422, too_many.text
    error = too_many.json()["error"]
    assert (error["code"], error["field"]) == ("beyond_capacity", "count")
    assert error["details"] == {"fits": 3 * PER_HOST, "count": 3 * PER_HOST + 1, "hosts": 3}
    # Memory: 16 GiB limits over the default overcommit of 8 are 2 GiB each (and 600 KiB of the kernel's).
    with fleet.engine.client() as direct:  # type: ignore[union-attr]
        memory_mib = direct.info()["memory_mib"]
    heavy = (memory_mib - 1024) * 1024 // (600 + 16384 * 1024 // 8)
    large = client.post("/api/v1/launches", json={**TINY, "size": None, "cpu": 1, "memory_mib": 16384, "count": 3 * heavy + 1})
    assert large.status_code == 422, large.text
    assert large.json()["error"]["details"]["fits"] == 3 * heavy
    # Room now: 150 running, so 30 more fit now, 180 on an empty fleet.
    first = client.post("/api/v1/launches", json={**TINY, "count": 150}).json()
    assert wait_for_launch(client, first["id"], {"ready", "failed"})["progress"]["running"] == 150
    _until(fleet, lambda hosts: sum(host["engine_sandboxes"] for host in hosts.values()) == 150, "150 reported")
    busy = client.post("/api/v1/launches", json={**TINY, "count": 31})
    assert busy.status_code == 503, busy.text
    assert busy.headers["Retry-After"] == "10"
    assert busy.json()["error"]["code"] == "no_capacity"
    assert busy.json()["error"]["details"] == {"fits": 180, "fits_now": 30, "count": 31, "hosts": 3}
    single = client.post("/api/v1/sandboxes", json=TINY)
    assert single.status_code == 201, "one still fits"
    client.delete(f"/api/v1/sandboxes/{single.json()['id']}")
    _teardown(client, first["id"])


def test_a_host_whose_engine_is_killed_mid_launch_has_its_share_placed_on_the_others(fleet: Stack, client: httpx.Client) -> None:
    lost = fleet.extra_hosts[-1]
    others = sorted(set(fleet.engines()) - {lost.name})
    _emptied(fleet)
    # Killed as the launch starts: its agent has not missed a heartbeat yet, so its share is placed on it.
    lost.engine.kill()
    created = client.post("/api/v1/launches", json={**TINY, "count": 90})
    assert created.status_code == 201, created.text
    launch_id = created.json()["id"]
    deadline = time.monotonic() + 30
    while len(members := launch_members(client, launch_id)) < 90:
        assert time.monotonic() < deadline, "the dispatch did not make every member"
        time.sleep(0.2)
    assert Counter(member["host"] for member in members)[lost.name] == 30, "its share went to the killed host"
    try:
        # Its heartbeat stops; the fleet's watch marks it offline and places its share on the others.
        launch = wait_for_launch(client, launch_id, {"ready", "failed"}, timeout_s=120)
        assert launch["state"] == "ready" and launch["progress"]["running"] == 90, launch
        placed = Counter(member["host"] for member in launch_members(client, launch_id))
        assert set(placed) == set(others) and sum(placed.values()) == 90
        assert _hosts(fleet)[lost.name]["state"] == "offline"
        shares = client.get(f"/api/v1/launches/{launch_id}/hosts").json()["hosts"]
        assert lost.name not in {share["host"] for share in shares}
        for member in launch_members(client, launch_id)[:5]:
            result = client.post(f"/api/v1/sandboxes/{member['id']}/exec", json={"cmd": "echo here"})
            assert result.json()["stdout"] == "here\n"
    finally:
        lost.engine.start()
    # Back: online again, and its engine holds nothing of a launch that went elsewhere.
    _until(fleet, lambda hosts: hosts[lost.name]["state"] == "online", "the host did not come back")
    assert fleet.held_by_engines(launch_id)[lost.name] == 0
    _teardown(client, launch_id)
    assert fleet.held_by_engines(launch_id) == {name: 0 for name in fleet.engines()}
