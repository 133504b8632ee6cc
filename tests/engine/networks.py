"""What the network tests share: an engine with a pool, a table and a hosts file of its own, and helpers."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes.engine.client import EngineClient
from tests.engine.engines import separate_engine
from tests.support.engine import EngineProcess
from tests.support.netns import ip


@pytest.fixture
def net_engine(work_dir: Path) -> Iterator[EngineProcess]:
    tag = os.urandom(3).hex()
    table = f"fytest_{tag}"
    pool = f"198.19.{int(tag[:2], 16)}.0/24"
    hosts = work_dir / f"network-{tag}.hosts"  # the names its resolvers answer from (a test writes it)
    env = {
        "FORKYARD_ENGINE_NETWORK_POOL": pool,
        "FORKYARD_ENGINE_NETWORK_TABLE": table,
        "FORKYARD_ENGINE_NETWORK_HOSTS": str(hosts),
    }
    try:
        with separate_engine(work_dir / f"network-{tag}", env=env) as engine:
            yield engine
    finally:
        subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True)


def connect(client: EngineClient, sandbox: str, address: str, port: int, message: str = "hello") -> tuple[int, bytes]:
    result = client.exec(sandbox, f"echo {message} | nc -w 3 {address} {port}", timeout_s=30)
    return result.exit_code, result.stdout


def host_devices(engine: EngineProcess) -> list[str]:
    """Host interfaces holding an address of this engine's pool."""
    pool = ipaddress.ip_network(engine.config.network_pool)
    found = []
    for link in json.loads(ip("-j", "-4", "addr")):
        if any(ipaddress.ip_address(item["local"]) in pool for item in link.get("addr_info", [])):
            found.append(link["ifname"])
    return found


def table_objects(engine: EngineProcess) -> list[str]:
    """The per-sandbox chains, sets, counters and map elements in this engine's table."""
    listing = subprocess.run(["nft", "-j", "list", "table", "inet", engine.config.network_table], capture_output=True, text=True)
    if listing.returncode != 0:
        return []
    objects = []
    for item in json.loads(listing.stdout)["nftables"]:
        for kind in ("chain", "set", "counter", "map"):
            body = item.get(kind)
            if not body:
                continue
            own = body["name"][:2] in ("e-", "h-", "r-", "d-", "n-", "a-", "ap", "g-")
            policy = body["name"][:3] in ("pe-", "ph-", "pr-")  # the chains of a policy's rules
            if kind in ("chain", "set", "counter") and (own or policy):
                objects.append(f"{kind} {body['name']}")
            if kind in ("map", "set") and body["name"] in ("out", "host", "names", "ifaces", "pol_e", "pol_h"):
                objects.extend(f"{body['name']} element" for _ in body.get("elem", []))
    return objects


NAMES = ("svc", "a.wild", "b.c.wild", "wild", "evil-wild", "other")


def name_servers(engine: EngineProcess, address: str) -> None:
    Path(engine.config.network_hosts).write_text(f"{address} " + " ".join(f"{name}.fytest.example" for name in NAMES) + "\n")
