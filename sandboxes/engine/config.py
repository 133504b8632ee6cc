"""Engine configuration: every host path is a setting.

Unit tests point these at a fake tree and run without root; the privileged
tests and production use the real ones.  Each setting can come from an
environment variable ``FORKYARD_ENGINE_<NAME>``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
MEBIBYTE = 1024 * 1024


@dataclass(frozen=True)
class Size:
    """What a sandbox may use.  Sizes are data: operators can add their own."""

    cpu: float
    memory_mib: int
    pids: int = 1024
    # The writable layer is memory-backed (see ARCHITECTURE.md); by default it
    # may grow as large as the memory limit, which bounds it anyway.
    disk_mib: int = 0

    @property
    def disk_bytes(self) -> int:
        return (self.disk_mib or self.memory_mib) * MEBIBYTE


DEFAULT_SIZES: dict[str, Size] = {
    "tiny": Size(cpu=1, memory_mib=128, pids=256),
    "default": Size(cpu=2, memory_mib=4096, pids=4096),
}


@dataclass(frozen=True)
class EngineConfig:
    state_dir: Path = Path("/var/lib/forkyard")
    run_dir: Path = Path("/run/forkyard")
    proc_dir: Path = Path("/proc")
    cgroup_root: Path = Path("/sys/fs/cgroup")
    # Where sandbox cgroups go.  A relative name is a child of the engine's
    # own cgroup (in each hierarchy), so the engine never reaches outside
    # what it was given; an absolute path is taken as is.
    cgroup_parent: str = "forkyard"
    # Root inside every sandbox is this unprivileged uid (and gid) outside.
    uid_base: int = 1_000_000_000
    uid_count: int = 65536
    init_binary: Path = PACKAGE_DIR / "native" / "build" / "forkyard-init"
    max_sandboxes: int = 40000
    default_ttl_s: int = 3600
    max_ttl_s: int = 7 * 24 * 3600
    max_output_bytes: int = 1 * MEBIBYTE
    max_output_limit: int = 64 * MEBIBYTE
    max_file_bytes: int = 1024 * MEBIBYTE
    # Keep the records of destroyed sandboxes this long, so that a repeated
    # destroy or a replayed create gets a precise answer.
    tombstone_s: int = 24 * 3600
    # Sandboxes kept ready so that a create is a claim: "template:size=count,...".
    warm_pools: str = "base:tiny=8"
    # Also listen on TCP ("host:port"), for a control plane on other machines;
    # every connection must first present ``token``.  Unencrypted: bind it to
    # a private network (or a WireGuard interface).  Empty: the Unix socket only.
    listen: str = ""
    token: str = ""
    sizes: dict[str, Size] = field(default_factory=lambda: dict(DEFAULT_SIZES))

    @property
    def database_path(self) -> Path:
        return self.state_dir / "engine.sqlite3"

    @property
    def layers_dir(self) -> Path:
        return self.state_dir / "layers"

    @property
    def mount_dir(self) -> Path:
        """Mount points shared by every sandbox, each in its own mount namespace."""
        return self.state_dir / "mnt"

    @property
    def socket_path(self) -> Path:
        return self.run_dir / "engine.sock"

    @property
    def spawner_socket_path(self) -> Path:
        return self.run_dir / "spawner.sock"

    @property
    def sandbox_socket_dir(self) -> Path:
        return self.run_dir / "sandboxes"

    def sandbox_socket(self, sandbox_id: str) -> Path:
        return self.sandbox_socket_dir / f"{sandbox_id}.sock"

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None, **overrides: object) -> EngineConfig:
        environ = dict(os.environ if environ is None else environ)
        values: dict[str, object] = {}
        for item in fields(cls):
            raw = environ.get(f"FORKYARD_ENGINE_{item.name.upper()}")
            if raw is None or item.name == "sizes":
                continue
            default = getattr(cls, item.name, None)
            if isinstance(default, Path):
                values[item.name] = Path(raw)
            elif isinstance(default, int):
                values[item.name] = int(raw)
            else:
                values[item.name] = raw
        values.update(overrides)
        return replace(cls(), **values)  # type: ignore[arg-type]
