"""Engines of a test's own, apart from the shared one in tests/conftest.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.engine import EngineProcess


@contextmanager
def separate_engine(directory: Path) -> Iterator[EngineProcess]:
    """An engine with the base template, apart from the shared one (a test that
    crashes it, or whose failed creates must not count elsewhere); every trace
    of it is reclaimed after."""
    engine = EngineProcess(directory)
    engine.start()
    with engine.client() as client:
        client.call("templates.build_base", name="base", replace=True)
    try:
        yield engine
    finally:
        engine.reclaim()
        engine.remove_files()


def processes() -> dict[int, tuple[str, int]]:
    """pid -> (command name, parent pid) of every process on the host."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_bytes()
        except OSError:
            continue  # it exited meanwhile
        # The name may hold spaces and parentheses: split around the last ')'.
        name = stat[stat.index(b"(") + 1 : stat.rindex(b")")].decode(errors="replace")
        found[int(entry.name)] = (name, int(stat[stat.rindex(b")") + 2 :].split()[1]))
    return found
