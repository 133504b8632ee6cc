"""The Debian root filesystems scripts/bootstrap builds once per machine from Debian's mirror, and the
check the tests that import them share: under CI (``FORKYARD_CI``) a missing one fails the run, since
bootstrap made it; elsewhere the test says why and skips."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
