"""A sandbox's way out: a veth pair, addresses from the engine's pool, and nftables rules.

A sandbox without a network policy has loopback only and costs nothing here:
no device, address or rule is made for it.  One with a policy gets

* a veth pair (pyroute2): ``fy<hash>`` on the host, ``eth0`` in the sandbox's
  network namespace, a /31 of ``network_pool`` (the host side the even
  address, the sandbox the odd one) and a default route through the host side;
* in the engine's one nftables table (``network_table``, family ``inet``,
  written through libnftables' JSON interface), a chain ``e-<hash>`` for what
  the sandbox forwards and a chain ``h-<hash>`` for what it sends to the host
  itself, reached through the verdict maps ``out`` and ``host`` keyed by the
  host-side interface; a dynamic set ``d-<hash>`` that records each refused
  (address, protocol, port) with its last time; a counter ``n-<hash>`` of
  refused packets.

Each chain accepts replies to what it let out, drops all IPv6 and every
packet to link-local addresses (cloud metadata: never, whatever the rules),
accepts what a rule allows and records and drops the rest.  A rule's
``cidr`` reaches a private range only if it lies inside one, i.e. names it;
a wider rule (``0.0.0.0/0``) reaches public addresses only.  Other
sandboxes (the engine's pool) and the host's own addresses are reached only
by a rule naming the one address exactly (a /32): a ``10.0.0.0/8`` rule
reaches the private network, not the host's own address in it, and a rule
wide enough to hold the pool reaches no sandbox.  The host's own addresses
come in through the ``input`` hook, where only such exact rules apply.

Replacing a sandbox's rules (a policy changed) is one nftables transaction:
flush its chains and add the new rules.  Removing them is another.  The
engine's sandboxes all live in one table, so recovery finds what leaked
(chains, sets, counters, map elements, devices of sandboxes that are gone)
by name and removes it.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import ipaddress
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .errors import EngineError, InvalidRequest
from .kernel import Kernel

CLONE_NEWNET = 0x40000000

log = logging.getLogger("forkyard.engine.network")
T = TypeVar("T")

# Never reachable through a wide rule; reachable through a rule inside one of them.
PRIVATE = [
    ipaddress.IPv4Network(network)
    for network in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.168.0.0/16",
        "198.18.0.0/15",
        "224.0.0.0/4",
        "240.0.0.0/4",
    )
]
METADATA = ipaddress.IPv4Network("169.254.0.0/16")  # link-local: cloud metadata lives here; never reachable
PROTOCOLS = ("tcp", "udp", "any")
MAX_RULES = 256
MAX_PORTS = 64
DENIED_KEPT = 256  # refused destinations remembered per sandbox
DENIED_TIMEOUT_S = 3600  # ... for this long after their last attempt
DENIED_SHOWN = 20
# TCP to these ports under a ``host`` rule goes through the name proxy (egress_proxy.py), which listens
# on this port of the host side of each such sandbox's link.
PROXIED_PORTS = (80, 443)
PROXY_PORT = 15001


class NetworkError(EngineError):
    code = "network_failed"


HOST_PATTERN = re.compile(r"^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class Rule:
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None  # an address rule, or
    host: str | None  # a name rule (resolver.py): "pypi.org", "*.example.org"
    ports: tuple[int, ...]
    protocol: str

    @property
    def narrow(self) -> bool:
        """Inside a private range (or one address): it names what it reaches."""
        network = self.network
        if network is None or network.version != 4:
            return False
        return network.prefixlen == 32 or any(network.subnet_of(private) for private in PRIVATE)

    @property
    def exact(self) -> bool:
        """One address: the only kind of rule that reaches the host itself or another sandbox."""
        network = self.network
        return network is not None and network.version == 4 and network.prefixlen == 32

    def to_dict(self) -> dict[str, Any]:
        where = {"host": self.host} if self.host else {"cidr": str(self.network)}
        return {**where, "ports": list(self.ports), "protocol": self.protocol}


def parse_egress(raw: Any) -> list[Rule]:
    """A policy's egress rules as the engine takes them: ``[{"cidr" or "host", "ports", "protocol"}]``."""
    if not isinstance(raw, list) or len(raw) > MAX_RULES:
        raise InvalidRequest(f"network.egress must be a list of at most {MAX_RULES} rules", field="network.egress")
    rules = []
    for index, item in enumerate(raw):
        where = f"network.egress.{index}"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object", field=where)
        unknown = sorted(set(item) - {"cidr", "host", "ports", "protocol"})
        if unknown:
            raise InvalidRequest(f"{where}: unknown field {unknown[0][:40]!r}", field=f"{where}.{unknown[0][:40]}")
        cidr, host = item.get("cidr"), item.get("host")
        if bool(cidr) == bool(host):
            raise InvalidRequest(f"{where}: give exactly one of cidr or host", field=where)
        network = None
        if host:
            if not isinstance(host, str) or len(host) > 253 or not HOST_PATTERN.match(host.lower()):
                raise InvalidRequest(f"{where}.host must be a host name such as pypi.org or *.example.org", field=f"{where}.host")
            host = host.lower()
        else:
            try:
                network = ipaddress.ip_network(cidr, strict=False) if isinstance(cidr, str) else None
            except ValueError:
                network = None
            if network is None:
                raise InvalidRequest(f"{where}.cidr must be a network such as 203.0.113.0/24", field=f"{where}.cidr")
            if network.version != 4:
                raise InvalidRequest(
                    f"{where}.cidr: a sandbox has IPv4 only, so an IPv6 rule would reach nothing", field=f"{where}.cidr"
                )
            if network.subnet_of(METADATA):
                raise InvalidRequest(
                    f"{where}.cidr: link-local addresses (cloud metadata) are never reachable, so this rule would reach nothing",
                    field=f"{where}.cidr",
                )
        ports = item.get("ports") or []
        if (
            not isinstance(ports, list)
            or len(ports) > MAX_PORTS
            or not all(isinstance(port, int) and not isinstance(port, bool) and 1 <= port <= 65535 for port in ports)
        ):
            raise InvalidRequest(f"{where}.ports must be at most {MAX_PORTS} ports of 1-65535", field=f"{where}.ports")
        protocol = item.get("protocol", "tcp")
        if protocol not in PROTOCOLS:
            raise InvalidRequest(f"{where}.protocol must be one of {', '.join(PROTOCOLS)}", field=f"{where}.protocol")
        rules.append(Rule(network, host or None, tuple(sorted(set(ports))), protocol))
    return rules


def proxied_ports(rules: list[Rule]) -> list[int]:
    """The web ports (``PROXIED_PORTS``) a TCP ``host`` rule covers: their connections go through the name proxy."""
    found: set[int] = set()
    for rule in rules:
        if rule.host and rule.protocol in ("tcp", "any"):
            found.update(PROXIED_PORTS if not rule.ports else set(rule.ports) & set(PROXIED_PORTS))
    return sorted(found)


_threads = threading.local()  # each thread's netlink socket (pyroute2's IPRoute), made once
_netlink_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="netlink")


def host_netlink() -> Any:
    """This thread's netlink socket in the host's namespace: made once per thread, since making one costs
    more than most of what it is used for. Not for the event loop's thread (pyroute2's synchronous API
    runs a loop of its own): there, ``_netlink``."""
    from pyroute2 import IPRoute

    ipr = getattr(_threads, "ipr", None)
    if ipr is None:
        ipr = _threads.ipr = IPRoute()
    return ipr


def _netlink(operation: Callable[[Any], T]) -> T:
    """Run ``operation(IPRoute)`` on the engine's netlink thread, and wait for it: pyroute2's synchronous
    API runs an event loop of its own, which it cannot do on the engine's (running) one."""
    return _netlink_thread.submit(lambda: operation(host_netlink())).result()


def preload() -> None:
    """Import pyroute2 (about half a second of CPU) ahead of the first create with a policy: the engine
    calls this on a thread of its own at start."""
    import pyroute2  # noqa: F401


GROUP_PATTERN = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def parse_group(raw: Any) -> str:
    """``network.group``: sandboxes with the same group may reach each other (a launch's members); "" for none."""
    if raw is None or raw == "":
        return ""
    if not isinstance(raw, str) or not GROUP_PATTERN.match(raw):
        raise InvalidRequest("network.group must be 1-64 characters of A-Z, a-z, 0-9, _ . : -", field="network.group")
    return raw


def _group_set(group: str) -> str:
    return "g-" + hashlib.blake2b(group.encode(), digest_size=7).hexdigest()[:13]


def interface_name(sandbox_id: str) -> str:
    """The host side's name: 15 characters at most, the same for the same sandbox."""
    return "fy" + hashlib.blake2b(sandbox_id.encode(), digest_size=7).hexdigest()[:13]


def _tag(sandbox_id: str) -> str:
    return interface_name(sandbox_id)[2:]


def _policy_key(rules: list[Rule], group: str) -> str:
    """The name of the chains of these rules under this group (pe-, ph-, pr-<key>): the same rules, the same chains."""
    # The version names what the chains mean: 2 since the host and other sandboxes need an exact rule, so
    # that an engine upgraded over a table of older chains makes its new sandboxes' chains afresh.
    spec = json.dumps([2, [rule.to_dict() for rule in rules], group], sort_keys=True)
    return hashlib.blake2b(spec.encode(), digest_size=7).hexdigest()[:13]


# --- nftables JSON ---------------------------------------------------------------------


def _prefix(network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> dict[str, Any]:
    return {"prefix": {"addr": str(network.network_address), "len": network.prefixlen}}


def _daddr() -> dict[str, Any]:
    return {"payload": {"protocol": "ip", "field": "daddr"}}


def _match(left: dict[str, Any], right: Any, op: str = "==") -> dict[str, Any]:
    return {"match": {"op": op, "left": left, "right": right}}


def _rule_exprs(rule: Rule, pool: ipaddress.IPv4Network) -> list[dict[str, Any]] | None:
    """The matches of one address rule (IPv4 only: a sandbox has no IPv6 route), or None. A wide rule
    skips the private ranges; a rule inside one that is not one address skips the engine's pool (other
    sandboxes: reached only when named exactly)."""
    if rule.network is None or rule.network.version != 4:
        return None
    exprs = [_match(_daddr(), _prefix(rule.network))]
    if not rule.narrow:
        exprs.append(_match(_daddr(), {"set": [_prefix(private) for private in PRIVATE]}, "!="))
    elif not rule.exact and rule.network.overlaps(pool):
        exprs.append(_match(_daddr(), _prefix(pool), "!="))
    if rule.protocol != "any":
        exprs.append(_match({"meta": {"key": "l4proto"}}, rule.protocol))
    if rule.ports:
        # A port rule without a protocol covers TCP and UDP; anything else has no ports.
        if rule.protocol == "any":
            exprs.append(_match({"meta": {"key": "l4proto"}}, {"set": ["tcp", "udp"]}))
        exprs.append(_match({"payload": {"protocol": "th", "field": "dport"}}, {"set": list(rule.ports)}))
    return exprs


class Network:
    """The engine's side of sandbox networks (one instance per engine)."""

    def __init__(self, pool: str, table: str, kernel: Kernel) -> None:
        self.kernel = kernel
        try:
            self.pool = ipaddress.IPv4Network(pool)
        except ValueError as error:
            raise EngineError(f"network_pool {pool!r} is not an IPv4 network: {error}") from None
        if self.pool.prefixlen > 30:
            raise EngineError(f"network_pool {pool!r} is too small")
        self.table = table
        self._nft: Any = None
        self._lock = threading.Lock()
        self._ready = False
        # Which policy chains each interface uses, and who uses each (read back from the table at setup):
        # a transaction that changes them is computed and run under _state_lock, and recorded once it ran.
        self._state_lock = threading.RLock()
        self._policy_of: dict[str, str] = {}  # interface -> policy key
        self._users: dict[str, set[str]] = {}  # policy key -> interfaces
        self._named: set[str] = set()  # interfaces with an element in "names"
        self._legacy: set[str] = set()  # tags with an r-<tag> chain, from an engine before the policy chains
        # Tags whose admitted sets may hold elements (their resolver answered an allowed name): only those
        # need flushing when their rules change; each flush is a command, and commands cost in proportion
        # to the table. Unknown after a restart, so every sandbox found then counts.
        self._admitted: set[str] = set()

    # --- nftables ---

    def _nftables(self) -> Any:
        if self._nft is None:
            try:
                import nftables  # Debian's python3-nftables (libnftables); scripts/bootstrap exposes it to the venv
            except ImportError:
                raise NetworkError("the nftables Python binding is missing: run scripts/bootstrap") from None
            nft = nftables.Nftables()
            nft.set_json_output(True)
            nft.set_handle_output(True)
            self._nft = nft
        return self._nft

    def _command(self, commands: list[dict[str, Any]]) -> tuple[int, Any, str]:
        with self._lock:  # one libnftables context, used from the loop and from worker threads
            rc, output, error = self._nftables().json_cmd({"nftables": commands})
        return rc, output, error

    def _run(self, commands: list[dict[str, Any]]) -> dict[str, Any]:
        rc, output, error = self._command(commands)
        if rc != 0:
            raise NetworkError(f"nftables refused the rules: {str(error).strip()[:500]}")
        return output if isinstance(output, dict) else {}

    def _object(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {kind: {"family": "inet", "table": self.table, **fields}}

    def setup(self) -> None:
        """The engine's table, its hooks and maps (idempotent), and forwarding on."""
        if self._ready:
            return
        with open("/proc/sys/net/ipv4/ip_forward", "w") as sysctl:
            sysctl.write("1")
        t = self.table
        self._run(
            [
                {"add": {"table": {"family": "inet", "name": t}}},
                {"add": self._object("map", name="out", type="ifname", map="verdict")},
                {"add": self._object("map", name="host", type="ifname", map="verdict")},
                {"add": self._object("set", name="ifaces", type="ifname")},
                {"add": self._object("chain", name="forward", type="filter", hook="forward", prio=0, policy="accept")},
                {"add": self._object("chain", name="input", type="filter", hook="input", prio=0, policy="accept")},
                {"add": self._object("chain", name="post", type="nat", hook="postrouting", prio=100, policy="accept")},
                {"add": self._object("map", name="names", type="ifname", map="verdict")},
                {"add": self._object("map", name="pol_e", type="ifname", map="verdict")},
                {"add": self._object("map", name="pol_h", type="ifname", map="verdict")},
                {"add": self._object("chain", name="pre", type="nat", hook="prerouting", prio=-100, policy="accept")},
                {"flush": self._object("chain", name="forward")},
                {"flush": self._object("chain", name="input")},
                {"flush": self._object("chain", name="post")},
                {"flush": self._object("chain", name="pre")},
                # A sandbox with name rules on the web's ports: its chain r-<tag> may send them to its proxy.
                {
                    "add": self._object(
                        "rule", chain="pre", expr=[{"vmap": {"key": {"meta": {"key": "iifname"}}, "data": "@names"}}]
                    )
                },
                {
                    "add": self._object(
                        "rule", chain="forward", expr=[{"vmap": {"key": {"meta": {"key": "iifname"}}, "data": "@out"}}]
                    )
                },
                # Into a sandbox: only replies to what it opened.
                {
                    "add": self._object(
                        "rule",
                        chain="forward",
                        expr=[
                            _match({"meta": {"key": "oifname"}}, "@ifaces"),
                            _match({"ct": {"key": "state"}}, {"set": ["established", "related"]}, "in"),
                            {"accept": None},
                        ],
                    )
                },
                {
                    "add": self._object(
                        "rule", chain="forward", expr=[_match({"meta": {"key": "oifname"}}, "@ifaces"), {"drop": None}]
                    )
                },
                {
                    "add": self._object(
                        "rule", chain="input", expr=[{"vmap": {"key": {"meta": {"key": "iifname"}}, "data": "@host"}}]
                    )
                },
                # Out of the host: the sandbox's pool address is the host's.
                {
                    "add": self._object(
                        "rule",
                        chain="post",
                        expr=[
                            _match({"payload": {"protocol": "ip", "field": "saddr"}}, _prefix(self.pool)),
                            _match({"meta": {"key": "oifname"}}, "@ifaces", "!="),
                            {"masquerade": None},
                        ],
                    )
                },
            ]
        )
        self._load()
        # The netlink thread's socket (a teardown's, when a sandbox's device outlives its namespace) is made
        # now, with the rest that every sandbox with a network shares: not by whichever teardown first
        # meets such a device, which under load is any of them, and the engine's descriptors then grew by
        # its four (socket, event loop) in the middle of a run.
        _netlink(lambda ipr: None)
        self._ready = True

    def _load(self) -> None:
        """What the table holds of the policy chains and their users (an engine restarted finds them)."""
        rc, output, _ = self._command([{"list": {"table": {"family": "inet", "name": self.table}}}])
        items = output.get("nftables", []) if rc == 0 and isinstance(output, dict) else []
        keys: set[str] = set()
        with self._state_lock:
            self._policy_of, self._users, self._named, self._legacy, self._admitted = {}, {}, set(), set(), set()
            for item in items:
                chain = item.get("chain") if isinstance(item, dict) else None
                if chain and chain.get("name", "").startswith("pe-"):
                    keys.add(chain["name"][3:])
                elif chain and chain.get("name", "").startswith("r-"):
                    self._legacy.add(chain["name"][2:])
                found = item.get("map") if isinstance(item, dict) else None
                if not found or found.get("name") not in ("pol_e", "names"):
                    continue
                for element in found.get("elem") or []:
                    if not (isinstance(element, list) and len(element) == 2 and isinstance(element[0], str)):
                        continue
                    if found["name"] == "names":
                        self._named.add(element[0])
                        continue
                    verdict: dict[str, Any] = next(iter(element[1].values()), {}) if isinstance(element[1], dict) else {}
                    target = str(verdict.get("target", "")) if isinstance(verdict, dict) else ""
                    if target.startswith("pe-"):
                        self._policy_of[element[0]] = target[3:]
                        self._users.setdefault(target[3:], set()).add(element[0])
                        self._admitted.add(element[0][2:])
            unused: dict[str, set[str]] = {key: set() for key in keys if key not in self._users}
            if unused:
                self._command(self._unused_policies(unused))

    def _chain_rules(self, tag: str, address: str, rules: list[Rule], to_host: bool, group: str = "") -> list[dict[str, Any]]:
        chain = ("h-" if to_host else "e-") + tag
        out: list[dict[str, Any]] = []

        def add(*expr: dict[str, Any]) -> None:
            out.append({"add": self._object("rule", chain=chain, expr=list(expr))})

        add(_match({"ct": {"key": "state"}}, {"set": ["established", "related"]}, "in"), {"accept": None})
        add(_match({"meta": {"key": "nfproto"}}, "ipv6"), {"counter": f"n-{tag}"}, {"drop": None})
        # Root inside may change its own address: a packet from any other is spoofed.
        add(_match({"payload": {"protocol": "ip", "field": "saddr"}}, address, "!="), {"counter": f"n-{tag}"}, {"drop": None})
        denied = [
            _match({"meta": {"key": "l4proto"}}, {"set": ["tcp", "udp"]}),
            {
                "set": {
                    "op": "update",
                    "elem": {
                        "concat": [_daddr(), {"meta": {"key": "l4proto"}}, {"payload": {"protocol": "th", "field": "dport"}}]
                    },
                    "set": f"@d-{tag}",
                }
            },
        ]
        add(_match(_daddr(), _prefix(METADATA)), *denied)
        add(_match(_daddr(), _prefix(METADATA)), {"counter": f"n-{tag}"}, {"drop": None})
        # DNS: to its resolver (resolver.py) on the host side of its link, and nowhere else whatever the rules.
        dns_port = [
            _match({"meta": {"key": "l4proto"}}, {"set": ["tcp", "udp"]}),
            _match({"payload": {"protocol": "th", "field": "dport"}}, 53),
        ]
        if to_host:
            resolver = str(ipaddress.IPv4Address(address) - 1)
            add(_match(_daddr(), resolver), _match({"meta": {"key": "l4proto"}}, "udp"), dns_port[1], {"accept": None})
        add(*dns_port, *denied[1:])
        add(*dns_port, {"counter": f"n-{tag}"}, {"reject": {"type": "icmpx", "expr": "admin-prohibited"}})
        if group and not to_host:
            # The other members of its group (a launch's sandboxes), whatever else the rules say.
            add(_match(_daddr(), f"@{_group_set(group)}"), {"accept": None})
        if not to_host:
            # Addresses its resolver answered for an allowed name, for that rule's ports, until their TTL ends.
            proto_port = [{"meta": {"key": "l4proto"}}, {"payload": {"protocol": "th", "field": "dport"}}]
            add(_match({"concat": [_daddr(), *proto_port]}, f"@a-{tag}"), {"accept": None})
            add(_match({"concat": [_daddr(), proto_port[0]]}, f"@ap-{tag}"), {"accept": None})
        # What its rules allow: their own chain, shared by every sandbox under the same rules (_policy_chains),
        # reached through a map keyed by its interface, so that new rules are one element each to change.
        add({"vmap": {"key": {"meta": {"key": "iifname"}}, "data": "@" + ("pol_h" if to_host else "pol_e")}})
        add(*denied)
        # Refused at once (a reset, an ICMP error) rather than silently: a rollout sees "refused", not a hang.
        tcp = _match({"meta": {"key": "l4proto"}}, "tcp")
        add(tcp, {"counter": f"n-{tag}"}, {"reject": {"type": "tcp reset"}})
        add({"counter": f"n-{tag}"}, {"reject": {"type": "icmpx", "expr": "admin-prohibited"}})
        return out

    def _policy_chains(self, key: str, rules: list[Rule], group: str) -> list[dict[str, Any]]:
        """The chains of one set of rules (and group), shared by every sandbox under them: ``pe-<key>``,
        the accepts of what it forwards; ``ph-<key>``, of what it sends the host (narrow rules only);
        ``pr-<key>``, its redirects: what its address rules (and its group) reach goes where it was sent,
        the rest of its TCP to the ports its name rules cover goes to its name proxy (egress_proxy.py)."""
        out: list[dict[str, Any]] = []
        for prefix in ("pe", "ph", "pr"):
            out += [
                {"add": self._object("chain", name=f"{prefix}-{key}")},
                {"flush": self._object("chain", name=f"{prefix}-{key}")},
            ]

        def add(chain: str, *expr: dict[str, Any]) -> None:
            out.append({"add": self._object("rule", chain=f"{chain}-{key}", expr=list(expr))})

        for rule in rules:
            exprs = _rule_exprs(rule, self.pool)
            if exprs is None:
                continue
            add("pe", *exprs, {"accept": None})
            if rule.exact:  # the host's own addresses: only a rule naming one of them exactly
                add("ph", *exprs, {"accept": None})
        web = proxied_ports(rules)
        if not web:
            return out
        # Its name proxy on the host side of its link, reached only by what pr-<key> redirected there (the
        # redirect's dnat status: never a connection of its own, which cannot make one).
        add(
            "ph",
            _match({"meta": {"key": "l4proto"}}, "tcp"),
            _match({"payload": {"protocol": "th", "field": "dport"}}, PROXY_PORT),
            _match({"ct": {"key": "status"}}, "dnat", "in"),
            {"accept": None},
        )
        tcp = _match({"meta": {"key": "l4proto"}}, "tcp")
        add("pr", _match(_daddr(), _prefix(METADATA)), {"return": None})  # refused (and recorded) by its filter
        if group:
            add("pr", _match(_daddr(), f"@{_group_set(group)}"), {"return": None})
        for rule in rules:
            exprs = _rule_exprs(rule, self.pool)
            if exprs is not None:
                add("pr", *exprs, {"return": None})
        add(
            "pr", tcp, _match({"payload": {"protocol": "th", "field": "dport"}}, {"set": web}), {"redirect": {"port": PROXY_PORT}}
        )
        return out

    def _policy_elements(self, changes: list[tuple[str, str]], known: set[str], named: set[str]) -> list[dict[str, Any]]:
        """Point these interfaces at their policies' chains: (interface, policy key); those in ``known``
        have elements in the policy maps already, those in ``named`` one in "names"."""
        if not changes:
            return []
        commands: list[dict[str, Any]] = []
        for name, prefix, verdict in (("pol_e", "pe", "jump"), ("pol_h", "ph", "jump"), ("names", "pr", "goto")):
            old = [ifname for ifname, _ in changes if ifname in (named if name == "names" else known)]
            if old:
                commands.append({"delete": self._object("element", name=name, elem=old)})
            elements = [[ifname, {verdict: {"target": f"{prefix}-{key}"}}] for ifname, key in changes]
            commands.append({"add": self._object("element", name=name, elem=elements)})
        return commands

    def _unused_policies(self, users: dict[str, set[str]]) -> list[dict[str, Any]]:
        """Delete the chains of the policies in ``users`` that no interface uses any more (after the
        elements that used them)."""
        return [
            {"delete": self._object("chain", name=f"{prefix}-{key}")}
            for key, members in users.items()
            if not members
            for prefix in ("pe", "ph", "pr")
        ]

    def _rules_commands(self, tag: str, address: str, rules: list[Rule], group: str = "") -> list[dict[str, Any]]:
        members: list[dict[str, Any]] = []
        if group:
            members = [
                {"add": self._object("set", name=_group_set(group), type="ipv4_addr")},
                {"add": self._object("element", name=_group_set(group), elem=[address])},
            ]
        return [
            *members,
            {"flush": self._object("chain", name=f"e-{tag}")},
            {"flush": self._object("chain", name=f"h-{tag}")},
            {"flush": self._object("set", name=f"a-{tag}")},  # admitted under the old rules
            {"flush": self._object("set", name=f"ap-{tag}")},
            *self._chain_rules(tag, address, rules, to_host=False, group=group),
            *self._chain_rules(tag, address, rules, to_host=True, group=group),
        ]

    # --- a sandbox's network ---

    def free_slot(self, taken: set[int]) -> int:
        for slot in range(self.pool.num_addresses // 2):
            if slot not in taken:
                return slot
        raise NetworkError(f"network_pool {self.pool} has no /31 left")

    def host_address(self, slot: int) -> str:
        """The host side of a slot's /31 (its even address); the sandbox takes the odd one."""
        return str(self.pool.network_address + 2 * slot)

    def write_rules(self, sandbox_id: str, slot: int, rules: list[Rule], group: str = "") -> None:
        """Its chains, sets, counter and map elements, in one transaction: before any device exists, so that
        nothing passes before they are in place (they need none: the maps are keyed by interface name)."""
        self.setup()
        tag, ifname = _tag(sandbox_id), interface_name(sandbox_id)
        inside = self.pool.network_address + 2 * slot + 1
        with self._state_lock:
            key = _policy_key(rules, group)
            commands = [
                {"add": self._object("chain", name=f"e-{tag}")},
                {"add": self._object("chain", name=f"h-{tag}")},
                {"add": self._object("counter", name=f"n-{tag}")},
                {
                    "add": self._object(
                        "set",
                        name=f"d-{tag}",
                        type=["ipv4_addr", "inet_proto", "inet_service"],
                        flags=["timeout"],  # "dynamic" too, implied by the update rule (1.0.6 JSON has no word for it)
                        timeout=DENIED_TIMEOUT_S,
                        size=DENIED_KEPT,
                    )
                },
                {
                    "add": self._object(
                        "set", name=f"a-{tag}", type=["ipv4_addr", "inet_proto", "inet_service"], flags=["timeout"]
                    )
                },
                {"add": self._object("set", name=f"ap-{tag}", type=["ipv4_addr", "inet_proto"], flags=["timeout"])},
                *self._rules_commands(tag, str(inside), rules, group),
                *([] if key in self._users else self._policy_chains(key, rules, group)),
                *self._policy_elements([(ifname, key)], known=set(), named=set()),
                {"add": self._object("element", name="out", elem=[[ifname, {"goto": {"target": f"e-{tag}"}}]])},
                {"add": self._object("element", name="host", elem=[[ifname, {"goto": {"target": f"h-{tag}"}}]])},
                {"add": self._object("element", name="ifaces", elem=[ifname])},
            ]
            self._run(commands)
            self._policy_of[ifname] = key
            self._users.setdefault(key, set()).add(ifname)
            self._named.add(ifname)

    def make_devices(
        self, sandbox_id: str, pid: int, slot: int, rules: list[Rule], proc_dir: str = "/proc", group: str = ""
    ) -> dict[str, Any]:
        """Its veth pair, addresses and route (``write_rules`` first); what its record keeps of them. On a
        failure everything made for it, rules included, is removed.

        Three netlink writes (``rtnl``: the pair; the host side's address and state; the sandbox side's
        address, state and route), where pyroute2's ``IPRoute`` took eleven requests at about 0.7 ms
        of CPU each: most of what a policy added to a create."""
        from . import rtnl  # pyroute2's messages: imported with pyroute2 (``preload``), not at engine start

        ifname = interface_name(sandbox_id)
        host = self.pool.network_address + 2 * slot
        inside = host + 1
        netns = os.open(f"{proc_dir}/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            with rtnl.Rtnl() as here:
                here.run(rtnl.veth(ifname, "eth0", netns))
                index = socket.if_nametoindex(ifname)
                _no_ipv6(ifname)  # before it is up: no link-local address either (a sandbox has IPv4 only)
                here.run(rtnl.address(index, str(host), 31), rtnl.up(index))
            # A thread of the engine goes into the sandbox's namespace, makes its netlink socket there (and
            # reads eth0's index, and turns IPv6 off: /proc/sys/net is the namespace's), and comes back.
            home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                self.kernel.setns(netns, CLONE_NEWNET)
                try:
                    there = rtnl.Rtnl()
                    index = socket.if_nametoindex("eth0")
                    _no_ipv6("eth0")
                finally:
                    self.kernel.setns(home, CLONE_NEWNET)  # never leave this thread in the sandbox
            finally:
                os.close(home)
            with there:
                there.run(rtnl.address(index, str(inside), 31), rtnl.up(index), rtnl.default_route(str(host)))
        except Exception as error:  # noqa: BLE001 - netlink's and the kernel's: the create fails with the reason
            self.detach(sandbox_id, str(inside), group)
            raise NetworkError(f"making the network of {sandbox_id} failed: {error}") from None
        finally:
            os.close(netns)
        return {
            "slot": slot,
            "interface": ifname,
            "host_address": str(host),
            "address": str(inside),
            "egress": [rule.to_dict() for rule in rules],
            "group": group,
        }

    def replace(self, sandbox_id: str, address: str, rules: list[Rule], group: str = "", old_group: str = "") -> None:
        """Its rules (and group), replaced in one transaction."""
        self.replace_many([(sandbox_id, address, rules, group, old_group)])

    def replace_many(self, changes: list[tuple[str, str, list[Rule], str, str]]) -> None:
        """Many sandboxes' rules (and groups) replaced in one transaction: (id, address, rules, group, old group).

        A sandbox keeps its own chains and has its policy map elements pointed at the chains of its new
        rules (made once for all the sandboxes under them), and what its resolver had admitted under the
        old ones is forgotten: a few commands for the whole change, and a few cheap ones per sandbox,
        where writing each sandbox's rules again took 48.9 s at 1,000 of them (docs/benchmarks.md).
        Its own chains are written again only when its group changed (a rule in them names the group)
        or they are an older engine's."""
        self.setup()
        with self._state_lock:
            users = {key: set(members) for key, members in self._users.items()}
            commands: list[dict[str, Any]] = []
            moves: list[tuple[str, str]] = []
            legacy: list[str] = []
            flushed: list[str] = []
            for sandbox_id, address, rules, group, old_group in changes:
                tag, ifname = _tag(sandbox_id), interface_name(sandbox_id)
                key = _policy_key(rules, group)
                if key not in users:
                    commands += self._policy_chains(key, rules, group)
                    users[key] = set()
                if ifname not in self._policy_of or group != old_group:
                    commands += self._rules_commands(tag, address, rules, group)
                elif tag in self._admitted:
                    commands += [
                        {"flush": self._object("set", name=f"a-{tag}")},  # admitted under the old rules
                        {"flush": self._object("set", name=f"ap-{tag}")},
                    ]
                    flushed.append(tag)
                if tag in self._legacy:
                    legacy.append(tag)
                old_key = self._policy_of.get(ifname)
                if old_key is not None:
                    users[old_key].discard(ifname)
                users[key].add(ifname)
                moves.append((ifname, key))
            commands += self._policy_elements(moves, known=set(self._policy_of), named=self._named)
            commands += [{"delete": self._object("chain", name=f"r-{tag}")} for tag in legacy]
            commands += self._unused_policies(users)
            self._run(commands)
            self._users = {key: members for key, members in users.items() if members}
            for ifname, key in moves:
                self._policy_of[ifname] = key
                self._named.add(ifname)
            self._legacy -= set(legacy)
            self._admitted -= set(flushed)
        for _, address, _, group, old_group in changes:
            if old_group and old_group != group:
                self._leave_group(address, old_group)

    def _leave_group(self, address: str, group: str) -> None:
        name = _group_set(group)
        self._command([{"delete": self._object("element", name=name, elem=[address])}])
        self._command([{"delete": self._object("set", name=name)}])  # refused while another member's rules use it

    def detach(self, sandbox_id: str, address: str = "", group: str = "") -> None:
        """Remove every device, element, chain, set and counter made for it (what is already gone is fine)."""
        from pyroute2.netlink.exceptions import NetlinkError

        tag, ifname = _tag(sandbox_id), interface_name(sandbox_id)
        if os.path.exists(f"/sys/class/net/{ifname}"):  # else gone with its namespace
            try:
                _netlink(lambda ipr: ipr.link("del", ifname=ifname))
            except NetlinkError:
                pass  # gone meanwhile
        self._remove_rules([(tag, ifname)])
        if address and group:
            self._leave_group(address, group)

    def _remove_rules(self, found: list[tuple[str, str]]) -> None:
        # Every command costs libnftables a read of the whole table (its cache), so one transaction for all
        # of them: at 1,000 sandboxes with policies, eleven commands a sandbox made a teardown of 250 take
        # minutes. A batch fails whole if any object is already gone (nftables here has no "destroy"): then
        # one command at a time, each allowed to fail.
        self.setup()  # an engine restarted reads what the table holds first
        with self._state_lock:
            users = {key: set(members) for key, members in self._users.items()}
            commands: list[dict[str, Any]] = []
            for tag, ifname in found:
                elements = ["out", "host", "ifaces"]
                elements += ["names"] if ifname in self._named or ifname not in self._policy_of else []
                elements += ["pol_e", "pol_h"] if ifname in self._policy_of else []
                chains = ["e", "h"] + (["r"] if tag in self._legacy or ifname not in self._policy_of else [])
                commands += [{"delete": self._object("element", name=name, elem=[ifname])} for name in elements]
                commands += [{"delete": self._object("chain", name=f"{prefix}-{tag}")} for prefix in chains]
                commands += [{"delete": self._object("set", name=f"{prefix}-{tag}")} for prefix in ("d", "a", "ap")]
                commands.append({"delete": self._object("counter", name=f"n-{tag}")})
                key = self._policy_of.get(ifname)
                if key is not None:
                    users[key].discard(ifname)
            if not commands:
                return
            commands += self._unused_policies(users)
            rc, _, _ = self._command(commands)
            if rc != 0:
                for command in commands:
                    self._command([command])
            self._users = {key: members for key, members in users.items() if members}
            for tag, ifname in found:
                self._policy_of.pop(ifname, None)
                self._named.discard(ifname)
                self._legacy.discard(tag)
                self._admitted.discard(tag)

    def admit(self, sandbox_id: str, rules: list[Rule], addresses: list[str], ttl_s: int) -> None:
        """Let the sandbox reach these addresses (its resolver's answer for a name these rules allow), on the
        rules' ports and protocols, for ``ttl_s`` seconds (connections open by then stay open)."""
        tag = _tag(sandbox_id)
        with_ports: list[Any] = []
        any_port: list[Any] = []
        for rule in rules:
            protocols = ("tcp", "udp") if rule.protocol == "any" else (rule.protocol,)
            for address in addresses:
                for protocol in protocols:
                    if rule.ports:
                        with_ports.extend(
                            {"elem": {"val": {"concat": [address, protocol, port]}, "timeout": ttl_s}} for port in rule.ports
                        )
                    else:
                        any_port.append({"elem": {"val": {"concat": [address, protocol]}, "timeout": ttl_s}})
        commands = []
        if with_ports:
            commands.append({"add": self._object("element", name=f"a-{tag}", elem=with_ports)})
        if any_port:
            commands.append({"add": self._object("element", name=f"ap-{tag}", elem=any_port)})
        if commands:
            with self._state_lock:  # a change of its rules comes before or after, never between
                self._run(commands)
                self._admitted.add(tag)  # its next change of rules flushes them

    def remove_table(self) -> None:
        """The engine's table, hooks and all (the offline reclaim: no sandbox of this engine is left)."""
        self._command([{"delete": {"table": {"family": "inet", "name": self.table}}}])
        self._ready = False

    def stats(self, sandbox_id: str) -> dict[str, Any]:
        """Bytes in and out (as the host's end of its veth counts them), refused packets, and the last
        refused destinations with the reason."""
        tag, ifname = _tag(sandbox_id), interface_name(sandbox_id)
        # What the host's end receives, the sandbox sent (refused packets included), and the reverse.
        sent, received = _counter(ifname, "rx_bytes"), _counter(ifname, "tx_bytes")
        denied_packets = 0
        counter = self._list("counter", f"n-{tag}")
        for item in counter:
            if "counter" in item:
                denied_packets = item["counter"].get("packets", 0)
        attempts = []
        now = time.time()
        for item in self._list("set", f"d-{tag}"):
            for element in (item.get("set") or {}).get("elem") or []:
                value = element.get("elem", {}) if isinstance(element, dict) else {}
                key = value.get("val", {}).get("concat") if isinstance(value, dict) else None
                if not key:
                    continue
                address, protocol, port = key
                expires = value.get("expires", DENIED_TIMEOUT_S)
                attempts.append(
                    {
                        "address": address,
                        "protocol": protocol,
                        "port": port,
                        "rule": refusal_reason(address, port),
                        "at": round(now - (DENIED_TIMEOUT_S - expires), 3),
                    }
                )
        attempts.sort(key=lambda attempt: attempt["at"], reverse=True)
        return {
            "bytes_out": sent,
            "bytes_in": received,
            "denied_packets": denied_packets,
            "denied": attempts[:DENIED_SHOWN],
        }

    def _list(self, kind: str, name: str) -> list[dict[str, Any]]:
        rc, output, _ = self._command([{"list": self._object(kind, name=name)}])
        if rc != 0 or not isinstance(output, dict):
            return []
        return [item for item in output.get("nftables", []) if isinstance(item, dict)]

    def reclaim(self, keep: dict[str, str]) -> int:
        """Remove what was made for sandboxes not in ``keep`` (id -> address): leaked devices, elements,
        chains, sets and counters, and group members that are gone.  How many sandboxes' leftovers were
        removed."""
        self.setup()
        keep_tags = {_tag(sandbox_id) for sandbox_id in keep}
        kept_addresses = set(keep.values())
        leaked: dict[str, str] = {}
        groups: dict[str, list[str]] = {}
        rc, output, _ = self._command([{"list": {"table": {"family": "inet", "name": self.table}}}])
        if rc == 0 and isinstance(output, dict):
            for item in output.get("nftables", []):
                chain = item.get("chain") if isinstance(item, dict) else None
                if chain and chain.get("name", "")[:2] in ("e-", "h-", "r-"):
                    tag = chain["name"][2:]
                    if tag not in keep_tags:
                        leaked[tag] = "fy" + tag
                named_set = item.get("set") if isinstance(item, dict) else None
                if named_set and named_set.get("name", "").startswith("g-"):
                    groups[named_set["name"]] = []
        for name in groups:
            for item in self._list("set", name):
                elements = (item.get("set") or {}).get("elem") or []
                groups[name] = [element for element in elements if isinstance(element, str)]

        def remove_devices(ipr: Any) -> list[str]:
            removed = []
            for link in ipr.get_links():
                name = link.get_attr("IFLA_IFNAME") or ""
                if not name.startswith("fy") or name[2:] in keep_tags:
                    continue
                addresses = [address.get_attr("IFA_ADDRESS") for address in ipr.get_addr(index=link["index"], family=2)]
                if any(address and ipaddress.IPv4Address(address) in self.pool for address in addresses):
                    ipr.link("del", index=link["index"])
                    removed.append(name)
            return removed

        for name in _netlink(remove_devices):
            leaked.setdefault(name[2:], name)
        self._remove_rules(sorted(leaked.items()))
        for name, members in groups.items():
            gone = [address for address in members if address not in kept_addresses]
            if gone:
                self._command([{"delete": self._object("element", name=name, elem=gone)}])
            self._command([{"delete": self._object("set", name=name)}])  # refused while a member's rules use it
        return len(leaked)


def _no_ipv6(ifname: str) -> None:
    """No IPv6 on this interface (of the calling thread's network namespace), link-local included."""
    try:
        with open(f"/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6", "w") as sysctl:
            sysctl.write("1")
    except FileNotFoundError:
        pass  # a kernel without IPv6: nothing to turn off


def _counter(ifname: str, name: str) -> int:
    try:
        with open(f"/sys/class/net/{ifname}/statistics/{name}") as counter:
            return int(counter.read())
    except (OSError, ValueError):
        return 0


def refusal_reason(address: str, port: int = 0) -> str:
    if port == 53:
        return "DNS goes to the sandbox's own resolver only"
    try:
        parsed = ipaddress.IPv4Address(address)
    except ValueError:
        return "no rule allows it"
    if parsed in METADATA:
        return "link-local and metadata addresses are never reachable"
    if any(parsed in private for private in PRIVATE):
        return "private address: only a rule naming it allows it"
    return "no rule allows it"
