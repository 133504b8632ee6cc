"""Name rules on ports 80 and 443: matched by the name a connection asks for (TLS SNI, HTTP Host), and the host
connects to that name itself (egress_proxy.py).

The sandbox sends a TLS ClientHello (built here, with the server name the
test chooses) or an HTTP request with ``nc``, to an address of the test's own
server. Where it arrives is read from the server's logs: by the address it
was reached at, so that "the host connected to the name, not where the
sandbox sent it" is something the test sees.
"""

from __future__ import annotations

import ipaddress
import struct
from pathlib import Path

import pytest

from sandboxes.engine.client import EngineClient
from sandboxes.engine.egress_proxy import http_host_of, name_asked, sni_of
from tests.engine.networks import net_engine, table_objects
from tests.support.engine import EngineProcess
from tests.support.netns import Server, server

__all__ = ["net_engine", "server"]  # fixtures

pytestmark = pytest.mark.root

NAME = "svc.fytest.example"


def client_hello(server_name: str | None) -> bytes:
    """A TLS 1.2 ClientHello, with a server name extension for ``server_name``."""
    extensions = b""
    if server_name is not None:
        name = server_name.encode()
        entry = b"\x00" + struct.pack("!H", len(name)) + name
        listing = struct.pack("!H", len(entry)) + entry
        extensions += struct.pack("!HH", 0, len(listing)) + listing
    body = b"\x03\x03" + bytes(32) + b"\x00" + struct.pack("!H", 2) + b"\x13\x01" + b"\x01\x00"
    body += struct.pack("!H", len(extensions)) + extensions
    handshake = b"\x01" + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + struct.pack("!H", len(handshake)) + handshake


def send(client: EngineClient, sandbox: str, address: str, port: int, payload: bytes) -> tuple[int, bytes]:
    """``payload`` sent with nc from inside the sandbox; its exit code and what came back."""
    client.write_file(sandbox, "/tmp/payload", payload)
    result = client.exec(sandbox, f"nc -w 3 {address} {port} < /tmp/payload", timeout_s=30)
    return result.exit_code, result.stdout


def hosts(engine: EngineProcess, lines: str) -> None:
    Path(engine.config.network_hosts).write_text(lines)


def test_the_names_a_connection_asks_for_are_read_from_its_first_bytes() -> None:
    assert sni_of(client_hello("Pypi.org.")) == ("pypi.org", True)
    assert sni_of(client_hello(None)) == (None, True)
    hello = client_hello("a.example")
    assert sni_of(hello[:20]) == (None, False), "a hello cut short waits for more"
    # Split over two records, as a large hello may be.
    handshake = hello[5:]
    split = b"\x16\x03\x01" + struct.pack("!H", 10) + handshake[:10] + b"\x16\x03\x01" + struct.pack("!H", len(handshake) - 10)
    assert sni_of(split + handshake[10:]) == ("a.example", True)
    assert http_host_of(b"GET / HTTP/1.1\r\nHost: Web.Example:8080\r\n\r\n") == ("web.example", True)
    assert http_host_of(b"GET / HTTP/1.1\r\nAccept: */*\r\n") == (None, False)
    assert http_host_of(b"GET / HTTP/1.1\r\nAccept: */*\r\n\r\n") == (None, True)
    assert name_asked(b"SSH-2.0-x\r\n\r\n") == (None, True)


def test_a_name_rule_sends_tls_to_the_name_whatever_address_the_sandbox_chose(net_engine: EngineProcess, server: Server):
    hosts(net_engine, f"{server.address} {NAME}\n")
    with net_engine.client() as client:
        sandbox = client.create(template="base", size="tiny", network={"egress": [{"host": NAME, "ports": [443]}]})["id"]
        hello = client_hello(NAME)
        # Sent to the server's other address (a forged /etc/hosts would send it there): the host connected to
        # the name, which its hosts file puts at the first address.
        code, answer = send(client, sandbox, server.other, 443, hello)
        assert code == 0 and answer == b"pong " + hello
        assert server.received(443) == b"connection\n" + hello
        assert server.received(443, server.other) == b"", "reached where the sandbox sent it, not where the name is"
        client.destroy(sandbox)
        assert table_objects(net_engine) == []


def test_a_name_no_rule_allows_gets_no_byte_through_and_is_in_the_denied_log(net_engine: EngineProcess, server: Server):
    hosts(net_engine, f"{server.address} {NAME} other.fytest.example evil-svc.fytest.example\n")
    rules = {"egress": [{"host": NAME, "ports": [443]}, {"host": "*.wild.fytest.example", "ports": [80, 443]}]}
    with net_engine.client() as client:
        sandbox = client.create(template="base", size="tiny", network=rules)["id"]
        for payload in (
            client_hello("other.fytest.example"),
            client_hello("evil-svc.fytest.example"),
            client_hello("wild.fytest.example"),  # the wildcard's apex is not its subdomain
            client_hello(None),  # no name at all
            b"GET / HTTP/1.1\r\nHost: other.fytest.example\r\n\r\n",  # plain HTTP on 443: its Host counts
        ):
            code, answer = send(client, sandbox, server.address, 443, payload)
            assert answer == b"", payload
        assert server.received(443) == b"", "a refused name reached the server"
        denied = client.call("stats", id=sandbox)["network"]["denied"]
        named = {item["name"] for item in denied if item["port"] == 443}
        assert {"other.fytest.example", "evil-svc.fytest.example", "wild.fytest.example", None} <= named
        refusal = next(item for item in denied if item["name"] == "other.fytest.example")
        assert refusal["rule"] == "no rule allows other.fytest.example on port 443" and refusal["address"] == server.address
        client.destroy(sandbox)


def test_http_is_matched_by_its_host_and_a_wildcard_by_its_subdomains(net_engine: EngineProcess, server: Server):
    hosts(net_engine, f"{server.address} a.wild.fytest.example b.c.wild.fytest.example\n")
    with net_engine.client() as client:
        sandbox = client.create(
            template="base", size="tiny", network={"egress": [{"host": "*.wild.fytest.example", "ports": [80]}]}
        )["id"]
        for name in ("a.wild.fytest.example", "b.c.wild.fytest.example"):
            request = f"GET / HTTP/1.1\r\nHost: {name}\r\n\r\n".encode()
            code, answer = send(client, sandbox, server.address, 80, request)
            assert code == 0 and answer == b"pong " + request, name
        # The rule is for port 80: TLS to 443 under the same name is refused.
        assert send(client, sandbox, server.address, 443, client_hello("a.wild.fytest.example"))[1] == b""
        assert server.received(443) == b""
        client.destroy(sandbox)


def test_a_name_that_moves_is_followed_at_each_connection(net_engine: EngineProcess, server: Server):
    """A CDN rotating its addresses, or a name rebound: the host resolves the name itself for each
    connection, so neither a stale address nor one the sandbox cached matters."""
    hosts(net_engine, f"{server.address} {NAME}\n")
    with net_engine.client() as client:
        sandbox = client.create(template="base", size="tiny", network={"egress": [{"host": NAME, "ports": [443]}]})["id"]
        first = client_hello(NAME)
        assert send(client, sandbox, server.address, 443, first)[0] == 0
        hosts(net_engine, f"{server.other} {NAME}\n")  # the name moved
        second = client_hello(NAME) + b"again"
        assert send(client, sandbox, server.address, 443, second)[0] == 0
        assert server.received(443) == b"connection\n" + first
        assert server.received(443, server.other) == b"connection\n" + second
        client.destroy(sandbox)


def test_address_rules_on_443_are_not_proxied(net_engine: EngineProcess, server: Server):
    hosts(net_engine, f"{server.address} {NAME}\n")
    rules = {"egress": [{"host": NAME, "ports": [443]}, {"cidr": f"{server.other}/32", "ports": [443]}]}
    with net_engine.client() as client:
        sandbox = client.create(template="base", size="tiny", network=rules)["id"]
        # Not TLS at all, to an address a rule names: it goes where it was sent, as it is.
        assert send(client, sandbox, server.other, 443, b"raw bytes\n") == (0, b"pong raw bytes\n")
        assert server.received(443, server.other) == b"connection\nraw bytes\n"
        # The proxy's own port is no way out either: only what the host redirected reaches it.
        host_side = str(ipaddress.ip_address(client.get(sandbox)["network"]["address"]) - 1)
        assert send(client, sandbox, host_side, 15001, client_hello(NAME))[1] == b""
        client.destroy(sandbox)


def test_a_policy_change_starts_and_stops_the_proxy(net_engine: EngineProcess, server: Server):
    hosts(net_engine, f"{server.address} {NAME}\n")
    with net_engine.client() as client:
        sandbox = client.create(template="base", size="tiny", network={"egress": [{"host": NAME, "ports": [8080]}]})["id"]
        hello = client_hello(NAME)
        assert send(client, sandbox, server.address, 443, hello)[1] == b"", "no rule for 443 yet"
        client.call("network.set", id=sandbox, network={"egress": [{"host": NAME, "ports": [443]}]})
        assert send(client, sandbox, server.address, 443, hello) == (0, b"pong " + hello)
        client.call("network.set", id=sandbox, network={"egress": [{"host": NAME, "ports": [8080]}]})
        assert send(client, sandbox, server.address, 443, hello + b"2")[1] == b""
        assert server.received(443) == b"connection\n" + hello
        client.destroy(sandbox)


def test_an_adopted_sandbox_keeps_its_name_rules(net_engine: EngineProcess, server: Server):
    hosts(net_engine, f"{server.address} {NAME}\n")
    with net_engine.client() as client:
        sandbox = client.create(template="base", size="tiny", network={"egress": [{"host": NAME, "ports": [443]}]})["id"]
    net_engine.kill()
    net_engine.start()
    with net_engine.client() as client:
        hello = client_hello(NAME)
        assert send(client, sandbox, server.address, 443, hello) == (0, b"pong " + hello)
        assert send(client, sandbox, server.address, 443, client_hello("other.fytest.example"))[1] == b""
        client.destroy(sandbox)
        assert table_objects(net_engine) == []
