"""Name rules on the web's ports: the connection is matched by the name it asks for, and the host connects.

An address admitted because a name resolved to it is a weak rule: a sandbox
may reach that address under any name (a CDN serves thousands), keep using
it after the name moved (a CDN rotates), or have it forged by its own
``/etc/hosts``. So, as the hosted peers do, TCP to ports 80 and 443 under a
policy with a ``host`` rule for them never goes where the sandbox sent it:

1. The sandbox's chain in the host's ``prerouting`` hook (network.py,
   ``r-<tag>``) lets through what its address rules and its group allow,
   and redirects the rest of its TCP to 80 and 443 to this proxy: a
   listener of the engine's on the host side of the sandbox's link
   (``PROXY_PORT``), one per sandbox, so that which sandbox is asking is
   the listener it reached.
2. The proxy reads what the connection sends first, at most
   ``PEEK_BYTES`` within ``PEEK_TIMEOUT_S``: a TLS ClientHello's server
   name (SNI), or an HTTP request's ``Host``.
3. The name must match one of the sandbox's ``host`` rules for that port
   (``pypi.org``; ``*.example.org`` for its subdomains only). If none does,
   or the connection names nothing, it is reset before a byte goes anywhere
   and recorded (the denied log names the name and the port).
4. The engine resolves the name itself (resolver.py: the operator's hosts
   file, else the host's resolver, private and link-local answers dropped),
   at each connection: where the sandbox thought it was connecting does not
   matter, and a name that moved is followed.
5. It connects to the name's address on the same port from the host, sends
   what it read, and relays both ways until both ends finish.

TLS is never terminated: the sandbox's client still checks the certificate
of the server it reached, which is the name's. What this cannot see: a name
inside TLS (domain fronting, ECH) and QUIC (UDP); a UDP rule stays an
address rule. Other ports of a ``host`` rule fall back to the addresses its
resolver answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from . import ports
from .network import PROXIED_PORTS, PROXY_PORT, Rule, proxied_ports
from .resolver import rules_for

log = logging.getLogger("forkyard.engine.egress_proxy")

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h: where a redirected connection was going
PEEK_BYTES = 16 * 1024
PEEK_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 256  # open proxied connections per sandbox; more are reset

Resolve = Callable[[str], Awaitable[tuple[list[str], int] | None]]
Refused = Callable[[str, dict[str, Any]], None]


def sni_of(data: bytes) -> tuple[str | None, bool]:
    """The server name of a TLS ClientHello at the start of ``data``: (name, True); (None, True) when the
    hello is whole and names none (or is no hello); (None, False) when more bytes are needed."""
    handshake = b""
    offset = 0
    while True:  # the hello may span several records: gather their payloads
        if len(data) < offset + 5:
            return None, False
        kind, _, length = struct.unpack("!BHH", data[offset : offset + 5])
        if kind != 0x16:
            return None, True
        if len(data) < offset + 5 + length:
            return None, False
        handshake += data[offset + 5 : offset + 5 + length]
        offset += 5 + length
        if len(handshake) >= 4:
            if handshake[0] != 0x01:
                return None, True
            needed = 4 + int.from_bytes(handshake[1:4], "big")
            if len(handshake) >= needed:
                return _hello_server_name(handshake[4:needed]), True


def _hello_server_name(hello: bytes) -> str | None:
    try:
        position = 2 + 32  # version, random
        position += 1 + hello[position]  # session id
        position += 2 + int.from_bytes(hello[position : position + 2], "big")  # cipher suites
        position += 1 + hello[position]  # compression methods
        end = position + 2 + int.from_bytes(hello[position : position + 2], "big")
        position += 2
        while position + 4 <= end:
            kind = int.from_bytes(hello[position : position + 2], "big")
            size = int.from_bytes(hello[position + 2 : position + 4], "big")
            body = hello[position + 4 : position + 4 + size]
            position += 4 + size
            if kind != 0:  # server_name
                continue
            inner = 2
            while inner + 3 <= len(body):
                name_type = body[inner]
                name_length = int.from_bytes(body[inner + 1 : inner + 3], "big")
                name = body[inner + 3 : inner + 3 + name_length]
                inner += 3 + name_length
                if name_type == 0:
                    return name.decode("ascii").lower().rstrip(".")
    except (IndexError, UnicodeDecodeError):
        return None
    return None


def http_host_of(data: bytes) -> tuple[str | None, bool]:
    """An HTTP/1 request's ``Host`` (its port dropped): (name, True); (None, True) when the head is whole
    and names none (or is no request); (None, False) when more bytes are needed."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None, False
    lines = data[:end].split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        return None, True
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"host":
            host = value.strip().decode("ascii", "replace").lower()
            if host.startswith("["):
                return None, True  # an IPv6 literal: no name
            return host.rsplit(":", 1)[0].rstrip("."), True
    return None, True


def name_asked(data: bytes) -> tuple[str | None, bool]:
    """The name a connection asks for, from what it sent first: TLS's SNI or HTTP's Host."""
    if data[:1] == b"\x16":
        return sni_of(data)
    return http_host_of(data)


def proxied(rules: list[Rule]) -> bool:
    """Whether a sandbox with these rules needs the proxy: a TCP ``host`` rule for port 80 or 443."""
    return bool(proxied_ports(rules))


def _original_destination(connection: socket.socket) -> tuple[str, int]:
    raw = connection.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, address = struct.unpack("!2xH4s8x", raw)
    return str(ipaddress.IPv4Address(address)), port


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a reset: the sandbox's client sees "connection reset", at once."""
    connection = writer.get_extra_info("socket")
    with contextlib.suppress(OSError):
        if connection is not None:
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


class _SandboxProxy:
    def __init__(self, owner: NameProxies, sandbox_id: str, rules: list[Rule]) -> None:
        self.owner = owner
        self.sandbox_id = sandbox_id
        self.rules = rules
        self.server: asyncio.AbstractServer | None = None
        self.open = 0
        self.tasks: set[asyncio.Task[None]] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)
        self.open += 1
        try:
            await self._proxy(reader, writer)
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            _reset(writer)
        finally:
            self.open -= 1
            if task is not None:
                self.tasks.discard(task)

    def _refuse(self, writer: asyncio.StreamWriter, address: str, port: int, name: str | None, why: str) -> None:
        self.owner.counters["refused"] += 1
        self.owner.refused(self.sandbox_id, {"address": address, "protocol": "tcp", "port": port, "name": name, "rule": why})
        _reset(writer)

    async def _proxy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        address, port = _original_destination(writer.get_extra_info("socket"))
        if self.open > MAX_CONNECTIONS:
            self._refuse(writer, address, port, None, f"more than {MAX_CONNECTIONS} proxied connections at once")
            return
        if port not in PROXIED_PORTS:
            self._refuse(writer, address, port, None, "the name proxy answers only what its rules sent it")
            return
        first = b""
        name: str | None = None
        try:
            async with asyncio.timeout(PEEK_TIMEOUT_S):
                while len(first) < PEEK_BYTES:
                    chunk = await reader.read(PEEK_BYTES - len(first))
                    if not chunk:
                        break
                    first += chunk
                    name, whole = name_asked(first)
                    if whole:
                        break
        except TimeoutError:
            pass
        if not name:
            self._refuse(writer, address, port, None, "the connection named no host (TLS SNI or HTTP Host) to match")
            return
        matching = [
            rule
            for rule in rules_for(self.rules, name)
            if rule.protocol in ("tcp", "any") and (not rule.ports or port in rule.ports)
        ]
        if not matching:
            self._refuse(writer, address, port, name, f"no rule allows {name} on port {port}")
            return
        found = await self.owner.resolve(name)
        if not found or not found[0]:
            self._refuse(writer, address, port, name, f"{name} does not resolve to an address the sandbox may reach")
            return
        upstream = await self._connect(found[0], port)
        if upstream is None:
            self._refuse(writer, address, port, name, f"{name} did not answer on port {port}")
            return
        self.owner.counters["proxied"] += 1
        upstream.sendall(first)
        await ports.relay(reader, writer, upstream)

    async def _connect(self, addresses: list[str], port: int) -> socket.socket | None:
        loop = asyncio.get_running_loop()
        for address in addresses:
            upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            upstream.setblocking(False)
            try:
                await asyncio.wait_for(loop.sock_connect(upstream, (address, port)), CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError):
                upstream.close()
                continue
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return upstream
        return None

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self.tasks):
            task.cancel()


class NameProxies:
    """The engine's name proxies: one listener per sandbox whose rules name hosts on the web's ports."""

    def __init__(self, resolve: Resolve, refused: Refused, port: int = PROXY_PORT) -> None:
        self.resolve = resolve  # resolver.Resolvers.resolve: the operator's names, else the host's resolver
        self.refused = refused  # where a refusal is recorded (the sandbox's denied log)
        self.port = port
        self.by_sandbox: dict[str, _SandboxProxy] = {}
        self.counters = {"proxied": 0, "refused": 0}

    async def start(self, sandbox_id: str, address: str, rules: list[Rule]) -> None:
        """Listen for the sandbox (if its rules need it) on ``address``, the host side of its link."""
        self.stop(sandbox_id)
        if not proxied(rules):
            return
        proxy = _SandboxProxy(self, sandbox_id, rules)
        proxy.server = await asyncio.start_server(proxy.handle, address, self.port, reuse_address=True, backlog=256)
        self.by_sandbox[sandbox_id] = proxy

    async def update(self, sandbox_id: str, address: str, rules: list[Rule]) -> None:
        proxy = self.by_sandbox.get(sandbox_id)
        if proxy is not None and proxied(rules):
            proxy.rules = rules  # its open connections keep going; new ones are matched against these
        elif proxy is None and proxied(rules):
            await self.start(sandbox_id, address, rules)
        elif proxy is not None:
            self.stop(sandbox_id)

    def stop(self, sandbox_id: str) -> None:
        proxy = self.by_sandbox.pop(sandbox_id, None)
        if proxy is not None:
            proxy.close()

    def close(self) -> None:
        for sandbox_id in list(self.by_sandbox):
            self.stop(sandbox_id)

    def info(self) -> dict[str, int]:
        """What ``info`` reports: listeners, connections open now, and the counters."""
        return {
            "listeners": len(self.by_sandbox),
            "open_connections": sum(proxy.open for proxy in self.by_sandbox.values()),
            **self.counters,
        }
