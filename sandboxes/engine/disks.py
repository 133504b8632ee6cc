"""Sandbox disks: each sandbox's writable layer on disk, with a quota of its own, in one shared filesystem.

A sandbox's writable layer (what it writes, its ``/dev/shm``, its
``/etc/hosts`` layer) used to live in a tmpfs of its own, in memory and
counted against its memory limit: a 128 MiB sandbox could not write a
200 MB file.  With a disk it lives in a btrfs subvolume of its own, on one
btrfs filesystem that all of the host's sandboxes share (one superblock for
all of them: every superblock costs every memory cgroup a shrinker slot, so
a filesystem per sandbox would cost memory in proportion to the square of
their number), and the subvolume's quota group bounds it at its disk size.
The memory limit is then memory only: what it writes is page cache, written
back and reclaimed, and charged to it while cached.

What it does, in the order the code runs it:

1. ``setup()`` at engine start: ``<state>/disks`` must be a btrfs mount.
   One that is already there is used as it is (an operator's own device,
   or the image an earlier start mounted). Otherwise the engine makes
   ``<state>/disks.img`` once (``disk_pool_gib`` of space, allocated up
   front so that the host's disk filling up cannot fail the btrfs under
   the sandboxes), formats it (``mkfs.btrfs``, single copies of data and
   metadata), and mounts it through a loop device with direct I/O (no
   second page cache) and ``nosuid,nodev,noatime,nodiscard`` (no discard punches holes in the image). Quotas are turned on:
   simple quotas (kernel 6.7 and later: each extent counted to the
   subvolume that wrote it, no back-reference walks), else the classic
   quota groups. The directory is root's, passable by the layers' group
   (a new sandbox's init, while it builds its root: ``statedir.py``).
2. ``make(id, root_uid, limit)`` for each create: a subvolume named after
   the sandbox, its quota group limited to ``limit`` bytes (what it
   references, data and metadata: a flood of empty files is bounded too),
   owned by the sandbox's root (``0700``): only its init can enter it, to
   make its ``upper``, ``work``, ``shm`` and ``lower`` directories there
   (``rootfs.plan``). A fresh subvolume holds nothing anyone planted.
3. ``usage(volume)``: the bytes its quota group references (sysfs).
4. ``remove(id)`` once its init is gone: the subvolume is deleted at once
   (its space is freed in the background by btrfs's cleaner, and its quota
   group goes with it).
5. ``reclaim(keep)`` at engine start: subvolumes of sandboxes that are gone.

``disk="memory"`` (or ``"auto"`` on a host whose kernel has no btrfs, or
without ``mkfs.btrfs``) keeps the tmpfs of before.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import struct
import subprocess
import uuid
from pathlib import Path
from typing import Any

from .config import EngineConfig
from .errors import EngineError, NoCapacity
from .kernel import MNT_DETACH, Kernel, KernelError, filesystem_type

log = logging.getLogger("forkyard.engine.disks")

BTRFS_SUPER_MAGIC = 0x9123683E
GIB = 1024**3
MEBIBYTE = 1024**2
DIRECTORY_MODE = 0o710  # root; the layers' group may pass (a new sandbox's init); others nothing
VOLUME_MODE = 0o700  # the sandbox's own root


def _ioc(direction: int, number: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (0x94 << 8) | number  # btrfs's ioctls (linux/btrfs.h)


_WRITE, _READ = 1, 2
SUBVOL_CREATE = _ioc(_WRITE, 14, 4096)
SNAP_DESTROY = _ioc(_WRITE, 15, 4096)
INO_LOOKUP = _ioc(_WRITE | _READ, 18, 4096)
FS_INFO = _ioc(_READ, 31, 1024)
QUOTA_CTL = _ioc(_WRITE | _READ, 40, 16)
QGROUP_LIMIT = _ioc(_READ, 43, 48)
QUOTA_ENABLE, QUOTA_ENABLE_SIMPLE = 1, 4
LIMIT_MAX_REFERENCED = 1
FIRST_FREE_OBJECTID = 256  # a subvolume's root directory's inode
LOOP_SET_DIRECT_IO = 0x4C08
# What a quota group charges against its limit (sysfs): the last commit's count, and the reservations since.
USAGE_COUNTERS = ("referenced", "rsv_data", "rsv_meta_pertrans", "rsv_meta_prealloc")


class DiskError(EngineError):
    code = "disk_failed"


def _vol_args(name: str) -> bytearray:
    return bytearray(struct.pack("q4088s", 0, name.encode()))


def _open_directory(path: str | Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def is_btrfs(path: str | Path) -> bool:
    """Whether ``path`` is a directory on a btrfs filesystem."""
    try:
        fd = _open_directory(path)
    except OSError:
        return False
    try:
        return filesystem_type(fd) == BTRFS_SUPER_MAGIC
    except KernelError:
        return False
    finally:
        os.close(fd)


def kernel_has_btrfs() -> bool:
    try:
        return any(line.split()[-1] == "btrfs" for line in Path("/proc/filesystems").read_text().splitlines() if line.split())
    except OSError:
        return False


class Disks:
    """The host's sandbox disks (one per engine): the backend chosen at start, and each sandbox's subvolume."""

    def __init__(self, config: EngineConfig, kernel: Kernel) -> None:
        self.config = config
        self.kernel = kernel
        self.directory = config.disks_dir
        self.backend = "memory"
        self.quota = ""  # "simple" or "qgroup" once set up on btrfs
        self.why_memory = ""  # what kept the btrfs backend off, for info and the preflight report
        self._sysfs = ""

    # --- start ---------------------------------------------------------------------------

    def setup(self) -> None:
        """Choose the backend (``config.disk``) and, for btrfs, make sure the filesystem is mounted and
        quotas are on. ``disk="btrfs"`` fails the start when it cannot be; ``"auto"`` falls back to memory."""
        wanted = self.config.disk
        if wanted not in ("auto", "btrfs", "memory"):
            raise DiskError(f"disk must be auto, btrfs or memory, not {wanted!r}")
        if wanted == "memory":
            self.why_memory = "disk=memory"
            return
        try:
            self._mount()
            self._enable_quota()
            self._sysfs = f"/sys/fs/btrfs/{self._fsid()}"
        except (DiskError, OSError, KernelError) as error:
            if wanted == "btrfs":
                raise DiskError(f"sandbox disks need btrfs at {self.directory}: {error}") from None
            self.why_memory = str(error)
            log.warning("sandbox disks in memory (tmpfs): %s", error)
            return
        os.chown(self.directory, 0, self.config.uid_base)
        os.chmod(self.directory, DIRECTORY_MODE)
        self.backend = "btrfs"

    def _mount(self) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if is_btrfs(self.directory):
            return  # an operator's device, or the image an earlier start mounted
        if not kernel_has_btrfs():
            subprocess.run(["modprobe", "btrfs"], capture_output=True, timeout=30)  # noqa: S603,S607 - a fixed argv
            if not kernel_has_btrfs():
                raise DiskError("this kernel has no btrfs")
        image = self.config.disks_image
        if not image.exists():
            self._make_image(image)
        completed = subprocess.run(  # noqa: S603 - a fixed argv; util-linux's mount sets the loop device up
            # nodiscard (and mkfs's -K): a discard through the loop device punches a hole in the image, giving
            # back to the host the space allocated up front for the sandboxes.
            ["mount", "-t", "btrfs", "-o", "loop,nosuid,nodev,noatime,nodiscard", str(image), str(self.directory)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if completed.returncode != 0:
            raise DiskError(f"mounting {image}: {completed.stderr.strip() or completed.returncode}")
        self._direct_io()

    def _make_image(self, image: Path) -> None:
        mkfs = shutil.which("mkfs.btrfs")
        if mkfs is None:
            raise DiskError("mkfs.btrfs is not installed (Debian: btrfs-progs)")
        size = self._pool_bytes(image.parent)
        partial = image.with_name(f".{image.name}.{uuid.uuid4().hex[:8]}")
        try:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)  # its space held now: a full host disk cannot fail the btrfs later
            finally:
                os.close(fd)
            completed = subprocess.run(  # noqa: S603 - a fixed argv
                [mkfs, "-q", "-f", "-K", "-m", "single", "-d", "single", "-L", "forkyard-disks", str(partial)],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if completed.returncode != 0:
                raise DiskError(f"mkfs.btrfs: {completed.stderr.strip() or completed.returncode}")
            os.rename(partial, image)
        finally:
            partial.unlink(missing_ok=True)

    def _pool_bytes(self, where: Path) -> int:
        if self.config.disk_pool_gib > 0:
            return self.config.disk_pool_gib * GIB
        usage = shutil.disk_usage(where)
        # A quarter of what is free, within bounds: a default that leaves the host room, which an operator
        # sets (disk_pool_gib) or replaces with a device of its own.
        return max(4 * GIB, min(usage.free // 4 // GIB * GIB, 1024 * GIB))

    def _direct_io(self) -> None:
        """The loop device under the mount reads and writes its file directly: one page cache, not two."""
        device = self._device()
        if not device.startswith("/dev/loop"):
            return
        fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, LOOP_SET_DIRECT_IO, 1)
        except OSError as error:  # a backing filesystem without O_DIRECT: buffered, still correct
            log.info("direct I/O on %s refused: %s", device, error)
        finally:
            os.close(fd)

    def _device(self) -> str:
        target = str(self.directory)
        for line in Path(f"{self.config.proc_dir}/self/mountinfo").read_text().splitlines():
            fields = line.split()
            if fields[4] == target and " - " in line:
                return line.split(" - ", 1)[1].split()[1]
        return ""

    def _enable_quota(self) -> None:
        fd = _open_directory(self.directory)
        try:
            for mode, command in (("simple", QUOTA_ENABLE_SIMPLE), ("qgroup", QUOTA_ENABLE)):
                try:
                    fcntl.ioctl(fd, QUOTA_CTL, bytearray(struct.pack("QQ", command, 0)))
                    self.quota = mode
                    return
                except OSError as error:
                    if error.errno == errno.EEXIST:  # on already (an earlier start): whichever mode it is
                        self.quota = "on"
                        return
                    last = error
            raise DiskError(f"turning quotas on failed: {last.strerror}")
        finally:
            os.close(fd)

    def _fsid(self) -> str:
        fd = _open_directory(self.directory)
        try:
            buffer = bytearray(1024)
            fcntl.ioctl(fd, FS_INFO, buffer)
            return str(uuid.UUID(bytes=bytes(buffer[16:32])))
        finally:
            os.close(fd)

    # --- per sandbox ------------------------------------------------------------------

    def path(self, sandbox_id: str) -> Path:
        return self.directory / sandbox_id

    def make(self, sandbox_id: str, root_uid: int, limit_bytes: int) -> int:
        """Its subvolume, limited to ``limit_bytes`` and owned by its root; the subvolume's id."""
        parent = _open_directory(self.directory)
        try:
            try:
                fcntl.ioctl(parent, SUBVOL_CREATE, _vol_args(sandbox_id))
            except FileExistsError:
                self._destroy(parent, sandbox_id)  # a leftover of a create that failed before it was recorded
                fcntl.ioctl(parent, SUBVOL_CREATE, _vol_args(sandbox_id))
            volume = _open_directory(self.path(sandbox_id))
        except OSError as error:
            raise DiskError(f"making the disk of {sandbox_id} failed: {error.strerror}", sandbox=sandbox_id) from None
        finally:
            os.close(parent)
        try:
            lookup = bytearray(struct.pack("QQ4080s", 0, FIRST_FREE_OBJECTID, b""))
            fcntl.ioctl(volume, INO_LOOKUP, lookup)
            volume_id = int(struct.unpack_from("Q", lookup)[0])
            fcntl.ioctl(volume, QGROUP_LIMIT, struct.pack("QQQQQQ", volume_id, LIMIT_MAX_REFERENCED, limit_bytes, 0, 0, 0))
            os.fchown(volume, root_uid, root_uid)
            os.fchmod(volume, VOLUME_MODE)
            return volume_id
        except OSError as error:
            self.remove(sandbox_id)
            raise DiskError(f"limiting the disk of {sandbox_id} failed: {error.strerror}", sandbox=sandbox_id) from None
        finally:
            os.close(volume)

    def check_room(self) -> None:
        """Refuse a create while the pool has less than ``disk_reserve_mib`` free: quotas promise more than
        the pool holds (most sandboxes write little), and a full pool would fail every sandbox's writes."""
        if self.backend != "btrfs":
            return
        free = shutil.disk_usage(self.directory).free
        if free < self.config.disk_reserve_mib * MEBIBYTE:
            raise NoCapacity(
                f"the sandboxes' disk pool has {free // MEBIBYTE} MiB free, under its reserve of {self.config.disk_reserve_mib}",
                retry_after_s=30,
            )

    def usage(self, volume_id: int) -> int:
        """What its subvolume holds (data and metadata), as its quota group counts it against its limit: what
        the last commit counted, and what was written since (reserved until the next); 0 if unknown."""
        total = 0
        for counter in USAGE_COUNTERS:
            try:
                with open(f"{self._sysfs}/qgroups/0_{volume_id}/{counter}") as counted:
                    total += int(counted.read())
            except (OSError, ValueError):
                if counter == "referenced":
                    return 0
        return total

    def remove(self, sandbox_id: str) -> bool:
        """Delete its subvolume (gone: done already). Its space comes back as btrfs's cleaner gets to it."""
        try:
            parent = _open_directory(self.directory)
        except OSError:
            return False
        try:
            return self._destroy(parent, sandbox_id)
        finally:
            os.close(parent)

    @classmethod
    def _destroy(cls, parent: int, name: str) -> bool:
        try:
            fcntl.ioctl(parent, SNAP_DESTROY, _vol_args(name))
            return True
        except FileNotFoundError:
            return False
        except OSError as error:
            if error.errno == errno.ENOTEMPTY and cls._destroy_nested(parent, name):
                return cls._destroy(parent, name)
            raise DiskError(f"deleting the disk {name} failed: {error.strerror}") from None

    @classmethod
    def _destroy_nested(cls, parent: int, name: str) -> bool:
        """Delete the subvolumes inside ``name`` (a sandbox cannot make one: its seccomp filter refuses btrfs's
        ioctls; an engine before that filter let it), which keep a subvolume from being deleted. Whether any
        was found. Walked without following links, each entry opened under its parent."""
        found = False
        try:
            top = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        except OSError:
            return False
        try:
            pending = [top]
            while pending:
                directory = pending.pop()
                for entry in os.scandir(directory):
                    if not entry.is_dir(follow_symlinks=False):
                        continue
                    # A subvolume's root (stat says 256; its entry's d_ino is the subvolume's id).
                    if entry.stat(follow_symlinks=False).st_ino == FIRST_FREE_OBJECTID:
                        cls._destroy(directory, entry.name)
                        found = True
                        continue
                    try:
                        pending.append(
                            os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
                        )
                    except OSError:
                        continue
                if directory != top:
                    os.close(directory)
        finally:
            os.close(top)
        return found

    def names(self) -> set[str]:
        """The subvolumes here (each a sandbox's disk, named after it)."""
        try:
            return {entry.name for entry in os.scandir(self.directory) if entry.is_dir(follow_symlinks=False)}
        except OSError:
            return set()

    def reclaim(self, keep: set[str]) -> int:
        """Delete the disks of sandboxes not in ``keep``; how many."""
        removed = 0
        for name in sorted(self.names() - keep):
            try:
                removed += self.remove(name)
            except DiskError as error:
                log.warning("%s", error)
        return removed

    def detach(self) -> bool:
        """The offline reclaim: unmount the engine's own image (its loop device goes with it)."""
        if not self.config.disks_image.exists() or not self._device():
            return False
        try:
            self.kernel.umount(str(self.directory), MNT_DETACH)
            return True
        except KernelError as error:
            log.warning("could not detach %s: %s", self.directory, error)
            return False

    def info(self) -> dict[str, Any]:
        found: dict[str, Any] = {"backend": self.backend}
        if self.backend == "btrfs":
            usage = shutil.disk_usage(self.directory)
            found.update(quota=self.quota, total_bytes=usage.total, free_bytes=usage.free)
        else:
            found["why"] = self.why_memory
        return found
