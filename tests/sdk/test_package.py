"""The SDK is a package of its own: it must import, CLI and demo included, without Django."""

from __future__ import annotations

import os
import subprocess
import sys


def test_the_sdk_imports_without_django() -> None:
    probe = "import sys, forkyard, forkyard.cli, forkyard.demo; assert not [m for m in sys.modules if m.startswith('django')], 'django'"
    completed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                               env={key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"})
    assert completed.returncode == 0, completed.stderr
