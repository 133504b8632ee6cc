"""Lint, types and migrations are part of the suite, so CI keeps them clean.

Each check runs the project's own tool from this virtualenv, in the repository,
as a developer would; a failure shows the tool's report. None needs root or a
running service.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Everything that ships; the tests themselves are not typed.
TYPED_PACKAGES = ["console", "sandboxes", "billing", "grading", "sdk/forkyard"]


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, timeout=280)


def test_ruff_finds_nothing() -> None:
    completed = run("-m", "ruff", "check", ".")
    assert completed.returncode == 0, completed.stdout + completed.stderr


@pytest.mark.slow  # about 15 s without its cache
def test_mypy_strict_finds_nothing() -> None:
    completed = run("-m", "mypy", *TYPED_PACKAGES)
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_models_need_no_new_migration() -> None:
    completed = run("manage.py", "makemigrations", "--check", "--dry-run")
    assert completed.returncode == 0, "a model changed without its migration:\n" + completed.stdout + completed.stderr
