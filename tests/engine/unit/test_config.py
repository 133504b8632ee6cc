"""The engine's settings from the environment: a value that is not what its setting takes is named, not a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sandboxes.engine.config import EngineConfig

ROOT = Path(__file__).resolve().parents[3]


def test_settings_come_from_their_variables() -> None:
    config = EngineConfig.from_environment({"FORKYARD_ENGINE_MAX_SANDBOXES": "12", "FORKYARD_ENGINE_STATE_DIR": "/srv/fy"})
    assert (config.max_sandboxes, config.state_dir) == (12, Path("/srv/fy"))


def test_a_number_that_is_not_one_names_its_variable() -> None:
    with pytest.raises(ValueError, match="FORKYARD_ENGINE_MAX_SANDBOXES is a whole number, not 'many'"):
        EngineConfig.from_environment({"FORKYARD_ENGINE_MAX_SANDBOXES": "many"})


def test_the_command_line_says_so_and_exits_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sandboxes.engine", "info"],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "FORKYARD_ENGINE_UID_COUNT": "65536x"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    assert "FORKYARD_ENGINE_UID_COUNT is a whole number, not '65536x'" in done.stderr
    assert "Traceback" not in done.stderr
