"""Reconciling the engine's record with the kernel.

Run at every engine start, and by the tests to clean up after themselves.
Reclaimers run in order and each counts what it cleaned:

1. records   load every record; a corrupted one is quarantined.
2. sandboxes a running or paused sandbox whose init is alive (same pid *and*
             start time) and answers on its control socket is adopted; any
             other live record (an interrupted create or destroy, a dead
             init, an expired TTL) is reaped and tombstoned.
3. cgroups   a cgroup under our parent that no adopted sandbox owns: its
             processes are killed and it is removed.
4. sockets   control sockets of sandboxes we no longer own are unlinked.
5. mounts    nothing of ours should be mounted on the host (sandbox mounts
             live and die in their own namespaces); anything found under our
             mount directory is detached.
6. imports   half-written template layers (``.incoming-*``) are removed.
7. history   tombstones older than the retention are purged.

Policy: adopt rather than reap, because a sandbox is somebody's rollout; but
only what we can prove is ours and healthy.
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

from .cgroups import Cgroups
from .config import EngineConfig
from .kernel import MNT_DETACH, Kernel, KernelError, process_start_time
from .store import LIVE_STATES, SandboxRecord, Store

log = logging.getLogger("forkyard.engine.recovery")


@dataclass
class RecoveryReport:
    adopted: int = 0
    reaped: int = 0
    stopped: int = 0
    processes_killed: int = 0
    cgroups_removed: int = 0
    sockets_removed: int = 0
    mounts_removed: int = 0
    incoming_removed: int = 0
    tombstones_purged: int = 0
    quarantined: int = 0
    seconds: float = 0.0
    adopted_ids: list[str] = field(default_factory=list)

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
        if healthy:
            adopted.append(record)
            report.adopted += 1
            report.adopted_ids.append(record.id)
            continue
        if kill_init(record, kernel, proc_dir):
            report.processes_killed += 1
        if record.state in ("running", "paused") and not init_alive(record, proc_dir) and record.expires_at > now and adopt:
            record.state, record.reason = "stopped", "init exited while the engine was down"
            report.stopped += 1
            kept.append(record)  # tracked until destroyed or expired, like a live one
        else:
            record.reason = record.reason or f"reaped at recovery (was {record.state})"
            record.state = "destroyed"
            report.reaped += 1
        record.ended_at = record.ended_at or now
        store.put_sandbox(record)

    owned_cgroups = {record.cgroup for record in adopted}
    for name in cgroups.names():
        if name in owned_cgroups:
            continue
        report.processes_killed += cgroups.kill_all(name)
        if cgroups.remove(name):
            report.cgroups_removed += 1

    owned_sockets = {os.path.basename(record.socket_path) for record in adopted}
    try:
        for entry in os.scandir(config.sandbox_socket_dir):
            if entry.name not in owned_sockets:
                os.unlink(entry.path)
                report.sockets_removed += 1
    except FileNotFoundError:
        pass

    for mount_point in _host_mounts_under(str(config.mount_dir), proc_dir):
        try:
            kernel.umount(mount_point, MNT_DETACH)
            report.mounts_removed += 1
        except KernelError as error:
            log.warning("could not detach %s: %s", mount_point, error)

    try:
        for entry in os.scandir(config.layers_dir):
            if entry.name.startswith(".incoming-"):
                shutil.rmtree(entry.path, ignore_errors=True)
                report.incoming_removed += 1
    except FileNotFoundError:
        pass

    report.tombstones_purged = store.purge_tombstones(now - config.tombstone_s)
    report.seconds = round(time.monotonic() - started, 3)
    return report, adopted + kept
