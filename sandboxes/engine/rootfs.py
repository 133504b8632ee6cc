"""The root filesystem of a sandbox, built inside its own mount namespace.

Runs in the new sandbox process (as root of its user namespace) before it
becomes PID 1.  The steps, in the order :func:`build` performs them:

1. Make every mount private, so nothing we mount propagates to the host.
2. Mount a tmpfs "scratch" sized to the sandbox's disk limit: it holds the
   overlay's writable layer, so writes are charged to the sandbox's memory
   cgroup and vanish with it.
3. Mount the overlay: template (and snapshot) layers below, scratch above.
4. Open each mount target *inside* the new root without following symlinks
   (a template or snapshot may plant ``/proc -> /``), creating it if absent,
   and mount onto the opened directory through ``/proc/self/fd``.
5. ``/proc``, a read-only ``/sys``, a minimal ``/dev``: one bind of a
   directory the engine prepared (null, zero, full, random, urandom, tty,
   owned by host root, so the sandbox cannot change it), with devpts, shm and
   mqueue mounted on it.
6. Mask the ``/proc`` entries that reveal or reach the host kernel; make
   ``/proc/sys`` and friends read-only.
7. ``pivot_root`` into the overlay and detach the host's tree.
"""

from __future__ import annotations

import errno
import os
from typing import NamedTuple

from .kernel import (
    MNT_DETACH,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
    RESOLVE_BENEATH,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_SYMLINKS,
    RESOLVE_NO_XDEV,
    Kernel,
    KernelError,
)

DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
DEVICE_LINKS = {
    "fd": "/proc/self/fd",
    "stdin": "/proc/self/fd/0",
    "stdout": "/proc/self/fd/1",
    "stderr": "/proc/self/fd/2",
    "ptmx": "pts/ptmx",
}
DEVICE_DIRECTORIES = ("pts", "shm", "mqueue")
# Files under /proc that reveal host kernel state to anyone who can read
# them: /dev/null goes over them.  (kcore, kmsg, kallsyms' addresses,
# slabinfo and the like are readable only by host root, whom a sandbox can
# never be; masking them too would cost a mount each for nothing.)
MASKED_PROC_FILES = ("kcore", "keys", "timer_list", "sched_debug", "latency_stats", "timer_stats")
# Directories under /proc and /sys hidden behind an empty read-only tmpfs.
MASKED_DIRECTORIES = ("proc/acpi", "proc/scsi", "proc/asound", "proc/driver", "sys/firmware")
READ_ONLY_PROC = ("sys", "sysrq-trigger", "irq", "bus", "fs")
# Flags the kernel locks on mounts made in a user namespace: a read-only
# remount must repeat them or it is refused.
LOCKED = MS_NOSUID | MS_NODEV | MS_NOEXEC


class RootfsError(KernelError):
    """A step failed, or the root filesystem itself is unusable."""


class RootfsSpec(NamedTuple):
    layers_dir: str  # layer directories are named relative to it
    lower: tuple[str, ...]  # topmost first, as overlayfs wants them
    scratch_dir: str  # shared, empty host directory: a mount point only
    root_dir: str  # likewise
    disk_bytes: int
    dev_dir: str = ""  # prepared by prepare_dev(); empty in tests without root
    shm_bytes: int = 64 * 1024 * 1024


def prepare_dev(directory: str, host_dev: str = "/dev") -> None:
    """Make the directory every sandbox's /dev is a bind of (engine start, as root).

    Device nodes are made with the host's own numbers; they and the directory
    belong to host root, whom no sandbox maps, so a sandbox can use but never
    change them.
    """
    import shutil
    import stat as stat_module

    staging = directory + ".new"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging, 0o755)
    for device in DEVICES:
        info = os.stat(os.path.join(host_dev, device))
        os.mknod(os.path.join(staging, device), stat_module.S_IFCHR | 0o666, info.st_rdev)
        os.chmod(os.path.join(staging, device), 0o666)
    for name, target in DEVICE_LINKS.items():
        os.symlink(target, os.path.join(staging, name))
    for name in DEVICE_DIRECTORIES:
        os.mkdir(os.path.join(staging, name), 0o755)
    os.chmod(staging, 0o755)
    if os.path.isdir(directory) and not os.path.islink(directory):
        # Running sandboxes keep their bind of the old directory; rename it away.
        os.rename(directory, f"{directory}.old-{os.getpid()}")
    os.rename(staging, directory)
    for entry in os.listdir(os.path.dirname(directory)):
        if entry.startswith(os.path.basename(directory) + ".old-"):
            shutil.rmtree(os.path.join(os.path.dirname(directory), entry), ignore_errors=True)


def _inside(kernel: Kernel, root_fd: int, relative: str, mode: int = 0o755) -> int:
    """An O_PATH handle on directory ``relative`` under the new root.

    Created if missing.  No symlink is followed and no mount crossed: the
    root's contents come from templates and snapshots, which a sandbox may
    have written, so a target that is not a plain directory is an error.
    """
    resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
    flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        return kernel.openat2(root_fd, relative, flags, resolve)
    except KernelError as error:
        if error.errno != errno.ENOENT:
            raise RootfsError(
                error.errno or errno.EINVAL, "open mount target (not a plain directory?)", "/" + relative
            ) from error
    parent, _, name = relative.rpartition("/")
    parent_fd = _inside(kernel, root_fd, parent) if parent else os.dup(root_fd)
    try:
        # mkdirat does not follow a final symlink, and the parent is verified.
        os.mkdir(name, mode, dir_fd=parent_fd)
        if mode & 0o7000:  # the umask dropped the sticky bit; nothing runs in the sandbox yet
            os.chmod(name, mode, dir_fd=parent_fd)
    except FileExistsError:
        pass
    except OSError as error:
        raise RootfsError(error.errno or errno.EIO, "create mount target", "/" + relative) from error
    finally:
        os.close(parent_fd)
    return kernel.openat2(root_fd, relative, flags, resolve)


def _mounted(kernel: Kernel, root_fd: int, relative: str) -> int:
    """A real fd on what is now mounted at ``relative``.

    The handle used as a mount target still names the covered directory
    (following /proc/self/fd/N lands exactly there, under the new mount), so
    after mounting we walk to the target again, which crosses into the mount.
    """
    resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
    return kernel.openat2(root_fd, relative, os.O_RDONLY | os.O_DIRECTORY, resolve)


def _fd_path(fd: int, child: str = "") -> str:
    return f"/proc/self/fd/{fd}" + (f"/{child}" if child else "")


def _mount_dev(kernel: Kernel, root_fd: int, spec: RootfsSpec) -> None:
    target = _inside(kernel, root_fd, "dev")
    try:
        if spec.dev_dir:
            kernel.mount(spec.dev_dir, _fd_path(target), None, MS_BIND)
        else:  # no prepared directory (tests without root): an empty tmpfs
            kernel.mount("tmpfs", _fd_path(target), "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k")
    finally:
        os.close(target)
    dev = _mounted(kernel, root_fd, "dev")
    try:
        for directory in DEVICE_DIRECTORIES:
            if not spec.dev_dir:
                os.mkdir(directory, 0o755, dir_fd=dev)
        kernel.mount("devpts", _fd_path(dev, "pts"), "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5")
        kernel.mount("shm", _fd_path(dev, "shm"), "tmpfs", LOCKED, f"mode=1777,size={spec.shm_bytes}")
        kernel.mount("mqueue", _fd_path(dev, "mqueue"), "mqueue", LOCKED)
    finally:
        os.close(dev)


def _mask_proc(kernel: Kernel, root_fd: int) -> None:
    proc = _mounted(kernel, root_fd, "proc")
    try:
        for name in MASKED_PROC_FILES:
            if os.path.lexists(_fd_path(proc, name)):
                kernel.mount("/dev/null", _fd_path(proc, name), None, MS_BIND)
        for name in READ_ONLY_PROC:
            if os.path.lexists(_fd_path(proc, name)):
                target = _fd_path(proc, name)
                kernel.mount(target, target, None, MS_BIND | MS_REC)
                kernel.mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | LOCKED)
    finally:
        os.close(proc)


def _mask_directories(kernel: Kernel, root_fd: int) -> None:
    for relative in MASKED_DIRECTORIES:
        path = _fd_path(root_fd, relative)
        if os.path.isdir(path) and not os.path.islink(path):
            kernel.mount("tmpfs", path, "tmpfs", MS_RDONLY | LOCKED, "size=0,mode=0555")


def overlay_options(spec: RootfsSpec, upper: str, work: str) -> str:
    # Lower layers are named relative to layers_dir (we chdir there first):
    # the options must fit in one page, and short names fit more layers.
    return f"lowerdir={':'.join(spec.lower)},upperdir={upper},workdir={work},userxattr"


def build(kernel: Kernel, spec: RootfsSpec) -> int:
    """Assemble the root and pivot into it; return an O_PATH fd on the upper dir."""
    kernel.mount(None, "/", None, MS_REC | MS_PRIVATE)
    kernel.mount("forkyard", spec.scratch_dir, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec.disk_bytes},mode=0755")
    upper = os.path.join(spec.scratch_dir, "upper")
    work = os.path.join(spec.scratch_dir, "work")
    for directory, mode in ((upper, 0o755), (work, 0o700)):
        try:
            os.mkdir(directory, mode)
        except FileExistsError:
            pass
    upper_fd = os.open(upper, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    os.chdir(spec.layers_dir)
    kernel.mount("overlay", spec.root_dir, "overlay", 0, overlay_options(spec, upper, work))
    root_fd = os.open(spec.root_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for relative, fstype, flags in (("proc", "proc", LOCKED), ("sys", "sysfs", MS_RDONLY | LOCKED)):
            target = _inside(kernel, root_fd, relative)
            try:
                kernel.mount(fstype, _fd_path(target), fstype, flags)
            finally:
                os.close(target)
        _mount_dev(kernel, root_fd, spec)
        _mask_proc(kernel, root_fd)
        _mask_directories(kernel, root_fd)
        for directory, mode in (("tmp", 0o1777), ("root", 0o700)):
            os.close(_inside(kernel, root_fd, directory, mode))
        # pivot_root(".", ".") stacks the old root under the new one; the
        # detach then drops the whole host tree from this namespace.
        os.fchdir(root_fd)
        kernel.pivot_root(".", ".")
        kernel.umount(".", MNT_DETACH)
        os.chdir("/")
    finally:
        os.close(root_fd)
    return upper_fd
