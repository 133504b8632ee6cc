"""Builds the engine's one native program, the sandbox init.

It must be static (templates such as ``base`` carry no libc) and small (one
runs per sandbox).  musl-gcc gives ~40 KiB; plain ``gcc -static`` works too.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
BUILD_DIR = SOURCE_DIR / "build"


class BuildError(RuntimeError):
    pass


def compiler() -> list[str]:
    if shutil.which("musl-gcc"):
        return ["musl-gcc", "-static", "-Os"]
    if shutil.which("gcc"):
        return ["gcc", "-static", "-Os"]
    raise BuildError("no C compiler: install Debian's musl-tools (or gcc)")


def build(source: Path, output: Path, force: bool = False) -> Path:
    """Compile ``source`` to a static ``output`` unless it is already current."""
    if not force and output.exists() and output.stat().st_mtime >= source.stat().st_mtime:
        return output
    output.parent.mkdir(parents=True, exist_ok=True)
    temporary = output.with_suffix(".tmp")
    command = compiler() + ["-Wall", "-Wextra", "-o", str(temporary), str(source)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildError(f"{' '.join(command)} failed:\n{result.stderr}")
    subprocess.run(["strip", str(temporary)], check=False, capture_output=True)
    temporary.rename(output)
    return output


def build_init(output: Path | None = None, force: bool = False) -> Path:
    return build(SOURCE_DIR / "init.c", output or BUILD_DIR / "forkyard-init", force)
