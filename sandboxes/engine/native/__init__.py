"""Builds the engine's one native program: the zygote, and the sandbox init it becomes.

``zygote.c`` clones every sandbox, ``confine.c`` is the clone's own setup,
``init.c`` the PID 1 and exec agent the clone then becomes (``message.c``:
what both read from their sockets), all in one binary
so that no exec is needed between them.  It must be static (templates such as
``base`` carry no libc, and the clone keeps running our code inside them) and
small (every sandbox's init is a copy of it).  musl-gcc gives ~50 KiB; plain
``gcc -static`` works too.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
BUILD_DIR = SOURCE_DIR / "build"
SOURCES = ("zygote.c", "confine.c", "init.c", "files.c", "message.c")
HEADERS = ("forkyard.h",)


class BuildError(RuntimeError):
    pass


def compiler() -> list[str]:
    if shutil.which("musl-gcc"):
        return ["musl-gcc", "-static", "-Os"]
    if shutil.which("gcc"):
        return ["gcc", "-static", "-Os"]
    raise BuildError("no C compiler: install Debian's musl-tools (or gcc)")


def build(sources: list[Path], output: Path, force: bool = False, depends: list[Path] | None = None) -> Path:
    """Compile ``sources`` to a static ``output`` unless it is newer than all of them."""
    inputs = sources + (depends or [])
    if not force and output.exists() and output.stat().st_mtime >= max(path.stat().st_mtime for path in inputs):
        return output
    output.parent.mkdir(parents=True, exist_ok=True)
    temporary = output.with_suffix(".tmp")
    command = compiler() + ["-Wall", "-Wextra", "-o", str(temporary), *map(str, sources)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildError(f"{' '.join(command)} failed:\n{result.stderr}")
    subprocess.run(["strip", str(temporary)], check=False, capture_output=True)
    temporary.rename(output)
    return output


def build_init(output: Path | None = None, force: bool = False) -> Path:
    return build(
        [SOURCE_DIR / name for name in SOURCES],
        output or BUILD_DIR / "forkyard-init",
        force,
        depends=[SOURCE_DIR / name for name in HEADERS],
    )
