"""Fixtures of the engine's tests that more than one module uses."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sandboxes.engine import errors
from sandboxes.engine.client import EngineClient


@pytest.fixture
def made(engine: EngineClient) -> Iterator[list[str]]:
    """Sandboxes, snapshots and templates a test makes (by name), removed after it."""
    names: list[str] = []
    yield names
    for name in reversed(names):
        try:
            if name.startswith("sb-"):
                engine.destroy(name)
            else:
                engine.call("templates.delete", name=name)
        except errors.EngineError:
            pass
