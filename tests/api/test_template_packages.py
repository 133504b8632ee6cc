"""A template build that installs Python packages, under a policy that reaches the package index only.

The index is the test's own (tests/engine/test_pip.py's: a wheel it writes, served from the test's
network namespace, 198.18.x.2), and the base is the Debian root filesystem with pip that
``scripts/bootstrap`` builds once per machine, imported into the stack's engine as a public template.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.api.test_template_builds import build
from tests.engine.test_pip import INDEX_PORT, VALUE, index
from tests.support.debian import DEBIAN, import_public, require_root_filesystem
from tests.support.netns import Server, allow, server
from tests.support.stack import Stack

pytestmark = [pytest.mark.root, pytest.mark.slow]
__all__ = ["index", "server"]  # fixtures


@pytest.fixture(scope="module")
def debian(stack: Stack) -> str:
    """The Debian template with pip, on the stack's host and in the API."""
    require_root_filesystem(DEBIAN, "usr/bin/pip3")
    return import_public(stack, "debian-pip", DEBIAN)


def test_a_pip_step_installs_from_the_index_its_policy_allows(api: httpx.Client, debian: str, server: Server, index: str):
    policy = api.post("/api/v1/network-policies", json={"name": f"index-{uuid.uuid4().hex[:6]}", **allow(server, INDEX_PORT)})
    assert policy.status_code == 201, policy.text
    name = f"py-{uuid.uuid4().hex[:6]}"
    body = {
        "name": name,
        "base": debian,
        "size": "default",
        "network_policy": policy.json()["id"],
        "steps": [
            {"pip": ["fytiny==1.0"], "index_url": index, "timeout_s": 300},
            {"run": "python3 -c 'import fytiny; print(fytiny.VALUE)' > /etc/fytiny-value"},
        ],
    }
    built = build(api, body, timeout_s=600)
    assert built["state"] == "ready", built
    text = "".join(line["text"] for line in built["lines"] if line["type"] == "log")
    assert "Successfully installed fytiny-1.0" in text, text[-3000:]
    sandbox = api.post("/api/v1/sandboxes", json={"template": name, "size": "tiny", "ttl_s": 120}).json()
    try:
        # Installed in the template: the sandbox has it with no network at all.
        ran = api.post(
            f"/api/v1/sandboxes/{sandbox['id']}/exec",
            json={"cmd": "cat /etc/fytiny-value; python3 -c 'import fytiny; print(fytiny.VALUE)'"},
        ).json()
        assert ran["stdout"] == f"{VALUE}\n{VALUE}\n", ran
        assert sandbox["network_policy"] is None
    finally:
        api.delete(f"/api/v1/sandboxes/{sandbox['id']}")

    missing = build(api, {**body, "name": f"{name}-missing", "steps": [{"pip": ["fymissing"], "index_url": index}]})
    assert missing["state"] == "failed" and missing["error"]["code"] == "step_failed", missing
    assert "fymissing" in missing["error_output"], missing["error_output"][-2000:]
    for template in (name, f"{name}-missing"):
        assert api.delete(f"/api/v1/templates/{template}").status_code == 200
    api.delete(f"/api/v1/network-policies/{policy.json()['id']}")
