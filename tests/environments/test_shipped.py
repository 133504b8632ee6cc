"""The shipped environments (sandboxes/environments/python.json and node.json) built from their specs
as written, through the API: the ``apt`` step included, under the team's ``package-indexes`` policy.

Debian's archive is the part of it these specs install, fetched by ``scripts/bootstrap`` once per machine
(tests/support/debian_archive.py: Debian's own signed index, checked by apt in the build sandbox), served
over HTTP from a network namespace of the test's own (198.18.x.2, port 80) under the name
``deb.debian.org``, which the stack's engine's resolver answers from its hosts file. The base,
``debian``, is the bootstrap's Debian root filesystem. Nothing leaves the machine.

Then a second build of the same spec is a cache hit, every step of it.
"""

from __future__ import annotations

import json
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
