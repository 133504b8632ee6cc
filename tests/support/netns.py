"""A server of the test's own, in a network namespace it makes: what network tests may send traffic to.

MEASURED.md's network rule: test namespaces take addresses from 198.18.0.0/15 only, and the route to the
server is checked to go through the test's own veth before anything is sent.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

SERVER = textwrap.dedent(
    """
    import json, selectors, socket, sys, threading
    log_dir = sys.argv[1]

    def dns_answer(query):  # what dns.json (a test writes it: {name: [address, ...]}) says, or None
        try:
            import dns.message, dns.rdataclass, dns.rdatatype, dns.rrset
            with open(f"{log_dir}/dns.json") as answers:
                names = json.load(answers)
            message = dns.message.from_wire(query)
            question = message.question[0]
            found = names.get(question.name.to_text(omit_final_dot=True).lower())
            if found is None or question.rdtype != dns.rdatatype.A:
                return None
            response = dns.message.make_response(message)
            response.answer.append(dns.rrset.from_text_list(question.name, 1, "IN", "A", found))
            return response.to_wire()
        except Exception:  # no dns.json yet, or not a DNS query: no answer
            return None

    def sink():  # port 8082: reads a connection to its end, then answers how much came (benchmarks)
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", 8082))
        listener.listen(16)
        while True:
            connection, _ = listener.accept()
            received = 0
            while chunk := connection.recv(1 << 20):
                received += len(chunk)
            connection.sendall(str(received).encode())
            connection.close()

    threading.Thread(target=sink, daemon=True).start()
    selector = selectors.DefaultSelector()
    for port in (8080, 8081, 80, 443):
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", port))
        listener.listen(64)
        selector.register(listener, selectors.EVENT_READ, port)
    dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dns.bind(("0.0.0.0", 53))
    selector.register(dns, selectors.EVENT_READ, 53)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # UDP 8080: logs what arrives
    udp.bind(("0.0.0.0", 8080))
    selector.register(udp, selectors.EVENT_READ, "udp")
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.data in (53, "udp"):
                data, sender = key.fileobj.recvfrom(4096)
                with open(f"{log_dir}/{'port-53' if key.data == 53 else 'udp-8080'}.log", "ab") as log:
                    log.write(data)
                answer = dns_answer(data) if key.data == 53 else None
                if answer is not None:
                    key.fileobj.sendto(answer, sender)
                continue
            connection, _ = key.fileobj.accept()
            local = connection.getsockname()[0]
            connection.settimeout(5)
            with open(f"{log_dir}/{local}-{key.data}.log", "ab") as log:
                log.write(b"connection\\n")
                try:
                    data = connection.recv(16384)
                    if data.startswith(b"POST /sink "):  # a sink behind the web ports (benchmarks: the name proxy)
                        received = len(data.partition(b"\\r\\n\\r\\n")[2])
                        connection.settimeout(60)
                        while chunk := connection.recv(1 << 20):
                            received += len(chunk)
                        log.write(b"sink %d\\n" % received)
                        connection.sendall(str(received).encode())
                    else:
                        log.write(data)
                        connection.sendall(b"pong " + data)
                except OSError:
                    pass
            connection.close()
    """
)


@dataclass
class Server:
    """A namespace of the test's own with a TCP server on 8080, 8081, 80 and 443 (each logs what it is sent
    and answers "pong " and that; a ``POST /sink`` is read to its end instead), a sink on 8082 (benchmarks) and a UDP port 53 that logs every datagram
    and answers only the names ``answer`` gave it, at ``address`` and at ``other`` (a second address of the
    same namespace)."""

    address: str
    other: str
    log_dir: Path
    namespace: str = ""  # its network namespace (``ip netns exec`` it for a server of a test's own)
    link: str = ""  # the host's end of its veth

    def answer(self, names: dict[str, list[str]]) -> None:
        """What its DNS port answers from now on: ``{name: [IPv4 address, ...]}`` (TTL 1 s); other names get
        no answer."""
        (self.log_dir / "dns.json.tmp").write_text(json.dumps(names))
        (self.log_dir / "dns.json.tmp").rename(self.log_dir / "dns.json")

    @contextlib.contextmanager
    def taking(self, address: str) -> Iterator[None]:
        """``address`` (one no test may send to: cloud metadata, say) given to the server too, and the
        host's route to it pointed at the server's veth and checked, for as long as this lasts: what
        should never leave the host, were it to get out, lands here, where ``received`` shows it."""
        ip("-n", self.namespace, "addr", "add", f"{address}/32", "dev", "eth0")
        ip("route", "add", f"{address}/32", "dev", self.link)
        try:
            route = json.loads(ip("-j", "route", "get", address))
            assert route[0]["dev"] == self.link, route
            yield
        finally:
            subprocess.run(["ip", "route", "del", f"{address}/32", "dev", self.link], capture_output=True)

    def received(self, port: int, address: str = "", protocol: str = "tcp") -> bytes:
        """What reached ``port`` at ``address`` (the first one by default); port 53: any DNS datagram;
        ``protocol="udp"``: what reached UDP 8080."""
        name = "port-53.log" if port == 53 else "udp-8080.log" if protocol == "udp" else f"{address or self.address}-{port}.log"
        path = self.log_dir / name
        return path.read_bytes() if path.exists() else b""


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    with serving(tmp_path) as running:
        yield running


@contextlib.contextmanager
def serving(tmp_path: Path) -> Iterator[Server]:
    """The server's namespace, made and removed (the ``server`` fixture; benchmarks use it directly)."""
    with namespace() as (name, outside, address, other):
        log_dir = tmp_path / "server"
        log_dir.mkdir()
        process = subprocess.Popen(
            ["ip", "netns", "exec", name, sys.executable, "-c", SERVER, str(log_dir)], stdout=subprocess.PIPE
        )
        try:
            assert process.stdout is not None and process.stdout.readline() == b"ready\n"
            yield Server(address, other, log_dir, name, outside)
        finally:
            process.kill()
            process.wait()


@contextlib.contextmanager
def namespace() -> Iterator[tuple[str, str, str, str]]:
    """A network namespace of the test's own behind a veth, made and removed: its name, the host's end of
    the veth, and its two addresses (198.18.x.2 and .3), each checked to be routed through that veth."""
    tag = os.urandom(3).hex()
    third = int(tag[:2], 16) % 200 + 20
    name, outside = f"fyt-{tag}", f"fyt{tag}a"
    address, other, host_address = f"198.18.{third}.2", f"198.18.{third}.3", f"198.18.{third}.1"
    ip("netns", "add", name)
    try:
        ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", name)
        ip("addr", "add", f"{host_address}/24", "dev", outside)
        ip("link", "set", outside, "up")
        ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", name, "addr", "add", f"{other}/24", "dev", "eth0")
        ip("-n", name, "link", "set", "eth0", "up")
        ip("-n", name, "link", "set", "lo", "up")
        # The network rule: the route to the server must be our own veth before anything is sent.
        for target in (address, other):
            route = json.loads(ip("-j", "route", "get", target))
            assert route[0]["dev"] == outside, route
        yield name, outside, address, other
    finally:
        subprocess.run(["ip", "link", "del", outside], capture_output=True)
        ip("netns", "del", name)


@contextlib.contextmanager
def serve_directory(name: str, address: str, port: int, directory: Path) -> Iterator[str]:
    """``directory`` over HTTP at ``address:port`` in the namespace ``name`` (Python's http.server),
    answering once this returns; its URL."""
    serving = subprocess.Popen(
        ["ip", "netns", "exec", name, sys.executable, "-m", "http.server", str(port), "--bind", address],
        cwd=directory,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        probe = ["ip", "netns", "exec", name, sys.executable, "-c"]
        ask = f"import urllib.request; urllib.request.urlopen('http://{address}:{port}/')"
        while subprocess.run([*probe, ask], capture_output=True).returncode != 0:
            assert serving.poll() is None and time.monotonic() < deadline, "the HTTP server did not start"
            time.sleep(0.2)
        yield f"http://{address}:{port}/"
    finally:
        serving.kill()
        serving.wait()


def allow(server: Server, *ports: int, protocol: str = "tcp") -> dict[str, Any]:
    """A network (the engine's ``network``) allowing the server's /24 on these ports."""
    network = str(ipaddress.ip_network(f"{server.address}/24", strict=False))
    return {"egress": [{"cidr": network, "ports": list(ports), "protocol": protocol}]}
