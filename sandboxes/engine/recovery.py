"""Reconciling the engine's record with the kernel.

Run at every engine start, and by the tests to clean up after themselves.
Reclaimers run in order and each counts what it cleaned:

1. records   load every record; a corrupted one is quarantined.
2. sandboxes a running or paused sandbox whose init is alive (same pid *and*
             start time), answers on its control socket and is whole (its
             /dev holds the host's device nodes, with devpts, mqueue and
             /dev/shm mounted) is adopted; any other live record (an
             interrupted create or destroy, a dead init, an expired TTL) is
             reaped and tombstoned.  One alive but not whole is *broken*:
             its init is killed and its record kept as ``stopped``, with
             what was wrong as the reason (a pooled one is destroyed), so
             its owner sees it end instead of running without /dev/null.
3. cgroups   a cgroup under our parent that no adopted sandbox owns: its
             processes are killed and it is removed (one that cannot be is
             kept, and named: its sandbox keeps its uid range meanwhile).
4. sockets   control sockets of sandboxes we no longer own are unlinked.
5. mounts    nothing of ours should be mounted on the host (sandbox mounts
             live and die in their own namespaces); anything found under our
             mount directory is detached.  The layers directory's own
             nosuid,nodev mount (statedir.py) is kept, except by the offline
             reclaim (``adopt=False``), which detaches it.
6. networks  the veths, chains, sets, counters and map elements of sandboxes
             with a network policy that are gone (network.py); the offline
             reclaim removes the engine's nftables table too.  Untouched on a
             host where no sandbox ever had a policy.
7. disks     the disks (btrfs subvolumes, disks.py) of sandboxes that are
             not adopted are deleted; the offline reclaim deletes them all
             and unmounts the engine's own disk image.
8. imports   half-written template layers (``.incoming-*``) are removed.
9. history   tombstones older than the retention are purged.

Policy: adopt rather than reap, because a sandbox is somebody's rollout; but
only what we can prove is ours, healthy and whole.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from . import statedir
from .cgroups import CgroupError, Cgroups, split_name
from .config import EngineConfig
from .disks import Disks, is_btrfs
from .errors import EngineError
from .kernel import MNT_DETACH, Kernel, KernelError, process_start_time
from .network import Network
from .rootfs import dev_problems
from .store import LIVE_STATES, SandboxRecord, Store

log = logging.getLogger("forkyard.engine.recovery")


@dataclass
class RecoveryReport:
    adopted: int = 0
    reaped: int = 0
    stopped: int = 0
    broken: int = 0  # alive but not whole (see the module docstring): stopped, not adopted
    processes_killed: int = 0
    cgroups_removed: int = 0
    sockets_removed: int = 0
    mounts_removed: int = 0
    incoming_removed: int = 0
    tombstones_purged: int = 0
    networks_removed: int = 0  # sandboxes whose veth, chains or sets outlived them (engine.py, network.py)
    disks_removed: int = 0  # sandboxes whose disk (a btrfs subvolume) outlived them (disks.py)
    quarantined: int = 0
    seconds: float = 0.0
    adopted_ids: list[str] = field(default_factory=list)
    broken_ids: list[str] = field(default_factory=list)
    cgroups_kept: list[str] = field(default_factory=list)  # could not be removed (a process the engine cannot end)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def init_alive(record: SandboxRecord, proc_dir: str = "/proc") -> bool:
    """Is the process recorded as this sandbox's init still that process?"""
    if record.pid <= 0:
        return False
    try:
        return process_start_time(record.pid, proc_dir) == record.start_time
    except (OSError, ValueError, IndexError):
        return False


def init_answers(socket_path: str, timeout_s: float = 2.0) -> bool:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    connection.settimeout(timeout_s)
    try:
        connection.connect(socket_path)
        connection.send(b"P")
        return connection.recv(16)[:1] == b"P"
    except OSError:
        return False
    finally:
        connection.close()


def kill_init(record: SandboxRecord, kernel: Kernel, proc_dir: str = "/proc") -> bool:
    """SIGKILL the sandbox's init if it is still the recorded process."""
    if record.pid <= 0:
        return False
    try:
        pidfd = kernel.pidfd_open(record.pid)
    except KernelError:
        return False
    try:
        # The pidfd pins the process: if the start time matches now, the
        # signal reaches the right one, even if the pid is reused later.
        if not init_alive(record, proc_dir):
            return False
        kernel.pidfd_send_signal(pidfd, signal.SIGKILL)
        return True
    except KernelError:
        return False
    finally:
        os.close(pidfd)


def _detach_under(prefix: str, kernel: Kernel, proc_dir: str) -> int:
    """Detach every host mount at or under ``prefix``, deepest first; how many were."""
    detached = 0
    for mount_point in _host_mounts_under(prefix, proc_dir):
        try:
            kernel.umount(mount_point, MNT_DETACH)
            detached += 1
        except KernelError as error:
            log.warning("could not detach %s: %s", mount_point, error)
    return detached


def _host_mounts_under(prefix: str, proc_dir: str) -> list[str]:
    found = []
    try:
        with open(f"{proc_dir}/self/mountinfo") as mountinfo:
            for line in mountinfo:
                mount_point = line.split()[4].replace("\\040", " ")
                if mount_point == prefix or mount_point.startswith(prefix + "/"):
                    found.append(mount_point)
    except OSError:
        pass
    return sorted(found, key=len, reverse=True)


def reconcile(
    config: EngineConfig, store: Store, cgroups: Cgroups, kernel: Kernel | None = None, adopt: bool = True
) -> tuple[RecoveryReport, list[SandboxRecord]]:
    """Make the record and the kernel agree; returns the records to track
    (adopted sandboxes, and stopped ones awaiting their destroy)."""
    kernel = kernel or Kernel()
    started = time.monotonic()
    report = RecoveryReport()
    proc_dir = str(config.proc_dir)
    before = len(store.quarantined())
    records = list(store.sandboxes())
    report.quarantined = len(store.quarantined()) - before
    adopted: list[SandboxRecord] = []
    kept: list[SandboxRecord] = []
    now = time.time()
    for record in records:
        if record.state == "stopped":
            kept.append(record)
            continue
        if record.state not in LIVE_STATES:
            continue
        if record.state == "running" and adopt:
            # A running sandbox is never frozen: a crash between a snapshot's
            # freeze and thaw left it so (and its init could not answer).
            try:
                cgroups.freeze(record.cgroup, False)
            except Exception:  # noqa: BLE001 - no cgroup: the checks below decide
                pass
        healthy = (
            adopt
            and record.state in ("running", "paused")
            and record.expires_at > now
            and init_alive(record, proc_dir)
            and (record.state == "paused" or init_answers(record.socket_path))
        )
        problems = dev_problems(f"{proc_dir}/{record.pid}/root") if healthy else []
        if healthy and not problems:
            adopted.append(record)
            report.adopted += 1
            report.adopted_ids.append(record.id)
            continue
        if kill_init(record, kernel, proc_dir):
            report.processes_killed += 1
        if problems:
            log.warning("sandbox %s is alive but not whole: %s", record.id, "; ".join(problems))
            report.broken += 1
            report.broken_ids.append(record.id)
            reason = "not whole when the engine restarted: " + "; ".join(problems)
            record.state, record.reason = ("destroyed" if record.pool else "stopped"), reason[:500]
            if record.state == "stopped":
                kept.append(record)
        elif record.state in ("running", "paused") and not init_alive(record, proc_dir) and record.expires_at > now and adopt:
            record.state, record.reason = "stopped", "init exited while the engine was down"
            report.stopped += 1
            kept.append(record)  # tracked until destroyed or expired, like a live one
        else:
            record.reason = record.reason or f"reaped at recovery (was {record.state})"
            record.state = "destroyed"
            report.reaped += 1
        record.ended_at = record.ended_at or now
        store.put_sandbox(record)

    # By own name: on v1 a sandbox's memory group shows only in the memory hierarchy (cgroups.py).
    owned_cgroups = {split_name(record.cgroup)[1] for record in adopted}
    for name in cgroups.names():
        if split_name(name)[1] in owned_cgroups:
            continue
        try:
            report.processes_killed += cgroups.kill_all(name)
            if cgroups.remove(name):
                report.cgroups_removed += 1
        except CgroupError as error:
            # Left for the engine to try again (it keeps the sandbox's uid
            # range until then: uid_ranges.py); one such cgroup must not stop the start.
            log.warning("could not remove cgroup %s: %s", name, error)
            report.cgroups_kept.append(name)
    for group in cgroups.groups():
        cgroups.remove_empty_group(group)  # a memory group whose sandboxes all went

    owned_sockets = {os.path.basename(record.socket_path) for record in adopted}
    try:
        for entry in os.scandir(config.sandbox_socket_dir):
            if entry.name not in owned_sockets:
                os.unlink(entry.path)
                report.sockets_removed += 1
    except FileNotFoundError:
        pass

    report.mounts_removed += _detach_under(str(config.mount_dir), kernel, proc_dir)
    if not adopt:
        # The offline reclaim: nothing will mount these layers any more.  (At
        # start the layers' own nosuid,nodev mount is made before this runs,
        # and kept: statedir.py.)
        report.mounts_removed += statedir.detach_layers(config, kernel)
        # Nor bind the sandboxes' shared sysfs (rootfs.prepare_sys).
        report.mounts_removed += _detach_under(str(config.state_dir / "sys"), kernel, proc_dir)

    if is_btrfs(config.disks_dir):
        disks = Disks(config, kernel)
        report.disks_removed = disks.reclaim({record.id for record in adopted})
        if not adopt:
            disks.detach()

    try:
        for entry in os.scandir(config.layers_dir):
            if entry.name.startswith(".incoming-"):
                shutil.rmtree(entry.path, ignore_errors=True)
                report.incoming_removed += 1
    except FileNotFoundError:
        pass

    if store.get_meta("networks_used"):  # else no policy was ever applied here: the firewall is left alone
        networks = Network(config.network_pool, config.network_table, kernel)
        try:
            # A stopped one's init (and namespace) is gone: only adopted ones keep theirs.
            report.networks_removed = networks.reclaim(
                {record.id: record.network.get("address", "") for record in adopted if record.network}
            )
            if not adopt:
                networks.remove_table()
        except EngineError as error:
            log.error("reclaiming networks: %s", error)

    report.tombstones_purged = store.purge_tombstones(now - config.tombstone_s)
    report.seconds = round(time.monotonic() - started, 3)
    return report, adopted + kept
