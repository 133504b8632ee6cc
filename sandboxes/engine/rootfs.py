"""The root filesystem of a sandbox, as a plan of steps.

The engine decides *what* a sandbox's root is; the zygote's child
(``native/confine.c``) performs it, inside the sandbox's own mount namespace,
as root of its user namespace, before it becomes PID 1.  :func:`plan` returns
the steps as data, in the order they run, so that the sequence of mounts can
be read and tested without root:

1. Make every mount private, so nothing we mount propagates to the host.
2. Mount a tmpfs "scratch" sized to the sandbox's disk limit: it holds the
   overlay's writable layer, so writes are charged to the sandbox's memory
   cgroup and vanish with it.  Keep a handle on the writable layer (init's
   fd 5, for snapshots).
3. Mount the overlay: template (and snapshot) layers below, named relative to
   the layers directory we enter first; scratch above.
4. Open the new root.  Every later target is opened *inside* it without
   following symlinks or crossing mounts (a template or snapshot may plant
   ``/proc -> /``), created if absent, and mounted on through
   ``/proc/self/fd``.
5. ``/proc``, a read-only ``/sys``, a minimal ``/dev``: one bind of a
   directory the engine prepared (null, zero, full, random, urandom, tty,
   owned by host root, so the sandbox cannot change it), with devpts and
   mqueue mounted on it, and ``/dev/shm`` a bind of a directory of the
   scratch tmpfs (no superblock of its own: see :func:`prepare_empty`).
6. Mask the ``/proc`` entries that reveal or reach the host kernel; make
   ``/proc/sys`` and friends read-only; hide firmware and driver trees under
   an empty read-only directory.
7. ``/tmp`` (1777) and ``/root`` (0700) exist; ``pivot_root`` into the new
   root and detach the host's tree.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from .kernel import (
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
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
# Directories hidden behind an empty read-only directory: (the mount they are on, name).
MASKED_DIRECTORIES = (("proc", "acpi"), ("proc", "scsi"), ("proc", "asound"), ("proc", "driver"), ("sys", "firmware"))
READ_ONLY_PROC = ("sys", "sysrq-trigger", "irq", "bus", "fs")
# Flags the kernel locks on mounts made in a user namespace: a read-only
# remount must repeat them or it is refused.
LOCKED = MS_NOSUID | MS_NODEV | MS_NOEXEC


class RootfsSpec(NamedTuple):
    layers_dir: str  # layer directories are named relative to it
    lower: tuple[str, ...]  # topmost first, as overlayfs wants them
    scratch_dir: str  # shared, empty host directory: a mount point only
    root_dir: str  # likewise
    disk_bytes: int
    dev_dir: str  # prepared by prepare_dev()
    empty_dir: str  # prepared by prepare_empty()


class Step(NamedTuple):
    """One step of the plan, as native/confine.c runs it.

    ``op`` is one of: ``mount`` (``source``, ``fstype`` (empty for a bind),
    ``flags``, ``data``), ``bind-remount`` (bind ``source``, a host path, or
    else the target itself, onto the target, then remount it with ``flags``:
    read-only, or with the flags the kernel locks),
    ``mkdir``, ``keep-layer`` (init's fd 5),
    ``chdir``, ``enter-root`` (relative targets live under it from then on),
    ``pivot``.

    An absolute ``target`` is a host path; a relative one is a path in the new
    root, on the mount named by ``within`` ("" for the root itself).  A
    relative target that is absent fails the create, is skipped, or is
    created as a directory of ``mode``, as ``missing`` says.
    """

    op: str
    target: str = ""
    within: str = ""
    source: str = ""
    fstype: str = ""
    flags: int = 0
    data: str = ""
    mode: int = 0
    missing: str = "fail"


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


def prepare_empty(directory: str) -> None:
    """Make the empty directory bound (read-only) over what a sandbox must not see.

    A bind of one host directory costs no superblock, where an empty tmpfs
    per mask cost one each: every superblock registers a shrinker, and every
    memory cgroup (one per sandbox) allocates a slot for every shrinker on
    the host, so superblocks per sandbox cost memory in proportion to the
    number of sandboxes.  Owned by host root, whom no sandbox maps.
    """
    os.makedirs(directory, 0o555, exist_ok=True)
    os.chmod(directory, 0o555)
    if os.listdir(directory):
        raise OSError(f"{directory} must be empty: it is bound over hidden directories in every sandbox")


def overlay_options(spec: RootfsSpec, upper: str, work: str) -> str:
    # Lower layers are named relative to layers_dir (we chdir there first):
    # the options must fit in one page, and short names fit more layers.
    return f"lowerdir={':'.join(spec.lower)},upperdir={upper},workdir={work},userxattr"


def _mount_on(target: str, source: str, fstype: str, flags: int, data: str = "", within: str = "") -> Step:
    """A mount on a directory of the new root, created if the template lacks it."""
    return Step("mount", target, within, source, fstype, flags, data, mode=0o755, missing="create")


def plan(spec: RootfsSpec) -> tuple[Step, ...]:
    """Every step that builds the sandbox's root, in the order they run."""
    upper = os.path.join(spec.scratch_dir, "upper")
    work = os.path.join(spec.scratch_dir, "work")
    # /dev/shm lives on the scratch tmpfs beside the writable layer (charged to
    # the sandbox, bounded by its disk, never in a snapshot): a tmpfs of its own
    # was one more superblock, and superblocks cost every memory cgroup a slot.
    shared_memory = os.path.join(spec.scratch_dir, "shm")
    return (
        Step("mount", "/", flags=MS_REC | MS_PRIVATE),
        Step(
            "mount",
            spec.scratch_dir,
            source="forkyard",
            fstype="tmpfs",
            flags=MS_NOSUID | MS_NODEV,
            data=f"size={spec.disk_bytes},mode=0755",
        ),
        Step("mkdir", upper, mode=0o755),
        Step("mkdir", work, mode=0o700),
        Step("mkdir", shared_memory, mode=0o1777),
        Step("keep-layer", upper),
        Step("chdir", spec.layers_dir),
        Step("mount", spec.root_dir, source="overlay", fstype="overlay", data=overlay_options(spec, upper, work)),
        Step("enter-root", spec.root_dir),
        _mount_on("proc", "proc", "proc", LOCKED),
        _mount_on("sys", "sysfs", "sysfs", MS_RDONLY | LOCKED),
        _mount_on("dev", spec.dev_dir, "", MS_BIND),
        _mount_on("pts", "devpts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5", "dev"),
        Step("bind-remount", "shm", "dev", shared_memory, flags=MS_REMOUNT | MS_BIND | LOCKED),
        _mount_on("mqueue", "mqueue", "mqueue", LOCKED, within="dev"),
        *(Step("mount", name, "proc", "/dev/null", flags=MS_BIND, missing="skip") for name in MASKED_PROC_FILES),
        *(
            Step("bind-remount", name, "proc", flags=MS_REMOUNT | MS_BIND | MS_RDONLY | LOCKED, missing="skip")
            for name in READ_ONLY_PROC
        ),
        *(
            Step("bind-remount", name, within, spec.empty_dir, flags=MS_REMOUNT | MS_BIND | MS_RDONLY | LOCKED, missing="skip")
            for within, name in MASKED_DIRECTORIES
        ),
        Step("mkdir", "tmp", mode=0o1777),
        Step("mkdir", "root", mode=0o700),
        Step("pivot"),
    )
