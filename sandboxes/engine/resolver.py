"""Each policed sandbox's resolver: the names its policy allows, and nothing else.

A sandbox whose policy has ``host`` rules reaches those hosts through here.
The engine answers DNS on the host side of the sandbox's veth (UDP port 53
of its /31's even address, which the sandbox's ``/etc/resolv.conf`` names);
DNS to anywhere else is refused by its chains (network.py).  A query for a
name that no rule allows is answered ``REFUSED`` and goes nowhere (no
exfiltration through names).  An allowed name (``pypi.org``; ``*.example.org``
matches its subdomains, not ``example.org`` itself) is resolved by the
engine — from ``network_hosts`` (an operator's hosts-format file) first, then
the host's own resolver (dnspython) — and each IPv4 address of the answer is
admitted to the sandbox's nftables sets, for the rule's ports, for the
answer's TTL (30 s at least, an hour at most).  Addresses a public name
resolves to inside private or link-local ranges are dropped from the answer
(DNS rebinding); names of the operator's file are trusted as they are.

What a sandbox puts in its own ``/etc/hosts`` or asks of another resolver
changes nothing: only addresses this resolver answered are admitted. On
ports 80 and 443 the admission does not even count: the name proxy
(egress_proxy.py) matches each connection's TLS SNI or HTTP Host and
connects to the name itself; other ports of a ``host`` rule reach the
addresses admitted here. A refused name is recorded for the sandbox's denied
log (``refusals``), as the proxy's refusals are.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import dns.asyncresolver
import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.resolver

from .network import METADATA, PRIVATE, Rule

log = logging.getLogger("forkyard.engine.resolver")

MIN_TTL_S, MAX_TTL_S = 30, 3600
STATIC_TTL_S = 60
MAX_IN_FLIGHT = 16  # queries a sandbox may have waiting on an upstream answer; more are dropped
UPSTREAM_TIMEOUT_S = 3.0
REFUSALS_KEPT = 64


def name_allowed(pattern: str, name: str) -> bool:
    """``pypi.org`` matches itself; ``*.example.org`` matches ``a.example.org`` and ``a.b.example.org``,
    not ``example.org`` nor ``evil-example.org``."""
    pattern, name = pattern.lower().rstrip("."), name.lower().rstrip(".")
    if pattern.startswith("*."):
        return name.endswith(pattern[1:]) and len(name) > len(pattern) - 1
    return name == pattern


def rules_for(rules: list[Rule], name: str) -> list[Rule]:
    return [rule for rule in rules if rule.host and name_allowed(rule.host, name)]


class StaticNames:
    """An operator's hosts-format file (``address name...`` per line), read again when it changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.stamp: tuple[float, int] | None = None
        self.names: dict[str, list[str]] = {}

    def get(self, name: str) -> list[str] | None:
        if not self.path:
            return None
        try:
            status = os.stat(self.path)
        except OSError:
            return None
        if self.stamp != (status.st_mtime, status.st_size):
            names: dict[str, list[str]] = {}
            with open(self.path, encoding="utf-8", errors="replace") as lines:
                for line in lines:
                    fields = line.split("#", 1)[0].split()
                    if len(fields) < 2:
                        continue
                    try:
                        address = str(ipaddress.IPv4Address(fields[0]))
                    except ValueError:
                        continue  # IPv6 and junk: a sandbox has IPv4 only
                    for alias in fields[1:]:
                        names.setdefault(alias.lower().rstrip("."), []).append(address)
            self.names, self.stamp = names, (status.st_mtime, status.st_size)
        return self.names.get(name)


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, serve: Callable[[bytes, Any], None]) -> None:
        self.serve = serve

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.serve(data, addr)


class SandboxResolver:
    def __init__(self, owner: Resolvers, sandbox_id: str, rules: list[Rule]) -> None:
        self.owner = owner
        self.sandbox_id = sandbox_id
        self.rules = rules
        self.transport: asyncio.DatagramTransport | None = None
        self.in_flight = 0
        self.tasks: set[asyncio.Task[None]] = set()

    def serve(self, data: bytes, addr: Any) -> None:
        if self.in_flight >= MAX_IN_FLIGHT:
            return  # a flood: the sandbox's own resolver library retries
        self.in_flight += 1
        task = asyncio.get_running_loop().create_task(self._answer(data, addr))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _answer(self, data: bytes, addr: Any) -> None:
        try:
            answer = await self.owner.answer(self, data)
            if answer is not None and self.transport is not None:
                self.transport.sendto(answer, addr)
        except Exception as error:  # noqa: BLE001 - one query's failure is that query's: the resolver goes on
            log.warning("resolver of %s: %s", self.sandbox_id, error)
        finally:
            self.in_flight -= 1

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        for task in self.tasks:
            task.cancel()


class Resolvers:
    """The engine's resolvers, one per sandbox with a network policy; and what they and the name proxy
    refused by name, per sandbox (the last ``REFUSALS_KEPT``), for its denied log."""

    def __init__(self, admit: Callable[[str, list[Rule], list[str], int], None], hosts_file: str, upstream: str = "") -> None:
        self.admit = admit  # (sandbox id, rules, addresses, ttl): network.Network.admit
        self.static = StaticNames(hosts_file)
        self.upstream = upstream  # "": the host's own resolver
        self.by_sandbox: dict[str, SandboxResolver] = {}
        self.refused: dict[str, collections.deque[dict[str, Any]]] = {}
        self._upstream: dns.asyncresolver.Resolver | None = None

    def refuse(self, sandbox_id: str, attempt: dict[str, Any]) -> None:
        """Record a refusal by name: ``address``, ``protocol``, ``port``, ``name``, ``rule`` (why)."""
        if sandbox_id not in self.by_sandbox:
            return
        kept = self.refused.setdefault(sandbox_id, collections.deque(maxlen=REFUSALS_KEPT))
        kept.append({**attempt, "at": round(time.time(), 3)})

    def refusals(self, sandbox_id: str) -> list[dict[str, Any]]:
        return list(self.refused.get(sandbox_id, ()))

    async def start(self, sandbox_id: str, address: str, rules: list[Rule]) -> None:
        self.stop(sandbox_id)
        resolver = SandboxResolver(self, sandbox_id, rules)
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: _Protocol(resolver.serve), local_addr=(address, 53)
        )
        resolver.transport = transport
        self.by_sandbox[sandbox_id] = resolver

    def update(self, sandbox_id: str, rules: list[Rule]) -> None:
        resolver = self.by_sandbox.get(sandbox_id)
        if resolver is not None:
            resolver.rules = rules

    def stop(self, sandbox_id: str) -> None:
        resolver = self.by_sandbox.pop(sandbox_id, None)
        self.refused.pop(sandbox_id, None)
        if resolver is not None:
            resolver.close()

    def close(self) -> None:
        for sandbox_id in list(self.by_sandbox):
            self.stop(sandbox_id)

    async def answer(self, resolver: SandboxResolver, data: bytes) -> bytes | None:
        try:
            query = dns.message.from_wire(data)
        except dns.exception.DNSException:
            return None  # not DNS
        response = dns.message.make_response(query)
        response.flags |= dns.flags.RA
        if len(query.question) != 1:
            response.set_rcode(dns.rcode.FORMERR)
            return bytes(response.to_wire())
        question = query.question[0]
        name = question.name.to_text(omit_final_dot=True).lower()
        matching = rules_for(resolver.rules, name)
        if not matching or question.rdclass != dns.rdataclass.IN:
            self.refuse(
                resolver.sandbox_id,
                {
                    "address": None,
                    "protocol": "dns",
                    "port": 53,
                    "name": name[:253],
                    "rule": f"no rule allows the name {name[:253]}",
                },
            )
            response.set_rcode(dns.rcode.REFUSED)
            return bytes(response.to_wire())
        if question.rdtype != dns.rdatatype.A:
            return bytes(response.to_wire())  # no data: a sandbox has IPv4 only
        found = await self.resolve(name)
        if found is None:
            response.set_rcode(dns.rcode.SERVFAIL)
            return bytes(response.to_wire())
        addresses, ttl = found
        if not addresses:
            response.set_rcode(dns.rcode.NXDOMAIN)
            return bytes(response.to_wire())
        ttl = min(max(ttl, MIN_TTL_S), MAX_TTL_S)
        # Before the answer (a connect may follow at once), off the loop: nftables may take a while under load.
        await asyncio.to_thread(self.admit, resolver.sandbox_id, matching, addresses, ttl)
        rrset = response.find_rrset(response.answer, question.name, dns.rdataclass.IN, dns.rdatatype.A, create=True)
        for address in addresses:
            rrset.add(dns.rdata.from_text(dns.rdataclass.IN, dns.rdatatype.A, address), ttl)
        return bytes(response.to_wire())

    async def resolve(self, name: str) -> tuple[list[str], int] | None:
        """The name's IPv4 addresses and TTL; ([], 0) for a name that does not exist; None when unknown."""
        static = self.static.get(name)
        if static is not None:
            return static, STATIC_TTL_S
        if self._upstream is None:
            self._upstream = dns.asyncresolver.Resolver(configure=not self.upstream)
            if self.upstream:
                self._upstream.nameservers = [self.upstream]
        try:
            answer = await self._upstream.resolve(name, "A", lifetime=UPSTREAM_TIMEOUT_S)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return [], 0
        except dns.exception.DNSException:
            return None
        addresses = []
        for record in answer:
            address = ipaddress.IPv4Address(record.address)
            # A public name never resolves, for a sandbox, into private or link-local ranges (rebinding).
            if address in METADATA or any(address in private for private in PRIVATE):
                continue
            addresses.append(str(address))
        return addresses, int(answer.rrset.ttl) if answer.rrset is not None else MIN_TTL_S
