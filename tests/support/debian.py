"""The Debian root filesystems scripts/bootstrap builds once per machine from Debian's mirror, and the
check the tests that import them share: under CI (``FORKYARD_CI``) a missing one fails the run, since
bootstrap made it; elsewhere the test says why and skips."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.support.stack import Stack

DEBIAN = Path(os.environ.get("FORKYARD_DEBIAN_CACHE", "/var/cache/forkyard/debian-bookworm-pip"))
DESKTOP = Path(os.environ.get("FORKYARD_DESKTOP_CACHE", "/var/cache/forkyard/debian-bookworm-desktop"))


def require_root_filesystem(root: Path, program: str) -> None:
    """``root`` must hold ``program`` (a path inside it, such as ``usr/bin/pip3``)."""
    if (root / program).exists():
        return
    message = f"no Debian root filesystem with {program} at {root}: scripts/bootstrap builds it (needs Debian's mirror)"
    if os.environ.get("FORKYARD_CI"):
        pytest.fail(message)
    pytest.skip(message)


def import_public(stack: Stack, name: str, root: Path) -> str:
    """``root`` imported into the stack's engine as the public template ``name`` (replacing one of that
    name), returned once the API lists it on a host (the host agent's next report)."""
    assert stack.engine is not None, "a stack with an engine of its own"
    with stack.engine.client(timeout_s=600) as client:
        client.import_template(name, str(root), "directory", replace=True)
    with stack.client() as api:
        deadline = time.monotonic() + 60
        while not api.get(f"/api/v1/templates/{name}").json().get("hosts"):
            assert time.monotonic() < deadline, f"the host did not report the imported template {name}"
            time.sleep(0.5)
    return name
