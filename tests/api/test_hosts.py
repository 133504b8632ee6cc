"""A second host: its engine reached over TCP, a snapshot copied to it once, placement by what each host holds.

The second host runs on this machine (its own engine, state and worker), as a
second machine would: the web server and the first host's worker reach its
engine only through its TCP listener and the deployment's token.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from tests.api.test_snapshots import PAGE, WEB, launch_forks, new_sandbox, run, take
from tests.support.stack import ExtraHost, Stack, launch_members, wait_for_launch

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def second(stack: Stack) -> Iterator[ExtraHost]:
    host = stack.add_host("b")
    stack.wait_for_host(name=host.name)
    yield host
    # Out of service for the rest of the session: drained (one marked offline is online again at its next heartbeat).
    _drain(stack, host.name, "draining")


def _drain(stack: Stack, name: str, state: str) -> None:
    stack.shell(f"from sandboxes.models import Host; Host.objects.filter(name='{name}').update(state='{state}')")


def test_forks_on_a_host_without_the_snapshot_get_it_copied_once(stack: Stack, api, second: ExtraHost) -> None:
    _drain(stack, second.name, "draining")  # the snapshot is taken on the first host
    try:
        source = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600}).json()
    finally:
        _drain(stack, second.name, "online")
    assert source["host"] == stack.host_name
    run(api, source["id"], f"mkdir -p /srv && echo '{PAGE}' > /srv/index.html && echo layer > /only-in-snapshot")
    snapshot = take(api, source["id"], services=[WEB])
    with second.engine.client() as direct:
        assert snapshot["id"] not in {t["name"] for t in direct.call("templates.list")["templates"]}
    _drain(stack, stack.host_name, "draining")  # every fork must go to the second host
    try:
        launch_id, forks = launch_forks(api, snapshot["id"], 6)
    finally:
        _drain(stack, stack.host_name, "online")
    assert {fork["host"] for fork in forks} == {second.name}
    for fork in forks:
        # Through the web server, which reaches the second engine over TCP only.
        result = run(api, fork["id"], "cat /only-in-snapshot; wget -qO- http://127.0.0.1:8080/")
        assert result["stdout"] == f"layer\n{PAGE}\n", result
    with second.engine.client() as direct:
        held = direct.call("templates.get", name=snapshot["id"])
        assert held["layers"] == snapshot_layers(stack, snapshot["id"])
    log = (stack.base_dir / "worker-b.log").read_text()
    assert log.count(f"copied snapshot {snapshot['id']}") == 1, "copied once"
    assert api.delete(f"/api/v1/launches/{launch_id}").status_code == 200
    api.delete(f"/api/v1/sandboxes/{source['id']}")


def snapshot_layers(stack: Stack, snapshot_id: str) -> list[str]:
    assert stack.engine is not None
    with stack.engine.client() as direct:
        layers: list[str] = direct.call("templates.get", name=snapshot_id)["layers"]
    return layers


def _host_counts(stack: Stack) -> dict[str, int]:
    out = stack.shell(
        "import json; from sandboxes.models import Host; print(json.dumps(dict(Host.objects.values_list('name', 'engine_sandboxes'))))"
    )
    counts: dict[str, int] = json.loads(out.strip().splitlines()[-1])
    return counts


def _make_first_host_busier(stack: Stack, api, second: ExtraHost) -> list[str]:
    """Sandboxes on the first host until its heartbeat shows it fuller than the
    second, so that room alone would place the next sandbox on the second."""
    _drain(stack, second.name, "draining")
    try:
        ballast = [new_sandbox(api)["id"] for _ in range(3)]
    finally:
        _drain(stack, second.name, "online")
    deadline = time.monotonic() + 20
    while (counts := _host_counts(stack))[stack.host_name] <= counts[second.name]:
        assert time.monotonic() < deadline, counts
        time.sleep(0.5)
    return ballast


def test_a_template_runs_only_on_the_hosts_that_hold_it(stack: Stack, api, second: ExtraHost) -> None:
    assert stack.engine is not None
    with stack.engine.client() as first_engine:
        first_engine.call("templates.build_base", name="only-first", replace=True)
    deadline = time.monotonic() + 20
    while "only-first" not in stack.shell(
        f"from sandboxes.models import Template; print(list(Template.objects.filter(hosts__name={stack.host_name!r}).values_list('name', flat=True)))"
    ):
        assert time.monotonic() < deadline, "the first host's heartbeat never reported the template"
        time.sleep(0.5)
    ballast = _make_first_host_busier(stack, api, second)
    # The premise: by room alone, a sandbox now goes to the second host.
    roomy = new_sandbox(api)
    assert roomy["host"] == second.name
    placed = [api.post("/api/v1/sandboxes", json={"template": "only-first", "size": "tiny", "ttl_s": 300}) for _ in range(3)]
    assert [response.status_code for response in placed] == [201] * 3, [response.text for response in placed]
    assert {response.json()["host"] for response in placed} == {stack.host_name}
    assert run(api, placed[0].json()["id"], "echo here")["stdout"] == "here\n"
    launch = api.post("/api/v1/launches", json={"template": "only-first", "count": 4, "size": "tiny", "ttl_s": 300}).json()
    members = wait_for_launch(api, launch["id"], {"ready", "failed"})
    assert members["state"] == "ready", members
    assert {member["host"] for member in launch_members(api, launch["id"])} == {stack.host_name}
    api.delete(f"/api/v1/launches/{launch['id']}")
    for sandbox_id in [*ballast, roomy["id"], *(response.json()["id"] for response in placed)]:
        api.delete(f"/api/v1/sandboxes/{sandbox_id}", params={"wait": False})


def test_a_single_fork_goes_to_a_host_holding_its_snapshot(stack: Stack, api, second: ExtraHost) -> None:
    _drain(stack, second.name, "draining")
    try:
        source = new_sandbox(api)
    finally:
        _drain(stack, second.name, "online")
    run(api, source["id"], "echo kept > /kept")
    snapshot = take(api, source["id"])
    ballast = _make_first_host_busier(stack, api, second)
    fork = api.post("/api/v1/sandboxes", json={"snapshot": snapshot["id"], "size": "tiny", "ttl_s": 300})
    assert fork.status_code == 201, fork.text
    # No copy to the roomier second host for one fork: the holder has room.
    assert fork.json()["host"] == stack.host_name
    assert run(api, fork.json()["id"], "cat /kept")["stdout"] == "kept\n"
    with second.engine.client() as direct:
        assert snapshot["id"] not in {t["name"] for t in direct.call("templates.list")["templates"]}
    for sandbox_id in [*ballast, fork.json()["id"], source["id"]]:
        api.delete(f"/api/v1/sandboxes/{sandbox_id}", params={"wait": False})
