"""Network policies through the API: enforced on the sandbox's host, changed while it runs, visible in its metrics.

Traffic goes only to a server in a namespace of the test's own (tests/support/netns.py).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.netns import Server, allow, server
from tests.support.stack import Stack, launch_members, wait_for_launch

__all__ = ["server"]  # a fixture

pytestmark = pytest.mark.root


def _exec(api: httpx.Client, sandbox: str, command: str) -> dict[str, Any]:
    response = api.post(f"/api/v1/sandboxes/{sandbox}/exec", json={"cmd": command, "timeout_s": 30})
    assert response.status_code == 200, response.text
    return dict(response.json())


def _connect(api: httpx.Client, sandbox: str, server: Server, port: int, message: str) -> dict[str, Any]:
    return _exec(api, sandbox, f"echo {message} | nc -w 3 {server.address} {port}")


def test_a_policy_is_enforced_changed_while_running_and_shown_in_metrics(api: httpx.Client, server: Server):
    made = api.post("/api/v1/network-policies", json={"name": f"to-{server.address}", **allow(server, 8080)})
    assert made.status_code == 201, made.text
    policy = made.json()
    created = api.post(
        "/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600, "network_policy": policy["id"]}
    )
    assert created.status_code == 201, created.text
    sandbox = created.json()["id"]
    try:
        assert _connect(api, sandbox, server, 8080, "api")["stdout"] == "pong api\n"
        assert _connect(api, sandbox, server, 8081, "refused")["exit_code"] != 0
        assert server.received(8081) == b""

        metrics = api.get(f"/api/v1/sandboxes/{sandbox}/metrics").json()
        network = metrics["network"]
        assert network["bytes_out"] > 0 and network["bytes_in"] > 0 and network["denied_packets"] > 0
        assert [(item["address"], item["port"]) for item in network["denied"]] == [(server.address, 8081)]

        # A PUT reaches the running sandbox before it answers.
        changed = api.put(f"/api/v1/network-policies/{policy['id']}", json={"name": policy["name"], **allow(server, 8081)})
        assert changed.status_code == 200, changed.text
        assert (changed.json()["applied_to"], changed.json()["apply_failed"]) == (1, [])
        assert _connect(api, sandbox, server, 8081, "now")["stdout"] == "pong now\n"
        assert _connect(api, sandbox, server, 8080, "gone")["exit_code"] != 0
    finally:
        api.delete(f"/api/v1/sandboxes/{sandbox}")


def test_a_wildcard_name_rule_through_the_api(api: httpx.Client, stack: Stack, server: Server):
    assert stack.engine is not None
    Path(stack.engine.config.network_hosts).write_text(f"{server.address} a.apitest.example apitest.example\n")
    made = api.post(
        "/api/v1/network-policies",
        json={"name": f"names-{server.address}", "egress": [{"host": "*.APItest.example", "ports": [8080]}]},
    )
    assert made.status_code == 201, made.text
    assert made.json()["egress"][0]["host"] == "*.apitest.example"
    created = api.post(
        "/api/v1/sandboxes",
        json={"template": "base", "size": "tiny", "ttl_s": 600, "network_policy": made.json()["id"]},
    )
    assert created.status_code == 201, created.text
    sandbox = created.json()["id"]
    try:
        answer = _exec(api, sandbox, "echo named | nc -w 3 a.apitest.example 8080")
        assert answer["stdout"] == "pong named\n", answer
        # The wildcard's own apex is not a subdomain: refused by the resolver.
        assert _exec(api, sandbox, "echo apex | nc -w 3 apitest.example 8080")["exit_code"] != 0
        # And the refused name is in its denied log, by name: no address was ever given out for it.
        metrics = api.get(f"/api/v1/sandboxes/{sandbox}/metrics")
        assert metrics.status_code == 200, metrics.text
        refused = [item for item in metrics.json()["network"]["denied"] if item["protocol"] == "dns"]
        assert [(item["name"], item["address"], item["port"]) for item in refused][:1] == [("apitest.example", None, 53)]
        assert "apitest.example" in refused[0]["rule"]
    finally:
        api.delete(f"/api/v1/sandboxes/{sandbox}")


def _address(api: httpx.Client, sandbox: str) -> str:
    return str(_exec(api, sandbox, "ip -4 -o addr show dev eth0 | awk '{print $4}' | cut -d/ -f1")["stdout"].strip())


def test_a_launch_under_a_same_launch_policy_reaches_itself_and_no_one_else(api: httpx.Client, server: Server):
    made = api.post(
        "/api/v1/network-policies", json={"name": f"env-{server.address}", "same_launch": True, **allow(server, 8080)}
    )
    assert made.status_code == 201 and made.json()["same_launch"] is True, made.text
    policy = made.json()["id"]
    created = api.post(
        "/api/v1/launches",
        json={"template": "base", "size": "tiny", "count": 2, "ttl_s": 600, "network_policy": policy},
    )
    assert created.status_code == 201, created.text
    launch = wait_for_launch(api, created.json()["id"], {"ready", "failed"})
    assert launch["state"] == "ready", launch
    first, second = (member["id"] for member in launch_members(api, launch["id"]))
    outsider = api.post(
        "/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600, "network_policy": policy}
    ).json()["id"]
    try:
        target = _address(api, second)
        # The listener's stdin stays open (a sleep): at EOF on stdin busybox nc may close the connection
        # before it has read what the peer sent.
        _exec(api, second, "setsid sh -c 'sleep 60 | nc -l -p 9000 > /tmp/got 2>&1' < /dev/null > /dev/null 2>&1 &")
        assert _exec(api, outsider, f"echo intruder | nc -w 3 {target} 9000")["exit_code"] != 0
        assert _exec(api, first, f"echo member | nc -w 3 {target} 9000")["exit_code"] == 0
        got = _exec(api, second, "for i in $(seq 100); do [ -s /tmp/got ] && break; sleep 0.05; done; cat /tmp/got")
        assert got["stdout"] == "member\n"
    finally:
        api.delete(f"/api/v1/launches/{launch['id']}")
        api.delete(f"/api/v1/sandboxes/{outsider}")


def test_without_a_policy_metrics_show_no_network(api: httpx.Client, running: str):
    assert api.get(f"/api/v1/sandboxes/{running}/metrics").json()["network"] is None


@pytest.mark.parametrize(
    ("rule", "field"),
    [
        ({"cidr": "2001:db8::/32", "ports": [443]}, "egress.0.cidr"),  # a sandbox has IPv4 only
        ({"cidr": "not-a-network"}, "egress.0.cidr"),
        ({"cidr": "169.254.169.254/32", "ports": [80]}, "egress.0.cidr"),  # cloud metadata: never, even named
        ({"host": "*.*.example.org"}, "egress.0.host"),
        ({"host": "pypi.org", "cidr": "10.0.0.0/8"}, "egress.0"),
    ],
    ids=["ipv6", "not-a-network", "metadata", "double-wildcard", "both"],
)
def test_a_rule_that_would_do_nothing_is_refused_naming_its_field(api: httpx.Client, rule: dict, field: str) -> None:
    answer = api.post("/api/v1/network-policies", json={"name": f"bad-{uuid.uuid4().hex[:6]}", "egress": [rule]})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["field"] == field
