"""The shipped environments (sandboxes/environments/python.json, node.json and, marked ``cold``,
desktop.json) built from their specs as written, through the API: the ``apt`` step included, under the
team's ``package-indexes`` policy.

Debian's archive is the part of it these specs install, fetched by ``scripts/bootstrap`` once per machine
(tests/support/debian_archive.py: Debian's own signed index, checked by apt in the build sandbox), served
over HTTP from a network namespace of the test's own (198.18.x.2, port 80) under the name
``deb.debian.org``, which the stack's engine's resolver answers from its hosts file. The base,
``debian``, is the bootstrap's Debian root filesystem. Nothing leaves the machine.

Then a second build of the same spec is a cache hit, every step of it. Last, an ``npm`` step installs
from an npm registry of the test's own (a packument and a tarball written here, served from another
namespace), under a policy that allows it.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.test_template_builds import build
from tests.support.debian import DEBIAN, import_public, require_root_filesystem
from tests.support.debian_archive import ARCHIVE, ENVIRONMENTS
from tests.support.netns import namespace, serve_directory
from tests.support.stack import Stack

pytestmark = [pytest.mark.root, pytest.mark.slow]


@pytest.fixture(scope="module")
def archive(stack: Stack) -> Iterator[str]:
    """Debian's archive (the shipped specs' part of it) at deb.debian.org, as the stack's sandboxes see it."""
    require_root_filesystem(ARCHIVE, "debian/dists/bookworm/InRelease")
    assert stack.engine is not None
    with namespace() as (name, _outside, address, _other), serve_directory(name, address, 80, ARCHIVE):
        hosts = Path(stack.engine.config.network_hosts)
        before = hosts.read_text() if hosts.exists() else ""
        hosts.write_text(f"{before}{address} deb.debian.org\n")
        try:
            yield address
        finally:
            hosts.write_text(before)


@pytest.fixture(scope="module")
def debian(stack: Stack) -> str:
    """The specs' base, ``debian:bookworm``: the public template ``debian``, the bootstrap's Debian."""
    require_root_filesystem(DEBIAN, "usr/bin/apt-get")
    return import_public(stack, "debian", DEBIAN)


def _shipped(name: str) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads((ENVIRONMENTS / f"{name}.json").read_text())
    assert spec["base"] == "debian:bookworm" and spec["steps"][0]["apt"], "a shipped spec starts with its Debian packages"
    return {**spec, "name": f"{name}-{uuid.uuid4().hex[:6]}"}


def _built_and_cached(api: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    """The spec built cold, then again: the second is a cache hit, every step."""
    built = build(api, body, timeout_s=1200)
    assert built["state"] == "ready" and built["cached"] is False, (built.get("error"), built.get("error_output"))
    log = "".join(line["text"] for line in built["lines"] if line["type"] == "log")
    assert "Get:1 http://deb.debian.org/debian bookworm InRelease" in log, log[:2000]
    assert f"Setting up {body['steps'][0]['apt'][0]}" in log, log[-3000:]
    print(f"{body['name']}: " + " ".join(line for line in log.splitlines() if line.startswith("Fetched ")))
    api.delete(f"/api/v1/templates/{body['name']}")
    started = time.monotonic()
    again = build(api, body, timeout_s=120)
    took = time.monotonic() - started
    assert again["state"] == "ready" and again["cached"] is True, again
    assert {step["state"] for step in again["steps"]} == {"cached"}, again["steps"]
    print(f"{body['name']}: cached rebuild {took:.2f} s through the API")
    return built


def _run(api: httpx.Client, template: str, script: str) -> list[str]:
    made = api.post("/api/v1/sandboxes", json={"template": template, "size": "default", "ttl_s": 300})
    assert made.status_code == 201, made.text
    try:
        ran = api.post(f"/api/v1/sandboxes/{made.json()['id']}/exec", json={"cmd": script, "timeout_s": 120}).json()
        assert ran["exit_code"] == 0, ran
        lines: list[str] = ran["stdout"].splitlines()
        return lines
    finally:
        api.delete(f"/api/v1/sandboxes/{made.json()['id']}")


def test_python_is_built_from_its_spec_and_has_its_tools(api: httpx.Client, archive: str, debian: str):
    body = _shipped("python")
    _built_and_cached(api, body)
    lines = _run(
        api,
        body["name"],
        "id -un; pwd; echo $PYTHONUNBUFFERED; python3 -c 'import socket; print(socket.gethostbyname(\"localhost\"))';"
        " python3 -m venv /tmp/venv && /tmp/venv/bin/pip --version | cut -d' ' -f1;"
        " git --version | cut -d' ' -f1-2;"
        # python3-dev's headers and build-essential's compiler: a C extension's build works.
        " printf '#include <Python.h>\\nint main(void) { Py_Initialize(); return Py_FinalizeEx(); }\\n' > /tmp/e.c"
        " && gcc $(python3-config --includes) /tmp/e.c $(python3-config --ldflags --embed) -o /tmp/e && /tmp/e && echo embedded",
    )
    assert lines == ["agent", "/home/agent", "1", "127.0.0.1", "pip", "git version", "embedded"], lines
    api.delete(f"/api/v1/templates/{body['name']}")


def test_node_is_built_from_its_spec_and_has_its_tools(api: httpx.Client, archive: str, debian: str):
    body = _shipped("node")
    _built_and_cached(api, body)
    lines = _run(
        api,
        body["name"],
        "id -un; echo $NPM_CONFIG_FUND; node -e 'console.log(6 * 7)'; npm --version >/dev/null && echo npm;"
        " cd /tmp && npm init -y >/dev/null && node -e 'console.log(require(\"/tmp/package.json\").name)'",
    )
    assert lines == ["agent", "false", "42", "npm", "tmp"], lines
    api.delete(f"/api/v1/templates/{body['name']}")


NPM_PORT = 8091
NPM_VALUE = "came from the test's own registry"


def _npm_package(root: Path, url: str) -> None:
    """fytiny-npm 1.0.0 in a registry laid out for a static server: its packument at /fytiny-npm, its tarball
    under /tarballs (written by hand: no registry software, no download)."""
    files = {
        "package/package.json": json.dumps({"name": "fytiny-npm", "version": "1.0.0", "bin": {"fytiny": "bin.js"}}).encode(),
        "package/bin.js": f"#!/usr/bin/env node\nconsole.log({NPM_VALUE!r});\n".encode(),
    }
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as archive:
        for name, data in files.items():
            member = tarfile.TarInfo(name)
            member.size, member.mode = len(data), 0o755
            archive.addfile(member, io.BytesIO(data))
    tarball = raw.getvalue()
    (root / "tarballs").mkdir(parents=True)
    (root / "tarballs" / "fytiny-npm-1.0.0.tgz").write_bytes(tarball)
    integrity = "sha512-" + base64.b64encode(hashlib.sha512(tarball).digest()).decode()
    version = {
        "name": "fytiny-npm",
        "version": "1.0.0",
        "bin": {"fytiny": "bin.js"},
        "dist": {"tarball": f"{url}tarballs/fytiny-npm-1.0.0.tgz", "shasum": hashlib.sha1(tarball).hexdigest(), "integrity": integrity},
    }
    packument = {"name": "fytiny-npm", "dist-tags": {"latest": "1.0.0"}, "versions": {"1.0.0": version}}
    (root / "fytiny-npm").write_text(json.dumps(packument))


def test_an_npm_step_installs_from_the_registry_its_policy_allows(api: httpx.Client, archive: str, debian: str, tmp_path: Path):
    node = json.loads((ENVIRONMENTS / "node.json").read_text())
    with namespace() as (name, _outside, address, _other):
        url = f"http://{address}:{NPM_PORT}/"
        _npm_package(tmp_path / "registry", url)
        with serve_directory(name, address, NPM_PORT, tmp_path / "registry"):
            egress = [
                {"host": "deb.debian.org", "ports": [80], "protocol": "tcp"},
                {"cidr": f"{address}/32", "ports": [NPM_PORT], "protocol": "tcp"},
            ]
            policy = api.post("/api/v1/network-policies", json={"name": f"npm-{uuid.uuid4().hex[:6]}", "egress": egress})
            assert policy.status_code == 201, policy.text
            body = {
                "name": f"npm-{uuid.uuid4().hex[:6]}",
                "base": "debian:bookworm",
                "size": "default",
                "network_policy": policy.json()["id"],
                # node.json's own packages (its apt step's snapshot, reused when the node build ran first), then npm.
                "steps": [node["steps"][0], {"env": {"NPM_CONFIG_REGISTRY": url}}, {"npm": ["fytiny-npm@1.0.0"]}],
            }
            built = build(api, body, timeout_s=1200)
    assert built["state"] == "ready", (built.get("error"), built.get("error_output"))
    assert [(step["kind"], step["state"]) for step in built["steps"]][-1] == ("npm", "done"), built["steps"]
    # Installed in the template: a sandbox of it, with no network at all, runs it.
    assert _run(api, body["name"], "fytiny; which fytiny") == [NPM_VALUE, "/usr/local/bin/fytiny"]
    assert api.delete(f"/api/v1/templates/{body['name']}").status_code == 200
    api.delete(f"/api/v1/network-policies/{policy.json()['id']}")


@pytest.mark.cold
def test_the_desktop_is_built_from_its_spec_and_answers_a_screenshot(api: httpx.Client, archive: str, debian: str):
    """The desktop's ~500 packages (Chromium, Xvfb, VNC, noVNC) from the archive, as written: a cold build
    of minutes, so not in the default run (``scripts/test -m cold``); the desktop tests build the same
    spec's later steps on the bootstrap's Debian with those packages (tests/browser/test_desktop.py)."""
    body = _shipped("desktop")
    _built_and_cached(api, body)
    made = api.post("/api/v1/sandboxes", json={"template": body["name"], "size": "default", "ttl_s": 300, "wait": True})
    assert made.status_code in (200, 201) and made.json()["state"] == "running", made.text
    try:
        shot = api.post(f"/api/v1/sandboxes/{made.json()['id']}/desktop/screenshot", json={"scale": 0.5})
        assert shot.status_code == 200, shot.text
        assert (shot.json()["width"], shot.json()["height"], shot.json()["screen"]) == (640, 400, {"width": 1280, "height": 800})
        ran = api.post(
            f"/api/v1/sandboxes/{made.json()['id']}/exec",
            json={"cmd": "chromium --version | cut -d' ' -f1; xdotool version | cut -d' ' -f1", "timeout_s": 60},
        ).json()
        assert ran["exit_code"] == 0 and ran["stdout"].splitlines() == ["Chromium", "xdotool"], ran
    finally:
        api.delete(f"/api/v1/sandboxes/{made.json()['id']}")
    api.delete(f"/api/v1/templates/{body['name']}")
