"""A second host: its engine reached over TCP, a snapshot copied to it once, forks placed there.

The second host runs on this machine (its own engine, state and worker), as a
second machine would: the web server and the first host's worker reach its
engine only through its TCP listener and the deployment's token.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.api.test_snapshots import PAGE, WEB, launch_forks, run, take
from tests.support.stack import ExtraHost, Stack

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def second(stack: Stack) -> Iterator[ExtraHost]:
    host = stack.add_host("b")
    stack.wait_for_host(name=host.name)
    yield host
    stack.shell(f"from sandboxes.models import Host; Host.objects.filter(name='{host.name}').update(state='offline')")


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
