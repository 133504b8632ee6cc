"""Network policies, enforced on the host: a veth, a /31 of the engine's pool, nftables rules.

Traffic goes only to servers in a network namespace this test makes itself,
at 198.18.x.2 (MEASURED.md's network rule), after checking that the host
routes that address through the test's own veth.  The engine's pool is a /24
of 198.19.0.0/16 of its own, and its nftables table a name of its own, so
that engines of other tests are untouched.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from sandboxes.engine import errors, faults
from tests.engine.networks import NAMES, connect, host_devices, name_servers, net_engine, table_objects
from tests.support.engine import EngineProcess
from tests.support.netns import Server, allow, ip, server

__all__ = ["net_engine", "server", "NAMES"]  # fixtures, and names the tests use

pytestmark = pytest.mark.root


def test_without_a_policy_a_sandbox_has_loopback_only(net_engine: EngineProcess, server: Server):
    with net_engine.client() as client:
        sandbox = client.create(template="base", size="tiny")["id"]
        links = [line.split(b":")[0].strip() for line in client.exec(sandbox, "cat /proc/net/dev").stdout.splitlines()[2:]]
        assert links == [b"lo"]
        assert client.get(sandbox)["network"] is None
        code, _ = connect(client, sandbox, server.address, 8080)
        assert code != 0
        assert server.received(8080) == b""
        assert host_devices(net_engine) == []
        client.destroy(sandbox)


def test_an_allowed_port_connects_and_a_denied_one_gets_no_byte_through(net_engine: EngineProcess, server: Server):
    with net_engine.client() as client:
        sandbox = client.create(template="base", size="tiny", network=allow(server, 8080))["id"]
        assert client.get(sandbox)["network"]["egress"][0]["ports"] == [8080]
        code, stdout = connect(client, sandbox, server.address, 8080, "through")
        assert (code, stdout) == (0, b"pong through\n")
        assert server.received(8080) == b"connection\nthrough\n"

        code, _ = connect(client, sandbox, server.address, 8081, "blocked")
        assert code != 0
        assert server.received(8081) == b""
        # The metadata address: never, and refused on the host before it goes anywhere.
        assert connect(client, sandbox, "169.254.169.254", 80)[0] != 0

        network = client.call("stats", id=sandbox)["network"]
        assert network["bytes_out"] > 0 and network["bytes_in"] > 0
        assert network["denied_packets"] >= 2
        denied = {(item["address"], item["port"]): item for item in network["denied"]}
        assert denied[(server.address, 8081)]["protocol"] == "tcp"
        assert "metadata" in denied[("169.254.169.254", 80)]["rule"]
        client.destroy(sandbox)


def test_a_wide_rule_reaches_no_private_address_nor_the_host(net_engine: EngineProcess, server: Server):
    with net_engine.client() as client:
        sandbox = client.create(template="base", size="tiny", network={"egress": [{"cidr": "0.0.0.0/0", "protocol": "any"}]})[
            "id"
        ]
        host_side = client.exec(sandbox, "ip route | awk '/default/ {print $3}'").stdout.strip().decode()
        assert ipaddress.ip_address(host_side) in ipaddress.ip_network(net_engine.config.network_pool)
        for address in (server.address, host_side, "127.0.0.1"):
            assert connect(client, sandbox, address, 8080)[0] != 0
        assert server.received(8080) == b""
        denied = {item["address"] for item in client.call("stats", id=sandbox)["network"]["denied"]}
        assert {server.address, host_side} <= denied
        client.destroy(sandbox)


def test_the_host_and_other_sandboxes_need_a_rule_naming_them_exactly(net_engine: EngineProcess, server: Server):
    """A rule over a private range reaches that range, but not the host's own address in it, nor another
    sandbox when the range holds the engine's pool: those take a rule naming the one address (a /32)."""
    host_address = str(ipaddress.ip_address(server.address) - 1)  # the host's end of the test's veth
    subnet = str(ipaddress.ip_network(f"{server.address}/24", strict=False))
    got: list[bytes] = []
    listener = socket.create_server((host_address, 8085))
    listener.settimeout(0.2)

    def accept() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed: the test is over
            with connection:
                connection.settimeout(5)
                with contextlib.suppress(OSError):
                    got.append(connection.recv(100))

    threading.Thread(target=accept, daemon=True).start()
    try:
        with net_engine.client() as client:
            wide = {
                "egress": [{"cidr": subnet, "ports": [8080, 8085]}, {"cidr": net_engine.config.network_pool, "ports": [9000]}]
            }
            ranged = client.create(template="base", size="tiny", network=wide)["id"]
            target = client.create(template="base", size="tiny", network=allow(server, 8080))["id"]
            target_address = client.get(target)["network"]["address"]
            client.exec(target, "setsid nc -l -p 9000 > /tmp/got < /dev/null 2>&1 &")
            # The range itself: reached.
            assert connect(client, ranged, server.address, 8080, "range")[1] == b"pong range\n"
            # The host's own address in it, and a sandbox in the pool: refused, nothing arrives.
            assert connect(client, ranged, host_address, 8085, "host")[0] != 0
            assert connect(client, ranged, target_address, 9000, "sibling")[0] != 0
            assert got == [] and client.exec(target, "cat /tmp/got").stdout == b""
            denied = {item["address"] for item in client.call("stats", id=ranged)["network"]["denied"]}
            assert {host_address, target_address} <= denied
            # Named exactly: reached.
            exact = {
                "egress": [{"cidr": f"{host_address}/32", "ports": [8085]}, {"cidr": f"{target_address}/32", "ports": [9000]}]
            }
            named = client.create(template="base", size="tiny", network=exact)["id"]
            assert connect(client, named, host_address, 8085, "host")[0] == 0
            assert connect(client, named, target_address, 9000, "sibling")[0] == 0
            for _ in range(100):
                if got and client.exec(target, "cat /tmp/got").stdout:
                    break
                time.sleep(0.05)
            assert got == [b"host\n"]
            assert client.exec(target, "cat /tmp/got").stdout == b"sibling\n"
            for sandbox in (ranged, target, named):
                client.destroy(sandbox)
    finally:
        listener.close()


def test_a_sandbox_cannot_change_its_address_or_route(net_engine: EngineProcess, server: Server):
    """Root inside has no CAP_NET_ADMIN; were it to send from another address (another sandbox's), the
    host drops that too (its chains accept only its own source address)."""
    with net_engine.client() as client:
        sandbox = client.create(template="base", size="tiny", network=allow(server, 8080))["id"]
        own = client.get(sandbox)["network"]["address"]
        spoofed = str(ipaddress.ip_address(own) + 2)
        for command in (f"ip addr add {spoofed}/32 dev eth0", "ip route del default", "ip link set eth0 down"):
            changed = client.exec(sandbox, command)
            assert changed.exit_code != 0 and b"not permitted" in changed.stderr, (command, changed)
        assert connect(client, sandbox, server.address, 8080, "still")[1] == b"pong still\n"
        client.destroy(sandbox)


def test_a_forged_hosts_file_does_not_widen_access(net_engine: EngineProcess, server: Server):
    with net_engine.client() as client:
        sandbox = client.create(template="base", size="tiny", network=allow(server, 8080))["id"]
        # Inside, the sandbox may name any address as anything: the host's rules count addresses.
        client.exec(sandbox, f"echo '{server.address} allowed.example' >> /etc/hosts")
        assert connect(client, sandbox, "allowed.example", 8080)[0] == 0
        assert connect(client, sandbox, "allowed.example", 8081)[0] != 0
        assert server.received(8081) == b""
        client.destroy(sandbox)


def test_a_changed_policy_applies_to_a_running_sandbox(net_engine: EngineProcess, server: Server):
    with net_engine.client() as client:
        sandbox = client.create(template="base", size="tiny", network=allow(server, 8080))["id"]
        assert connect(client, sandbox, server.address, 8081)[0] != 0
        client.call("network.set", id=sandbox, network=allow(server, 8081))
        assert connect(client, sandbox, server.address, 8081, "now")[1] == b"pong now\n"
        assert connect(client, sandbox, server.address, 8080)[0] != 0
        assert client.get(sandbox)["network"]["egress"][0]["ports"] == [8081]
        client.destroy(sandbox)
        with pytest.raises(errors.SandboxNotRunning):
            client.call("network.set", id=sandbox, network=allow(server, 8080))


def test_sandboxes_under_the_same_rules_share_their_chains_and_a_change_moves_them_all(net_engine: EngineProcess, server: Server):
    """A policy change at scale writes the new rules once, not once a sandbox: their chains are shared,
    and each sandbox's policy map elements move to the new ones; the old ones go with their last user."""
    with net_engine.client() as client:
        made = [client.create(template="base", size="tiny", network=allow(server, 8080))["id"] for _ in range(3)]
        assert len(_policy_chains(net_engine)) == 3  # pe-, ph-, pr- of the one set of rules
        first = _policy_chains(net_engine)
        answers = client.call("network.set_many", items=[{"id": sandbox, "network": allow(server, 8081)} for sandbox in made])
        assert [answer.get("error") for answer in answers["sandboxes"]] == [None] * 3
        moved = _policy_chains(net_engine)
        assert len(moved) == 3 and not moved & first  # the new rules' chains; the old ones gone
        for sandbox in made:
            assert connect(client, sandbox, server.address, 8081, "moved")[1] == b"pong moved\n"
            assert connect(client, sandbox, server.address, 8080)[0] != 0
        client.call("network.set", id=made[0], network=allow(server, 8080))
        assert len(_policy_chains(net_engine)) == 6  # two sets of rules in use
        for sandbox in made:
            client.destroy(sandbox)
        assert table_objects(net_engine) == []


def _policy_chains(engine: EngineProcess) -> set[str]:
    listing = subprocess.run(["nft", "-j", "list", "chains", "inet"], capture_output=True, text=True, check=True)
    return {
        item["chain"]["name"]
        for item in json.loads(listing.stdout)["nftables"]
        if "chain" in item
        and item["chain"]["table"] == engine.config.network_table
        and item["chain"]["name"][:3] in ("pe-", "ph-", "pr-")
    }


def test_names_are_resolved_only_when_a_rule_allows_them(net_engine: EngineProcess, server: Server):
    name_servers(net_engine, server.address)
    policy = {
        "egress": [
            {"host": "svc.fytest.example", "ports": [8080]},
            {"host": "*.wild.fytest.example", "ports": [8080]},
        ]
    }
    with net_engine.client() as client:
        sandbox = client.create(template="base", size="tiny", network=policy)["id"]
        host_side = str(ipaddress.ip_address(client.get(sandbox)["network"]["address"]) - 1)
        assert client.exec(sandbox, "cat /etc/resolv.conf").stdout == f"nameserver {host_side}\n".encode()
        # Nothing is admitted before its resolver answered for a name.
        assert connect(client, sandbox, server.address, 8080)[0] != 0
        for name in ("svc", "a.wild", "b.c.wild"):
            assert connect(client, sandbox, f"{name}.fytest.example", 8080, "named") == (0, b"pong named\n"), name
        # Only on the rule's ports.
        assert connect(client, sandbox, "svc.fytest.example", 8081)[0] != 0
        assert server.received(8081) == b""
        # The wildcard's apex, a look-alike, a name no rule has: refused by the resolver.
        for name in ("wild", "evil-wild", "other"):
            looked_up = client.exec(sandbox, f"nslookup {name}.fytest.example")
            assert server.address.encode() not in looked_up.stdout, (name, looked_up)
        client.destroy(sandbox)


def test_a_policed_sandboxs_resolv_conf_is_its_own_and_no_snapshot_carries_it(net_engine: EngineProcess, server: Server):
    """Written at the spawn beside its /etc/hosts, in the layer above the template's: a regular file naming its
    resolver whatever the template has there; root inside may change it; a snapshot holds it only if it was
    changed, so a fork without a policy names no resolver that is not its own."""
    policy = {"egress": [{"cidr": f"{server.address}/32", "ports": [8080]}]}
    name = f"resolv-{os.urandom(3).hex()}"
    with net_engine.client() as client:
        plain = client.create(template="base", size="tiny")["id"]
        sandbox = client.create(template="base", size="tiny", network=policy)["id"]
        try:
            templates_own = client.exec(plain, "cat /etc/resolv.conf 2>&1; true").stdout
            host_side = str(ipaddress.ip_address(client.get(sandbox)["network"]["address"]) - 1)
            shown = client.exec(sandbox, "test -L /etc/resolv.conf || echo regular; cat /etc/resolv.conf").stdout
            assert shown == f"regular\nnameserver {host_side}\n".encode()
            client.call("snapshots.create", sandbox=sandbox, name=name)
            fork = client.create(template=name, size="tiny")["id"]
            assert client.exec(fork, "cat /etc/resolv.conf 2>&1; true").stdout == templates_own
            client.destroy(fork)
            assert client.exec(sandbox, "echo 'nameserver 192.0.2.1' > /etc/resolv.conf").exit_code == 0
            assert client.exec(sandbox, "cat /etc/resolv.conf").stdout == b"nameserver 192.0.2.1\n", "its own to change"
        finally:
            client.destroy(plain)
            client.destroy(sandbox)
            client.call("templates.delete", name=name)


def test_a_change_of_rules_forgets_what_the_old_name_rule_admitted(net_engine: EngineProcess, server: Server):
    """The addresses a name rule's answers admitted go with the rule: a new policy without the name
    reaches the address no more, even by the number the sandbox already knows."""
    name_servers(net_engine, server.address)
    with net_engine.client() as client:
        sandbox = client.create(
            template="base", size="tiny", network={"egress": [{"host": "svc.fytest.example", "ports": [8080]}]}
        )["id"]
        assert connect(client, sandbox, "svc.fytest.example", 8080, "named") == (0, b"pong named\n")
        assert connect(client, sandbox, server.address, 8080, "by number")[0] == 0  # admitted: the resolver answered it
        client.call("network.set", id=sandbox, network={"egress": [{"host": "other.fytest.example", "ports": [8080]}]})
        assert connect(client, sandbox, server.address, 8080)[0] != 0
        client.destroy(sandbox)


def test_a_forged_hosts_file_or_resolver_gains_nothing(net_engine: EngineProcess, server: Server):
    name_servers(net_engine, server.address)
    policy = {
        "egress": [
            {"host": "svc.fytest.example", "ports": [8080]},
            # Even a rule naming the server's port 53: DNS goes to the sandbox's resolver only.
            {"cidr": f"{server.address}/32", "ports": [53], "protocol": "udp"},
        ]
    }
    with net_engine.client() as client:
        sandbox = client.create(template="base", size="tiny", network=policy)["id"]
        # The name, in its own /etc/hosts, at an address the resolver never gave.
        client.exec(sandbox, f"echo '{server.other} svc.fytest.example' > /etc/hosts")
        assert connect(client, sandbox, "svc.fytest.example", 8080)[0] != 0
        assert server.received(8080, server.other) == b""
        # Its own resolver: the query never leaves the host.
        client.exec(sandbox, f"nslookup svc.fytest.example {server.address}")
        assert server.received(53) == b""
        denied = client.call("stats", id=sandbox)["network"]["denied"]
        assert {(item["address"], item["port"]) for item in denied} >= {(server.other, 8080), (server.address, 53)}
        assert "resolver" in next(item["rule"] for item in denied if item["port"] == 53)
        client.destroy(sandbox)


def test_members_of_a_group_reach_each_other_and_no_one_else(net_engine: EngineProcess, server: Server):
    grouped = {**allow(server, 8080), "group": "launch-a"}
    with net_engine.client() as client:
        first = client.create(template="base", size="tiny", network=grouped)["id"]
        second = client.create(template="base", size="tiny", network=grouped)["id"]
        outsider = client.create(template="base", size="tiny", network=allow(server, 8080))["id"]
        assert client.get(first)["network"]["group"] == "launch-a"
        address = client.get(second)["network"]["address"]
        outsider_address = client.get(outsider)["network"]["address"]
        client.exec(second, "setsid nc -l -p 9000 > /tmp/got < /dev/null 2>&1 &")
        client.exec(outsider, "setsid nc -l -p 9000 > /tmp/got < /dev/null 2>&1 &")
        # Not a member: refused, and nothing arrives.
        assert connect(client, outsider, address, 9000, "intruder")[0] != 0
        # Nor can a member reach the outsider.
        assert connect(client, first, outsider_address, 9000, "out")[0] != 0
        assert connect(client, first, address, 9000, "member")[0] == 0
        assert (
            client.exec(second, "for i in $(seq 100); do [ -s /tmp/got ] && break; sleep 0.05; done; cat /tmp/got").stdout
            == b"member\n"
        )
        assert client.exec(outsider, "cat /tmp/got").stdout == b""
        # Leaving the group (a policy change) closes the way.
        client.call("network.set", id=first, network=allow(server, 8080))
        client.exec(second, "setsid nc -l -p 9001 > /tmp/got2 < /dev/null 2>&1 &")
        assert connect(client, first, address, 9001, "again")[0] != 0
        for sandbox in (first, second, outsider):
            client.destroy(sandbox)
        assert table_objects(net_engine) == []


def test_bad_rules_are_refused_with_a_code(net_engine: EngineProcess):
    with net_engine.client() as client:
        for network in (
            {"egress": [{"cidr": "not-a-network"}]},
            {"egress": [{"cidr": "10.0.0.0/8", "ports": [0]}]},
            {"egress": [{"cidr": "10.0.0.0/8", "protocol": "icmp"}]},
            {"egress": [{"cidr": "10.0.0.0/8", "extra": 1}]},
            {"egress": [{"host": "not a name"}]},
            {"egress": [{"host": "pypi.org", "cidr": "10.0.0.0/8"}]},
            {"egress": "everything"},
            {"ingress": []},
            {"egress": [], "group": "no spaces"},
            {"egress": [{"cidr": "2001:db8::/32", "ports": [443]}]},  # a sandbox has IPv4 only: it would reach nothing
        ):
            with pytest.raises(errors.InvalidRequest):
                client.create(template="base", size="tiny", network=network)
        plain = client.create(template="base", size="tiny")["id"]
        with pytest.raises(errors.SandboxNotRunning, match="without a network policy"):
            client.call("network.set", id=plain, network={"egress": []})
        client.destroy(plain)
        assert host_devices(net_engine) == []


def test_destroy_and_a_crashed_engine_leave_nothing_behind(net_engine: EngineProcess, server: Server):
    with net_engine.client() as client:
        first = client.create(template="base", size="tiny", network=allow(server, 8080))["id"]
        assert len(host_devices(net_engine)) == 1
        assert table_objects(net_engine)
        client.destroy(first)
        assert host_devices(net_engine) == [] and table_objects(net_engine) == []

        kept = client.create(template="base", size="tiny", network=allow(server, 8080))["id"]
        doomed = client.create(template="base", size="tiny", network=allow(server, 8080))["id"]
    net_engine.kill()
    # While the engine is down, one sandbox dies: its namespace (and veth) go, its rules stay behind.
    store_pid = _init_pid(net_engine, doomed)
    os.kill(store_pid, 9)
    _wait_gone(store_pid)
    # And a host-side device that outlived its sandbox with no namespace to take it along (both ends on
    # the host), holding a pool address and with no rules left: found by its name and address alone.
    stray = f"fy{_tag('stray-sandbox')}"
    ip("link", "add", stray, "type", "veth", "peer", "name", "fystraypeer")
    ip("addr", "add", f"{ipaddress.ip_network(net_engine.config.network_pool)[-2]}/31", "dev", stray)
    assert stray in host_devices(net_engine)
    net_engine.start()
    with net_engine.client() as client:
        assert client.info()["recovery"]["networks_removed"] == 2
        assert host_devices(net_engine) == [f"fy{_tag(kept)}"]
        assert subprocess.run(["ip", "link", "show", "fystraypeer"], capture_output=True).returncode != 0
        # The adopted one still reaches what it may.
        assert connect(client, kept, server.address, 8080, "again")[1] == b"pong again\n"
        assert connect(client, kept, server.address, 8081)[0] != 0
        client.destroy(kept)
        assert host_devices(net_engine) == [] and table_objects(net_engine) == []


def test_a_crash_while_a_network_is_made_leaves_nothing_behind(net_engine: EngineProcess, server: Server):
    net_engine.stop()
    net_engine.start(crash_at=faults.NETWORK_STEPS[0])
    with net_engine.client(timeout_s=30) as client, pytest.raises(errors.Unavailable):
        client.create(template="base", size="tiny", id="crash-victim", network=allow(server, 8080))
    assert net_engine.wait_exit() == 137
    assert table_objects(net_engine)  # what the crash left
    net_engine.start()
    with net_engine.client() as client:
        recovery = client.info()["recovery"]
        assert recovery["reaped"] == 1 and recovery["networks_removed"] == 1
        assert host_devices(net_engine) == [] and table_objects(net_engine) == []


# 1,000 cycles (the count) take the machine a minute: asked for with -m scale, as the other long runs;
# bench/network_bench.py's leak loop runs them too, with the whole census.
@pytest.mark.parametrize("cycles", [25, pytest.param(1000, marks=[pytest.mark.slow, pytest.mark.scale])])
def test_create_destroy_cycles_with_a_policy_leave_nothing(net_engine: EngineProcess, server: Server, cycles: int):
    def engine_fds() -> int:
        return len(os.listdir(f"/proc/{net_engine.pid}/fd"))

    with net_engine.client() as client:
        # The first policed create opens what the engine keeps for all of them (netlink, nftables, threads).
        first = client.create(template="base", size="tiny", network=allow(server, 8080))["id"]
        assert connect(client, first, server.address, 8080, "first")[1] == b"pong first\n"
        client.destroy(first)
        before = engine_fds()
        for index in range(cycles):
            sandbox = client.create(template="base", size="tiny", network=allow(server, 8080))["id"]
            if index % 100 == 0:  # now and then, the policy holds in the middle of the run too
                assert connect(client, sandbox, server.address, 8080, "cycle")[1] == b"pong cycle\n"
            client.destroy(sandbox)
        assert host_devices(net_engine) == [] and table_objects(net_engine) == []
        # The engine holds no more descriptors than after the first: nothing a cycle opened stayed open.
        assert engine_fds() <= before, sorted(os.readlink(entry) for entry in Path(f"/proc/{net_engine.pid}/fd").iterdir())
        # The engine's resolver sockets went with them.
        assert client.info()["sandboxes"] == 0
    sockets = [entry for entry in Path("/proc/net/udp").read_text().splitlines()[1:] if entry.split()[1].endswith(":0035")]
    pool = ipaddress.ip_network(net_engine.config.network_pool)
    assert not [
        entry for entry in sockets if ipaddress.IPv4Address(int(entry.split()[1].split(":")[0], 16).to_bytes(4, "little")) in pool
    ]


def _tag(sandbox_id: str) -> str:
    from sandboxes.engine.network import interface_name

    return interface_name(sandbox_id)[2:]


def _init_pid(engine: EngineProcess, sandbox_id: str) -> int:
    from sandboxes.engine.store import open_store

    store = open_store(engine.config.database_path)
    try:
        (record,) = store.sandboxes_by_id([sandbox_id])
        return record.pid
    finally:
        store.close()


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists():
        assert time.monotonic() < deadline, f"{pid} did not exit"
        time.sleep(0.02)
