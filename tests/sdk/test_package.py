"""The SDK is a package of its own: it must import, CLI and demo included, without Django."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import forkyard


def test_the_sdk_imports_without_django() -> None:
    probe = "import sys, forkyard, forkyard.cli, forkyard.demo; assert not [m for m in sys.modules if m.startswith('django')], 'django'"
    completed = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        env={key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"},
    )
    assert completed.returncode == 0, completed.stderr


def test_the_sdk_wheel_installs_alone_and_carries_nothing_of_the_server(tmp_path) -> None:
    """The project's own wheel of the SDK (what scripts/sdk-wheel builds), installed into a virtualenv of
    its own: it asks for httpx alone, imports and runs its CLI with only httpx beside it, is typed,
    and holds no module of the server.  Nothing is fetched: httpx comes from this virtualenv."""
    root = Path(__file__).resolve().parents[2]
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(tmp_path),
            str(root / "sdk"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("forkyard-*-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "forkyard/py.typed" in names and "forkyard/cli.py" in names
    assert not [name for name in names if name.split("/")[0] in {"console", "sandboxes", "billing"}], names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert installed.returncode == 0, installed.stderr
    # httpx and what it imports, from this virtualenv: the top-level packages it loads, and nothing else.
    probe = (
        "import httpx, sys, json; print(json.dumps(sorted({getattr(m, '__file__', None) or '' for m in sys.modules.values()})))"
    )
    files = json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout)
    site = Path(importlib.util.find_spec("httpx").origin).parents[1]  # type: ignore[arg-type,union-attr]
    beside = tmp_path / "httpx-only"
    beside.mkdir()
    for top in {Path(file).relative_to(site).parts[0] for file in files if file.startswith(str(site) + "/")}:
        (beside / top).symlink_to(site / top)
    (next((venv / "lib").glob("python3*/site-packages")) / "httpx-only.pth").write_text(str(beside) + "\n")

    check = (
        "import importlib.metadata as m, importlib.util as u, sys, forkyard, forkyard.cli, forkyard.aio;"
        "needs = m.requires('forkyard');"
        # httpx alone; websockets only with the 'forward' extra (forkyard ports forward), openai only with the
        # 'openai' extra (fy.inference).
        "assert [r for r in needs if 'extra ==' not in r] == ['httpx>=0.27'], needs;"
        "assert sorted(r for r in needs if 'extra ==' in r) =="
        " ['openai>=1.60; extra == \"openai\"', 'websockets>=13; extra == \"forward\"'], needs;"
        "assert m.version('forkyard') == forkyard.__version__;"
        "assert all(u.find_spec(name) is None for name in ('django', 'celery', 'console', 'sandboxes', 'billing'));"
        "print(forkyard.__file__)"
    )
    ran = subprocess.run(
        [str(python), "-c", check], capture_output=True, text=True, timeout=60, cwd=tmp_path, env={"PATH": os.environ["PATH"]}
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip().startswith(str(venv)), ran.stdout  # the wheel's copy, not the checkout's
    cli = subprocess.run(
        [str(venv / "bin" / "forkyard"), "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"]},
    )
    assert cli.returncode == 0 and cli.stdout.strip().endswith(forkyard.__version__), cli.stdout + cli.stderr
