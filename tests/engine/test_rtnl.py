"""The engine's batched route-netlink requests (``rtnl``) against the real kernel, in a namespace of the
test's own (198.18.0.0/15 addresses; no traffic is sent)."""

from __future__ import annotations

import errno
import json
import os
import socket
from collections.abc import Iterator

import pytest

from sandboxes.engine import rtnl
from sandboxes.engine.kernel import CLONE_NEWNET, Kernel
from tests.support.netns import ip

pytestmark = pytest.mark.root


def socket_in(namespace_fd: int) -> rtnl.Rtnl:
    """A netlink socket made in that namespace, by this thread going there and back (as the engine's does)."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        Kernel().setns(namespace_fd, CLONE_NEWNET)
        try:
            return rtnl.Rtnl()
        finally:
            Kernel().setns(home, CLONE_NEWNET)
    finally:
        os.close(home)


@pytest.fixture
def namespace() -> Iterator[str]:
    name = f"fyrt-{os.urandom(3).hex()}"
    ip("netns", "add", name)
    try:
        yield name
    finally:
        ip("netns", "del", name)


def test_a_pair_its_addresses_and_route_in_three_writes(namespace: str) -> None:
    outside = f"fyrt{os.urandom(3).hex()}"
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        with rtnl.Rtnl() as here:
            here.run(rtnl.veth(outside, "eth0", fd))
            index = socket.if_nametoindex(outside)
            here.run(rtnl.address(index, "198.18.250.0", 31), rtnl.up(index))
        inside = json.loads(ip("-n", namespace, "-j", "link", "show", "eth0"))[0]["ifindex"]
        with socket_in(fd) as there:
            there.run(rtnl.address(inside, "198.18.250.1", 31), rtnl.up(inside), rtnl.default_route("198.18.250.0"))
        host_side = json.loads(ip("-j", "addr", "show", outside))[0]
        assert "UP" in host_side["flags"]
        assert [(a["local"], a["prefixlen"]) for a in host_side["addr_info"] if a["family"] == "inet"] == [("198.18.250.0", 31)]
        their_side = json.loads(ip("-n", namespace, "-j", "addr", "show", "eth0"))[0]
        assert "UP" in their_side["flags"]
        assert [(a["local"], a["prefixlen"]) for a in their_side["addr_info"] if a["family"] == "inet"] == [("198.18.250.1", 31)]
        routes = json.loads(ip("-n", namespace, "-j", "route", "show", "default"))
        assert [(route["gateway"], route["dev"]) for route in routes] == [("198.18.250.0", "eth0")]
    finally:
        os.close(fd)
        ip("link", "del", outside)


def test_a_refused_request_is_named_and_the_others_are_still_answered(namespace: str) -> None:
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        there = socket_in(fd)
    finally:
        os.close(fd)
    with there:
        loopback = 1
        with pytest.raises(rtnl.RtnlError) as refused:
            there.run(rtnl.up(loopback), rtnl.address(999, "198.18.250.3", 31), rtnl.address(loopback, "198.18.250.5", 32))
        assert refused.value.errno == errno.ENODEV and "address 198.18.250.3/31" in str(refused.value)
        # The kernel went on after the refusal: the request before it and the one after both took effect.
        lo = json.loads(ip("-n", namespace, "-j", "addr", "show", "lo"))[0]
        assert "UP" in lo["flags"] and "198.18.250.5" in [a["local"] for a in lo["addr_info"]]
        there.run(rtnl.up(loopback))  # the socket is still in step: the next batch's answers are its own
