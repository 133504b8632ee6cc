"""A sandbox's devices made with few route-netlink round trips: pyroute2's messages, sent in batches.

pyroute2's ``IPRoute`` runs each request through an event loop of its own
and parses every answer in full: about 0.5-0.8 ms of CPU a request, where
the kernel takes about 0.1 ms for most of them (docs/benchmarks.md). A
policed create made eleven such requests, most of what a policy added to a
create. Here the same messages (pyroute2's classes encode them) go to a
plain netlink socket, several in one write, and only the acknowledgements
are read back (pyroute2's ``nlmsgerr`` decodes them): the kernel handles a
write's messages in order and answers each, so a batch is as ordered as one
request at a time.

A device's index, which its addresses and state name, comes from
``socket.if_nametoindex`` (one ioctl), not a netlink dump.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

from pyroute2.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST, nlmsgerr
from pyroute2.netlink.rtnl import RTM_NEWADDR, RTM_NEWLINK, RTM_NEWROUTE
from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg
from pyroute2.netlink.rtnl.ifinfmsg import IFF_UP, ifinfmsg
from pyroute2.netlink.rtnl.rtmsg import rtmsg

NLMSG_ERROR = 2
NLMSG_HEADER = struct.Struct("=IHHII")
CREATE = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL
CHANGE = NLM_F_REQUEST | NLM_F_ACK
RT_TABLE_MAIN, RTPROT_BOOT, RT_SCOPE_UNIVERSE, RTN_UNICAST = 254, 3, 0, 1


class RtnlError(OSError):
    """The kernel refused a request of a batch: its errno, and which request."""


class Rtnl:
    """A route netlink socket in the network namespace of the thread that makes it."""

    def __init__(self) -> None:
        self.socket = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE)
        self.socket.bind((0, 0))
        self.sequence = 0

    def close(self) -> None:
        self.socket.close()

    def __enter__(self) -> Rtnl:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def run(self, *requests: tuple[str, int, int, Any]) -> None:
        """Send (what, message type, flags, message) requests in one write; wait for every acknowledgement.
        Raises the first refusal, naming its request."""
        sent: dict[int, str] = {}
        data = bytearray()
        for what, kind, flags, message in requests:
            self.sequence += 1
            message["header"]["type"], message["header"]["flags"] = kind, flags
            message["header"]["sequence_number"] = self.sequence
            message.encode()
            data += message.data
            sent[self.sequence] = what
        self.socket.send(bytes(data))
        refused: list[tuple[str, int]] = []
        while sent:
            answer = self.socket.recv(65536)
            offset = 0
            while offset + NLMSG_HEADER.size <= len(answer):
                length, kind = NLMSG_HEADER.unpack_from(answer, offset)[:2]
                if kind == NLMSG_ERROR:  # an acknowledgement: error 0, or the refusal's errno, negated
                    acknowledgement = nlmsgerr(answer[offset : offset + length])
                    acknowledgement.decode()
                    what = sent.pop(acknowledgement["header"]["sequence_number"], "")
                    if what and acknowledgement["error"]:
                        refused.append((what, -acknowledgement["error"]))
                offset += max(length, NLMSG_HEADER.size)
        if refused:
            what, code = refused[0]
            raise RtnlError(code, f"{what}: {os.strerror(code)}")


def veth(name: str, peer: str, peer_netns_fd: int) -> tuple[str, int, int, Any]:
    """A veth pair: ``name`` here, ``peer`` in the network namespace of the fd."""
    message = ifinfmsg()
    peer_message = {"attrs": [["IFLA_IFNAME", peer], ["IFLA_NET_NS_FD", peer_netns_fd]]}
    info = {"attrs": [["IFLA_INFO_KIND", "veth"], ["IFLA_INFO_DATA", {"attrs": [["VETH_INFO_PEER", peer_message]]}]]}
    message["attrs"] = [["IFLA_IFNAME", name], ["IFLA_LINKINFO", info]]
    return (f"veth {name}", RTM_NEWLINK, CREATE, message)


def address(index: int, value: str, prefix_length: int) -> tuple[str, int, int, Any]:
    message = ifaddrmsg()
    message["family"], message["prefixlen"], message["index"] = socket.AF_INET, prefix_length, index
    message["attrs"] = [["IFA_LOCAL", value], ["IFA_ADDRESS", value]]
    return (f"address {value}/{prefix_length}", RTM_NEWADDR, CREATE, message)


def up(index: int) -> tuple[str, int, int, Any]:
    message = ifinfmsg()
    message["index"], message["flags"], message["change"] = index, IFF_UP, IFF_UP
    return (f"up {index}", RTM_NEWLINK, CHANGE, message)


def default_route(gateway: str) -> tuple[str, int, int, Any]:
    message = rtmsg()
    message["family"], message["table"], message["proto"] = socket.AF_INET, RT_TABLE_MAIN, RTPROT_BOOT
    message["scope"], message["type"] = RT_SCOPE_UNIVERSE, RTN_UNICAST
    message["attrs"] = [["RTA_GATEWAY", gateway]]
    return (f"default route via {gateway}", RTM_NEWROUTE, CREATE, message)
