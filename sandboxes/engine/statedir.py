"""The engine's state directory on the host: private to root, its layers inert.

A layer holds what sandbox code wrote (a snapshot) or what an image carried
(a template): setuid binaries owned by a sandbox's host uid, world-writable
files, anything.  Host users must neither reach those files nor gain by
running them, and the record (which holds every sandbox's env) is root's
alone.  At every start, in this order (each step idempotent):

1. ``<state>`` is owned by root, group ``uid_base`` (the layers' uid
   range), mode 0710: host users cannot enter it at all; the only other
   group that may pass through (never list) is the one a new sandbox's init
   holds as a supplementary group while it builds its root (it binds
   ``<state>/dev`` and mounts on ``<state>/mnt`` before ``pivot_root``, then
   drops the group; once pivoted, no sandbox process can name a host path
   again).  ``<state>/layers`` is root's alone (0700): the zygote, as root,
   opens the layers for every sandbox (idmapped mounts), and no sandbox
   process ever needs its path.  Every ancestor of the state directory must
   let that group pass (checked: a 0700 parent, say from a umask of 077,
   would fail every create with EACCES).
2. The record (``engine.sqlite3`` and its ``-wal``/``-shm``, and databases
   set aside as corrupt) is 0600 (``store.py`` creates it so).
3. ``<state>/layers`` is a bind mount of itself with ``nosuid,nodev``: were a
   layer reached anyway (by root, or through a future mistake in step 1), a
   setuid file in it gains nothing and a device node opens nothing.  The
   sandboxes' overlays see the same modes (overlay shows a lower file's mode
   as it is): the setuid bits are kept, as the sandbox made them; inside,
   ``no_new_privs`` makes them inert too.  (Stripping them from the host's
   copy would change what every fork sees, and a layer's content address.)

``reconcile(..., adopt=False)`` (the offline reclaim: nothing will run on
these layers any more) detaches the mount; the next start makes it again.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .config import EngineConfig
from .errors import Unavailable
from .kernel import (
    MNT_DETACH,
    MS_BIND,
    MS_NOATIME,
    MS_NODEV,
    MS_NODIRATIME,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REMOUNT,
    MS_STRICTATIME,
    Kernel,
    KernelError,
)

PRIVATE_DIRECTORY = 0o710  # root: everything; the layers' group (a new sandbox's init): pass through; others: nothing
ROOT_ONLY_DIRECTORY = 0o700
PRIVATE_FILE = 0o600
INERT = ("nosuid", "nodev")
# Per-mount options a remount keeps (a bind remount sets every per-mount flag
# at once): an operator's own mount of the layers keeps what it had.
KEPT_OPTIONS = {"ro": MS_RDONLY, "noexec": MS_NOEXEC, "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME}


def prepare(config: EngineConfig, kernel: Kernel) -> bool:
    """Steps 1 and 3 (``store.py`` does 2); True if the layers mount was (re)made."""
    for directory, group, mode in (
        (config.state_dir, config.uid_base, PRIVATE_DIRECTORY),
        (config.layers_dir, 0, ROOT_ONLY_DIRECTORY),
    ):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chown(directory, 0, group)
        os.chmod(directory, mode)
    check_reachable(config)
    for leftover in config.state_dir.glob(config.database_path.name + "*"):
        os.chmod(leftover, PRIVATE_FILE)
    return mount_layers(config, kernel)


def check_reachable(config: EngineConfig) -> None:
    """Every ancestor of the state directory lets the group ``uid_base`` pass: a
    new sandbox's init, holding it, builds its root from there."""
    for ancestor in config.state_dir.resolve().parents:
        info = ancestor.stat()
        passes = info.st_mode & stat.S_IXOTH or (info.st_gid == config.uid_base and info.st_mode & stat.S_IXGRP)
        if not passes:
            raise Unavailable(
                f"sandboxes could not reach the state directory {config.state_dir}: {ancestor} is mode"
                f" {stat.S_IMODE(info.st_mode):04o}; let others pass through it (chmod o+x {ancestor})",
                path=str(ancestor),
            )


def layers_mount_options(config: EngineConfig, proc_dir: Path | None = None) -> set[str] | None:
    """The per-mount options of the topmost mount on the layers directory, or
    None if it is not a mount point of its own."""
    target = str(config.layers_dir.resolve())
    found = None
    with open((proc_dir or config.proc_dir) / "self" / "mountinfo") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            if fields[4].replace("\\040", " ") == target:
                found = set(fields[5].split(","))  # the last one listed is on top
    return found


def mount_layers(config: EngineConfig, kernel: Kernel) -> bool:
    """Step 3: bind the layers directory onto itself, nosuid and nodev."""
    target = str(config.layers_dir.resolve())
    options = layers_mount_options(config)
    if options is not None and set(INERT) <= options:
        return False
    if options is None:
        kernel.mount(target, target, None, MS_BIND)
        # Ours alone: nothing need propagate to other mount namespaces.
        kernel.mount("none", target, None, MS_PRIVATE)
    kept = 0
    for option in options or ():
        kept |= KEPT_OPTIONS.get(option, 0)
    if options is not None and "strictatime" in options:
        kept |= MS_STRICTATIME
    kernel.mount("none", target, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | kept)
    return True


def detach_layers(config: EngineConfig, kernel: Kernel) -> int:
    """Undo step 3 (the offline reclaim); how many mounts were detached."""
    detached = 0
    while layers_mount_options(config) is not None:
        try:
            kernel.umount(str(config.layers_dir.resolve()), MNT_DETACH)
        except KernelError:
            break
        detached += 1
    return detached
