"""Every sandbox's /etc/hosts and /etc/resolv.conf, in real sandboxes.

/etc/hosts: the template's lines (the loopback ones added where it lacks them) and the sandbox's
hostname, its id, at 127.0.1.1; written into a layer of the sandbox's own, never through what a
template put at the name. /etc/resolv.conf: the import replaces a template's (debootstrap copies the
build host's), so a sandbox without a policy names no resolver; one under a policy names its own
(tests/engine/test_network.py). Lookups here go to loopback only.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import time
from pathlib import Path

import pytest

from sandboxes.engine import errors
from sandboxes.engine.client import EngineClient
from tests.engine.networks import net_engine  # noqa: F401 - a fixture
from tests.support.debian import DEBIAN, require_root_filesystem
from tests.support.engine import EngineProcess

pytestmark = pytest.mark.root

LOOPBACK = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]


def _own_line(sandbox: str) -> str:
    return f"127.0.1.1\t{sandbox}\t# this sandbox's hostname (forkyard)"


def _run(engine: EngineClient, sandbox: str, command: str) -> str:
    result = engine.exec(sandbox, command, timeout_s=60)
    assert result.exit_code == 0, (command, result)
    return result.stdout.decode()


def _nameservers(engine: EngineClient, sandbox: str) -> list[str]:
    try:
        text = engine.read_file(sandbox, "/etc/resolv.conf").decode()
    except errors.FileNotFound:
        return []
    return [line for line in text.splitlines() if line.split()[:1] == ["nameserver"]]


def _create(engine: EngineClient, made: list[str], template: str) -> str:
    sandbox = engine.create(template=template, size="tiny", ttl_s=600)["id"]
    made.append(sandbox)
    return sandbox


def _busybox_tree(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    shutil.copy2("/bin/busybox", root / "bin" / "busybox")
    for applet in ("sh", "cat", "hostname", "ipcalc"):
        (root / "bin" / applet).symlink_to("busybox")
    (root / "etc").mkdir()
    return root


def test_a_base_sandbox_resolves_localhost_and_its_own_hostname(engine: EngineClient, sandbox: str) -> None:
    assert engine.read_file(sandbox, "/etc/hosts").decode().splitlines() == [*LOOPBACK, _own_line(sandbox)]
    assert _run(engine, sandbox, "hostname").strip() == sandbox
    # Name lookups through the C library (busybox is glibc's, static): forward for its hostname,
    # backward for localhost.
    assert _run(engine, sandbox, "hostname -i").split() == ["127.0.1.1"]
    assert _run(engine, sandbox, "ipcalc -h 127.0.0.1").strip() == "HOSTNAME=localhost"
    # The file is its own to change: a layer of its own below its writable one.
    _run(engine, sandbox, "echo '10.1.2.3 db.internal' >> /etc/hosts && sed -i s/db.internal/db.example/ /etc/hosts")
    assert engine.read_file(sandbox, "/etc/hosts").decode().splitlines()[-1] == "10.1.2.3 db.example"
    # No nameserver: nothing is reachable but loopback.
    assert _nameservers(engine, sandbox) == []


def test_each_sandbox_sees_its_own_hostname(engine: EngineClient, made: list[str]) -> None:
    first, second = _create(engine, made, "base"), _create(engine, made, "base")
    assert _own_line(first) in engine.read_file(first, "/etc/hosts").decode().splitlines()
    assert _own_line(second) in engine.read_file(second, "/etc/hosts").decode().splitlines()
    assert first not in engine.read_file(second, "/etc/hosts").decode()


def test_a_templates_hosts_file_is_kept_and_a_planted_symlink_replaced(
    engine: EngineClient, made: list[str], tmp_path: Path
) -> None:
    kept = _busybox_tree(tmp_path / "kept")
    (kept / "etc" / "hosts").write_text("127.0.0.1 localhost\n10.1.2.3 db.internal # the template's\n")
    engine.import_template("hosts-kept", str(kept))
    made.append("hosts-kept")
    sandbox = _create(engine, made, "hosts-kept")
    # Its lines kept, the ::1 line it lacked added before them, the hostname's after them.
    assert engine.read_file(sandbox, "/etc/hosts").decode().splitlines() == [
        LOOPBACK[1],
        "127.0.0.1 localhost",
        "10.1.2.3 db.internal # the template's",
        _own_line(sandbox),
    ]

    # A template whose /etc/hosts links to another of its files (which a write through the link
    # would change): the sandbox's file replaces the link, and the other file is untouched.
    planted = _busybox_tree(tmp_path / "planted")
    (planted / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (planted / "etc" / "hosts").symlink_to("/etc/passwd")
    engine.import_template("hosts-planted", str(planted))
    made.append("hosts-planted")
    sandbox = _create(engine, made, "hosts-planted")
    assert _run(engine, sandbox, "test -L /etc/hosts || echo regular").strip() == "regular"
    assert engine.read_file(sandbox, "/etc/hosts").decode().splitlines() == [*LOOPBACK, _own_line(sandbox)]
    assert engine.read_file(sandbox, "/etc/passwd") == b"root:x:0:0:root:/root:/bin/sh\n"
    assert _run(engine, sandbox, "hostname -i").split() == ["127.0.1.1"]


def test_a_fork_keeps_its_parents_changes_to_the_file_but_names_itself(engine: EngineClient, made: list[str]) -> None:
    parent = _create(engine, made, "base")
    _run(engine, parent, "echo '10.1.2.3 db.internal' >> /etc/hosts")
    name = f"hosts-{os.urandom(4).hex()}"
    engine.call("snapshots.create", sandbox=parent, name=name)
    made.append(name)
    fork = _create(engine, made, name)
    assert engine.read_file(fork, "/etc/hosts").decode().splitlines() == [*LOOPBACK, "10.1.2.3 db.internal", _own_line(fork)]
    assert _run(engine, fork, "hostname -i").split() == ["127.0.1.1"]


def test_an_imported_resolv_conf_is_replaced_never_written_through(engine: EngineClient, made: list[str], tmp_path: Path) -> None:
    copied = _busybox_tree(tmp_path / "copied")
    (copied / "etc" / "resolv.conf").write_text("nameserver 10.255.255.53\nsearch build.example\n")
    engine.import_template("resolv-copied", str(copied))
    made.append("resolv-copied")
    linked = _busybox_tree(tmp_path / "linked")
    (linked / "etc" / "upstream.conf").write_text("nameserver 10.255.255.53\n")
    (linked / "etc" / "resolv.conf").symlink_to("upstream.conf")
    engine.import_template("resolv-linked", str(linked))
    made.append("resolv-linked")
    for template in ("resolv-copied", "resolv-linked"):
        sandbox = _create(engine, made, template)
        assert _nameservers(engine, sandbox) == [], template
        assert "10.255.255.53" not in engine.read_file(sandbox, "/etc/resolv.conf").decode(), template
        assert _run(engine, sandbox, "test -L /etc/resolv.conf || echo regular").strip() == "regular"
    # The link was removed, not followed: the file it named is as the template had it.
    assert engine.read_file(sandbox, "/etc/upstream.conf") == b"nameserver 10.255.255.53\n"
    assert (linked / "etc" / "upstream.conf").read_text() == "nameserver 10.255.255.53\n"


@pytest.mark.slow
def test_a_debian_sandbox_resolves_localhost_and_names_no_resolver_of_the_build_host(
    net_engine: EngineProcess,  # noqa: F811 - the fixture
) -> None:
    require_root_filesystem(DEBIAN, "usr/bin/python3")
    with net_engine.client(timeout_s=300) as client:
        # debootstrap copied its host's resolv.conf into the tree (a cache built before the import
        # replaced it still holds it): the import replaces it.
        client.import_template("debian-names", str(DEBIAN), "directory")
        sandbox = client.create(template="debian-names", size="tiny", ttl_s=600)["id"]
        # (getent's ahosts ask with AI_ADDRCONFIG, which a sandbox with loopback only never satisfies.)
        assert _run(client, sandbox, "getent hosts localhost").split() == ["::1", "localhost", "ip6-localhost", "ip6-loopback"]
        assert _run(client, sandbox, "getent hosts 127.0.0.1").split() == ["127.0.0.1", "localhost"]
        assert _run(client, sandbox, "getent hosts $(hostname)").split() == ["127.0.1.1", sandbox]
        lookup = "import socket; print(socket.gethostbyname('localhost'), socket.gethostbyname(socket.gethostname()))"
        assert _run(client, sandbox, f'python3 -c "{lookup}"').split() == ["127.0.0.1", "127.0.1.1"]
        assert _nameservers(client, sandbox) == []
        # A name no file holds: asked of loopback, where nothing answers, so it fails at once.
        started = time.monotonic()
        failed = client.exec(sandbox, "getent hosts pypi.org", timeout_s=60)
        assert failed.exit_code == 2 and time.monotonic() - started < 5, failed
        client.destroy(sandbox)

        # Under a policy: its own resolver (the host side of its link), in place of the template's file.
        policy = {"egress": [{"cidr": "198.18.255.2/32", "ports": [8080]}]}  # reached by nothing here
        policed = client.create(template="debian-names", size="tiny", ttl_s=600, network=policy)["id"]
        host_side = str(ipaddress.ip_address(client.get(policed)["network"]["address"]) - 1)
        assert _nameservers(client, policed) == [f"nameserver {host_side}"]
        assert _run(client, policed, "getent hosts $(hostname)").split() == ["127.0.1.1", policed]
        client.destroy(policed)
