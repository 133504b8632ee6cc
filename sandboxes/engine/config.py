"""Engine configuration: every host path is a setting.

Unit tests point these at a fake tree and run without root; the privileged
tests and production use the real ones.  Each setting can come from an
environment variable ``FORKYARD_ENGINE_<NAME>``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from .sizes import DEFAULT_SIZES, MEBIBYTE, Size

PACKAGE_DIR = Path(__file__).resolve().parent


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
    # Each sandbox has a range of uid_count host uids (and gids) of its own:
    # root inside is uid_base + n * uid_count outside (n >= 1; uid_ranges.py).
    # Range 0, from uid_base, owns the template and snapshot layers on disk.
    uid_base: int = 1_000_000_000
    uid_count: int = 65536
    # How many sandbox ranges (0: as many as fit below 2^32), and how long a
    # range rests, once nothing of its sandbox is left, before it is reused.
    uid_ranges: int = 0
    uid_cooldown_s: int = 60
    init_binary: Path = PACKAGE_DIR / "native" / "build" / "forkyard-init"
    max_sandboxes: int = 40000
    # At start, raise the host's kernel limits that max_sandboxes sandboxes need
    # (preflight.py: never lowering one); 0: only report what to set.
    raise_limits: int = 1
    # At start, set favordynmods on the host's cgroup2 hierarchy (cgroups.favor_moves): a create's move of
    # its init into its cgroups then takes no RCU grace period (6-16 ms here). 0: leave the host as it is.
    favor_cgroup_moves: int = 1
    # The kernel's memory per idle sandbox (KiB) that no memory limit charges,
    # until the engine has measured its own (preflight.OverheadMeter); the
    # control plane's admission counts it (info's sandbox_overhead_kib).
    sandbox_overhead_kib: int = 600
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
    # The data path's gateway (gateway.py): HTTP for exec and files, straight to
    # this host, for callers holding a data token the control plane minted.
    # "host:port" (port 0: a free one, as on one machine); "" for none.
    # ``gateway_url`` is how callers reach it when that is not the address
    # bound (a proxy, a public name); the control plane hands it out.
    gateway: str = "127.0.0.1:0"
    gateway_url: str = ""
    # The daemon's event loop: "uvloop" (libuv), or "asyncio" (the standard library's).
    event_loop: str = "uvloop"
    # The named sizes a create may ask for: the shared catalogue (sizes.py)
    # unless an operator gives this engine its own.
    sizes: dict[str, Size] = field(default_factory=lambda: dict(DEFAULT_SIZES))
    # Sandboxes with a network policy (network.py): each takes a /31 of this
    # pool (its host side and its own address), so a /16 serves 32,768 of them.
    # Pick a range no network of the host's uses; 198.18.0.0/15 is the
    # benchmarking range, used by no real network.  The nftables table (family
    # inet) that holds every sandbox's rules is ``network_table``.
    network_pool: str = "198.19.0.0/16"
    network_table: str = "forkyard"
    # Names the sandboxes' resolvers (resolver.py) answer from before asking the
    # host's resolver: a hosts-format file ("address name..."), read again when
    # it changes; "" for none.  Its addresses are trusted, private ones included.
    network_hosts: str = ""
    # The resolver the sandboxes' resolvers ask for an allowed name the hosts file lacks: the host's own
    # (its /etc/resolv.conf) when "", or this address.
    network_upstream: str = ""
    # Dedicated inference endpoints' model servers (model_servers.py): host processes, outside any
    # sandbox, listening on this address (a private one when web servers run on other machines), run
    # as this user; vLLM's command on GPU hosts ("" : python -m vllm.entrypoints.openai.api_server).
    # Where sandboxes' writable layers live (disks.py): "btrfs", a subvolume each with a quota, on
    # <state>/disks (an operator's own btrfs mounted there, or an image of disk_pool_gib the engine makes:
    # 0, a quarter of the free space, within 4-1024 GiB); "memory", a tmpfs each, counted against the
    # sandbox's memory (the only way on a kernel without btrfs); "auto", btrfs where it can be, else memory.
    disk: str = "auto"
    disk_pool_gib: int = 0
    # The largest disk a create may ask for (disk_mib): quotas are promises, not allocations, so the sum
    # may pass the pool's size; a create is refused while the pool has less than disk_reserve_mib free.
    max_disk_mib: int = 256 * 1024
    disk_reserve_mib: int = 512
    # The largest image archive ``templates.upload`` takes (an OCI or docker/podman save archive, or a
    # root filesystem's tarball), held in <state>/staging while it is unpacked.
    max_image_mib: int = 16 * 1024
    model_server_host: str = "127.0.0.1"
    model_server_user: str = "nobody"
    vllm_command: str = ""

    @property
    def database_path(self) -> Path:
        return self.state_dir / "engine.sqlite3"

    @property
    def layers_dir(self) -> Path:
        return self.state_dir / "layers"

    @property
    def disks_dir(self) -> Path:
        """The btrfs filesystem of sandboxes' disks (disks.py): a subvolume each, named after the sandbox."""
        return self.state_dir / "disks"

    @property
    def disks_image(self) -> Path:
        """The file that filesystem lives in, when the engine made it (no device of an operator's)."""
        return self.state_dir / "disks.img"

    @property
    def mount_dir(self) -> Path:
        """Mount points shared by every sandbox, each in its own mount namespace."""
        return self.state_dir / "mnt"

    @property
    def gateway_secret_path(self) -> Path:
        """The key this host signs and checks data tokens with (data_tokens.py)."""
        return self.state_dir / "gateway.secret"

    @property
    def gateway_revoked_path(self) -> Path:
        """The API keys whose tokens this host refuses (gateway.py), kept across restarts."""
        return self.state_dir / "gateway.revoked.json"

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
                try:
                    values[item.name] = int(raw)
                except ValueError:
                    raise ValueError(f"FORKYARD_ENGINE_{item.name.upper()} is a whole number, not {raw!r}") from None
            else:
                values[item.name] = raw
        values.update(overrides)
        return replace(cls(), **values)  # type: ignore[arg-type]
