"""The root filesystem of a sandbox, as a plan of steps.

The engine decides *what* a sandbox's root is; the zygote's child
(``native/confine.c``) performs it, inside the sandbox's own mount namespace,
as root of its user namespace, before it becomes PID 1.  :func:`plan` returns
the steps as data, in the order they run, so that the sequence of mounts can
be read and tested without root:

1. Make every mount private, so nothing we mount propagates to the host.
2. Its disk holds the overlay's writable layer: a directory of its own on
   the host's disk filesystem (``disk_dir``: a btrfs subvolume with a quota,
   owned by its root, made by the engine, ``disks.py``), or else a tmpfs
   "scratch" mounted here, sized to the sandbox's disk limit, with a number of
   inodes in proportion, whose writes are charged to its memory cgroup.
   Either vanishes with it.  Keep a handle on the writable layer (init's
   fd 5, for snapshots).
3. Attach the layers: the zygote opened each as a detached mount, idmapped
   from the layers' uid range into the sandbox's own (mounts, not copies;
   no superblock of their own); they are attached on the scratch as
   ``lower/0``, ``lower/1``, ... .  Above them goes ``lower/hosts``, a
   directory of the scratch holding only the sandbox's ``/etc/hosts``
   (:func:`template_hosts`: the template's lines, loopback names where they
   lack them, and the sandbox's hostname).  Mount the overlay: those below
   (short relative names, from inside ``lower``), scratch above.
4. Open the new root.  Every later target is opened *inside* it without
   following symlinks or crossing mounts (a template or snapshot may plant
   ``/proc -> /``), created if absent, and mounted on through
   ``/proc/self/fd``.
5. ``/proc``, a read-only ``/sys``, a minimal ``/dev``: one bind of a
   directory the engine prepared (null, zero, full, random, urandom, tty,
   owned by host root, so the sandbox cannot change it), with devpts and
   mqueue mounted on it, and ``/dev/shm`` a bind of a directory of the
   scratch tmpfs (no superblock of its own: see :func:`prepare_empty`).
6. Mask the ``/proc`` and ``/sys`` entries that reveal or reach the host kernel; make
   ``/proc/sys`` and friends read-only; hide firmware and driver trees under
   an empty read-only directory.
7. ``/tmp`` (1777) and ``/root`` (0700) exist; ``pivot_root`` into the new
   root and detach the host's tree.
"""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Callable, Sequence
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
# Likewise under /sys, world-readable: vmcoreinfo gives the physical address
# of the kernel's crash notes (a step towards defeating address randomization).
MASKED_SYS_FILES = ("kernel/vmcoreinfo",)
# Directories hidden behind an empty read-only directory: (the mount they are on, name).
MASKED_DIRECTORIES = (("proc", "acpi"), ("proc", "scsi"), ("proc", "asound"), ("proc", "driver"), ("sys", "firmware"))
READ_ONLY_PROC = ("sys", "sysrq-trigger", "irq", "bus", "fs")
# Flags the kernel locks on mounts made in a user namespace: a read-only
# remount must repeat them or it is refused.
LOCKED = MS_NOSUID | MS_NODEV | MS_NOEXEC
# Files (inodes) the scratch tmpfs may hold: one per page of its size (a file
# with any content takes a page anyway), and no fewer than MIN_INODES.  Each
# costs the sandbox about a KiB of kernel memory; without a limit of its own
# a tmpfs allows half the host's pages.
INODE_BYTES = 4096
MIN_INODES = 4096


def scratch_inodes(disk_bytes: int) -> int:
    return max(disk_bytes // INODE_BYTES, MIN_INODES)


# A sandbox's /etc/hosts (see template_hosts).  The hostname's line is the
# Debian convention (127.0.1.1: loopback too, and not localhost's address);
# the comment marks it as the engine's, so that a fork of a sandbox that
# changed its hosts file gets its own hostname's line instead of its parent's.
HOSTS_DIRECTORY = "hosts"  # the sandbox's own lower layer, in the scratch's lower/
LOOPBACK_HOSTS = (("127.0.0.1", "127.0.0.1\tlocalhost\n"), ("::1", "::1\tlocalhost ip6-localhost ip6-loopback\n"))
HOSTNAME_LINE = ("127.0.1.1\t", "\t# this sandbox's hostname (forkyard)\n")  # around the hostname
MAX_HOSTS_BYTES = 3072  # what is kept of a template's file (a plan field holds under 4 KiB)
WHITEOUT = (stat.S_IFCHR, 0)  # overlayfs's mark of a deleted entry: a character device 0:0
OPAQUE_XATTR = "user.overlay.opaque"


class TemplateHosts(NamedTuple):
    text: str  # the file, but for the sandbox's hostname line
    etc_mode: int  # of the template's /etc, which the sandbox's own layer's /etc stands in for


def _hosts_text(template: bytes | None) -> str | None:
    """The template's hosts file (None: none, or not one to keep) with the loopback lines it lacks put
    first, an earlier sandbox's hostname line dropped; None when that is too long to keep."""
    lines: list[str] = []
    if template is not None and b"\0" not in template:
        try:
            lines = template.decode().split("\n")
        except UnicodeDecodeError:
            lines = []  # not text: replaced
    if lines and lines[-1] == "":
        lines.pop()
    lines = [line for line in lines if not (line.startswith(HOSTNAME_LINE[0]) and line.endswith(HOSTNAME_LINE[1][:-1]))]

    def maps_localhost(address: str) -> bool:
        for line in lines:
            fields = line.split("#", 1)[0].split()
            if fields and fields[0] == address and "localhost" in fields[1:]:
                return True
        return False

    added = "".join(line for address, line in LOOPBACK_HOSTS if not maps_localhost(address))
    text = added + "".join(line + "\n" for line in lines)
    return text if len(text.encode()) <= MAX_HOSTS_BYTES else None


def _entry(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _is_whiteout(info: os.stat_result) -> bool:
    return (stat.S_IFMT(info.st_mode), info.st_rdev) == WHITEOUT


def _opaque(fd: int) -> bool:
    try:
        return os.getxattr(fd, OPAQUE_XATTR) == b"y"
    except OSError:
        return False


def template_hosts(layers: Sequence[str], root_uid: int) -> TemplateHosts | None:
    """What a sandbox's /etc/hosts holds, read from its template's layers (host paths, topmost first,
    owned by ``root_uid`` for root inside) the way overlayfs merges them.

    The template's own file, if it is a regular file of UTF-8 text, is kept (less an earlier sandbox's
    hostname line: a snapshot's); the ``localhost`` lines it lacks, for 127.0.0.1 and ::1, are added
    first.  A symlink there is not followed (the sandbox's file replaces it), nor is any other entry
    of a layer: each is opened under its parent without following links.  None (the sandbox sees
    the template's /etc/hosts as it is, and no line for its hostname) when /etc is not a directory
    owned by root (a symlink, say: the sandbox's own /etc would hide the template's layout), or
    /etc/hosts is a directory, or the text kept would pass ``MAX_HOSTS_BYTES``.  Raises OSError when
    a layer cannot be read.
    """
    etc_mode: int | None = None
    template: bytes | None = None
    for layer in layers:
        layer_fd = os.open(layer, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            info = _entry(layer_fd, "etc")
            if info is None:
                continue
            if not stat.S_ISDIR(info.st_mode):
                if etc_mode is None and not _is_whiteout(info):
                    return None  # the template's /etc is a symlink or a file
                break  # deleted here, or hidden under the /etc of a layer above
            if etc_mode is None:
                if (info.st_uid, info.st_gid) != (root_uid, root_uid):
                    return None
                etc_mode = stat.S_IMODE(info.st_mode)
            etc_fd = os.open("etc", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=layer_fd)
            try:
                hosts = _entry(etc_fd, "hosts")
                if hosts is not None:
                    if stat.S_ISDIR(hosts.st_mode):
                        return None
                    if stat.S_ISREG(hosts.st_mode) and hosts.st_size <= MAX_HOSTS_BYTES:
                        fd = os.open("hosts", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=etc_fd)
                        try:
                            if not stat.S_ISREG(os.fstat(fd).st_mode):
                                return None
                            template = os.read(fd, MAX_HOSTS_BYTES + 1)
                        finally:
                            os.close(fd)
                    elif stat.S_ISREG(hosts.st_mode):
                        return None  # too long to keep
                    break  # found (a whiteout, a symlink or a FIFO: none to keep)
                if _opaque(etc_fd):
                    break  # the layers below are hidden
            finally:
                os.close(etc_fd)
        finally:
            os.close(layer_fd)
    text = _hosts_text(template)
    return None if text is None else TemplateHosts(text, 0o755 if etc_mode is None else etc_mode)


class RootfsSpec(NamedTuple):
    layers_dir: str  # layer directories are named relative to it
    lower: tuple[str, ...]  # topmost first, as overlayfs wants them (the zygote opens layers_dir/<name>)
    scratch_dir: str  # shared, empty host directory: a mount point only
    root_dir: str  # likewise
    disk_bytes: int
    dev_dir: str  # prepared by prepare_dev()
    empty_dir: str  # prepared by prepare_empty()
    hosts: str = ""  # the sandbox's /etc/hosts but for its hostname's line (template_hosts); "": none
    etc_mode: int = 0o755  # of the /etc that holds it
    # Its disk (disks.py): a host directory of its own (a btrfs subvolume with a quota, owned by its root)
    # that takes the scratch tmpfs's place; "": the tmpfs, sized disk_bytes.
    disk_dir: str = ""
    # The host's one sysfs of a network namespace that is gone (prepare_sys), bound read-only as /sys; "": a
    # sysfs of the sandbox's own.
    sys_dir: str = ""


class Step(NamedTuple):
    """One step of the plan, as native/confine.c runs it.

    ``op`` is one of: ``mount`` (``source``, ``fstype`` (empty for a bind),
    ``flags``, ``data``), ``bind-remount`` (bind ``source``, a host path, or
    else the target itself, onto the target, then remount it with ``flags``:
    read-only, or with the flags the kernel locks),
    ``mkdir``, ``keep-layer`` (init's fd 5), ``attach-layers`` (make the
    target and attach the zygote's idmapped layer mounts on ``<target>/0``,
    ``<target>/1``, ...), ``hosts`` (make the target directory, ``etc`` in it
    of ``mode``, and ``etc/hosts``: ``data``, the sandbox's hostname, then
    ``source``), ``chdir``, ``enter-root`` (relative targets live under it
    from then on), ``pivot``.

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


def prepare_dev(directory: str, host_dev: str = "/dev") -> int:
    """Make the directory every sandbox's /dev is a bind of, in place (engine start, as root).

    Device nodes are made with the host's own numbers; they and the directory
    belong to host root, whom no sandbox maps, so a sandbox can use but never
    change them.

    Every live sandbox's /dev is a bind of *this directory's inode*, with its
    devpts, mqueue and shm mounted on its subdirectories: so the directory is
    never renamed or removed, and an entry that is right is never touched.
    An entry that is wrong (a device with other numbers, mode or owner, a link
    to elsewhere) is replaced atomically: made beside it under a temporary
    name, then renamed over it, so a sandbox sees the old entry or the new
    one, never none.  A subdirectory (pts, shm, mqueue) that exists is kept
    as it is: it is a mount point in every sandbox.  Returns how many entries
    were made or replaced (0 on a restart).
    """
    import shutil
    import stat as stat_module

    if os.path.islink(directory) or (os.path.lexists(directory) and not os.path.isdir(directory)):
        os.unlink(directory)
    os.makedirs(directory, 0o755, exist_ok=True)
    os.chown(directory, 0, 0)
    os.chmod(directory, 0o755)
    shutil.rmtree(directory + ".new", ignore_errors=True)  # an older engine's staging directory
    made = 0

    def current(name: str) -> os.stat_result | None:
        try:
            return os.lstat(os.path.join(directory, name))
        except FileNotFoundError:
            return None

    def replace(name: str, make: Callable[[str], None]) -> None:
        nonlocal made
        temporary = os.path.join(directory, f".{name}.new-{os.getpid()}")
        if os.path.lexists(temporary):
            os.unlink(temporary)
        make(temporary)
        target = os.path.join(directory, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)  # a device name is never a mount point: only pts, shm and mqueue are
        os.rename(temporary, target)
        made += 1

    for device in DEVICES:
        wanted = os.stat(os.path.join(host_dev, device)).st_rdev
        info = current(device)
        if (
            info is not None
            and stat_module.S_ISCHR(info.st_mode)
            and info.st_rdev == wanted
            and stat_module.S_IMODE(info.st_mode) == 0o666
            and (info.st_uid, info.st_gid) == (0, 0)
        ):
            continue

        def make_node(path: str, rdev: int = wanted) -> None:
            os.mknod(path, stat_module.S_IFCHR | 0o666, rdev)
            os.chown(path, 0, 0)
            os.chmod(path, 0o666)  # mknod's mode passes through the umask

        replace(device, make_node)
    for name, target in DEVICE_LINKS.items():
        info = current(name)
        if info is not None and stat_module.S_ISLNK(info.st_mode) and os.readlink(os.path.join(directory, name)) == target:
            continue

        def make_link(path: str, target: str = target) -> None:
            os.symlink(target, path)

        replace(name, make_link)
    for name in DEVICE_DIRECTORIES:
        path = os.path.join(directory, name)
        info = current(name)
        if info is not None and not stat_module.S_ISDIR(info.st_mode):
            os.unlink(path)
            info = None
        if info is None:
            os.mkdir(path, 0o755)
            made += 1
        os.chown(path, 0, 0)
        os.chmod(path, 0o755)
    expected = {*DEVICES, *DEVICE_LINKS, *DEVICE_DIRECTORIES}
    for entry in os.scandir(directory):
        # Anything else would show in every sandbox's /dev: a temporary name a
        # crash left, or a file someone put there.  (A directory might be a
        # mount point in some sandbox: left alone.)
        if entry.name not in expected and not entry.is_dir(follow_symlinks=False):
            os.unlink(entry.path)
    return made


def dev_problems(root: str, host_dev: str = "/dev") -> list[str]:
    """What is wrong with the /dev a sandbox sees (``root`` is its root as the
    host reaches it, ``/proc/<init>/root``); empty when it is whole.

    Every device node must be the host's character device, and devpts,
    mqueue and the shared-memory directory must be mounted on their
    directories (read from ``/proc/<init>/mountinfo``, beside ``root``).
    """
    import stat as stat_module

    problems = []
    for device in DEVICES:
        try:
            info = os.lstat(os.path.join(root, "dev", device))
        except OSError as error:
            problems.append(f"/dev/{device}: {error.strerror}")
            continue
        wanted = os.stat(os.path.join(host_dev, device)).st_rdev
        if not stat_module.S_ISCHR(info.st_mode) or info.st_rdev != wanted:
            problems.append(f"/dev/{device} is not the character device {os.major(wanted)}:{os.minor(wanted)}")
    try:
        with open(os.path.join(os.path.dirname(root), "mountinfo")) as mountinfo:
            mounted = {line.split()[4]: line.split(" - ")[1].split()[0] for line in mountinfo if " - " in line}
    except OSError as error:
        return [*problems, f"mountinfo: {error.strerror}"]
    for name, fstype in (("pts", "devpts"), ("mqueue", "mqueue"), ("shm", "")):
        if f"/dev/{name}" not in mounted:
            problems.append(f"/dev/{name} is not mounted")
        elif fstype and mounted[f"/dev/{name}"] != fstype:
            problems.append(f"/dev/{name} is {mounted[f'/dev/{name}']}, not {fstype}")
    return problems


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


SYS_SOURCE = "forkyard-sys"  # the shared sysfs's name in the mount table


def prepare_sys(directory: str, mountinfo: str = "/proc/self/mountinfo") -> bool:
    """Mount the sysfs that every sandbox's /sys is a bind of, once (engine start, as root); True if
    it was mounted now, False if it was there (a restart); OSError if it cannot be (no ``unshare``,
    say: the engine then gives each sandbox a sysfs of its own, as before).

    A sysfs shows the network devices of the network namespace that mounted it, so each sandbox used
    to mount its own: a superblock per sandbox, which the kernel finds by walking every sysfs
    superblock on the host (``kernfs_test_super``: a quarter of the machine's CPU while a fleet grew
    from 8,192 to 16,384, docs/benchmarks.md), and which costs every memory cgroup a shrinker slot.
    This one is mounted read-only from a network namespace made for it (``unshare --net``), which
    ends with the command, its loopback with it: a sandbox's ``/sys/class/net`` is empty, never the
    host's devices nor its own ``eth0`` (``ip`` and ``/proc/net`` show those: netlink and procfs
    follow the sandbox's namespace); everything else in sysfs is the same whichever namespace
    mounts it.  Binds cost no superblock.
    """
    os.makedirs(directory, 0o755, exist_ok=True)
    target = os.path.realpath(directory)  # as the mount table names it
    try:
        with open(mountinfo) as table:
            lines = table.read().splitlines()
        for line in lines:
            if line.split()[4].replace("\\040", " ") != target:
                continue
            fstype, source = line.split(" - ")[1].split()[:2]
            if fstype == "sysfs" and source == SYS_SOURCE:
                return False
            # Something else on our mount point (another sysfs would show its namespace's devices).
            subprocess.run(["umount", "--lazy", target], check=True, capture_output=True, text=True)
        options = "ro,nosuid,nodev,noexec"
        command = ["unshare", "--net", "--", "mount", "-t", "sysfs", "-o", options, SYS_SOURCE, target]
        subprocess.run(command, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as error:
        raise OSError(f"could not mount the sandboxes' shared sysfs on {target}: {(error.stderr or '').strip()}") from error
    return True


def layer_paths(spec: RootfsSpec) -> tuple[str, ...]:
    """The host paths of the layers, topmost first: what the zygote opens."""
    return tuple(os.path.join(spec.layers_dir, name) for name in spec.lower)


def overlay_options(spec: RootfsSpec, upper: str, work: str) -> str:
    # Lower layers are the mounts attached on lower/0, lower/1, ... (we chdir
    # there first): the options must fit in one page, and short names fit
    # more layers.
    names = ([HOSTS_DIRECTORY] if spec.hosts else []) + [str(index) for index in range(len(spec.lower))]
    return f"lowerdir={':'.join(names)},upperdir={upper},workdir={work},userxattr"


def _mount_on(target: str, source: str, fstype: str, flags: int, data: str = "", within: str = "") -> Step:
    """A mount on a directory of the new root, created if the template lacks it."""
    return Step("mount", target, within, source, fstype, flags, data, mode=0o755, missing="create")


def plan(spec: RootfsSpec) -> tuple[Step, ...]:
    """Every step that builds the sandbox's root, in the order they run."""
    # Its disk: a directory of its own on the host's shared disk filesystem (nothing to mount: one
    # superblock for every sandbox), or a tmpfs of its own mounted on the shared scratch mount point.
    scratch = spec.disk_dir or spec.scratch_dir
    upper = os.path.join(scratch, "upper")
    work = os.path.join(scratch, "work")
    lower = os.path.join(scratch, "lower")
    # /dev/shm lives on its disk beside the writable layer (charged to the
    # sandbox, bounded by its disk, never in a snapshot): a tmpfs of its own
    # was one more superblock, and superblocks cost every memory cgroup a slot.
    shared_memory = os.path.join(scratch, "shm")
    scratch_tmpfs = Step(
        "mount",
        spec.scratch_dir,
        source="forkyard",
        fstype="tmpfs",
        flags=MS_NOSUID | MS_NODEV,
        data=f"size={spec.disk_bytes},nr_inodes={scratch_inodes(spec.disk_bytes)},mode=0755",
    )
    return (
        Step("mount", "/", flags=MS_REC | MS_PRIVATE),
        *([] if spec.disk_dir else [scratch_tmpfs]),
        Step("mkdir", upper, mode=0o755),
        Step("mkdir", work, mode=0o700),
        Step("mkdir", shared_memory, mode=0o1777),
        Step("keep-layer", upper),
        Step("attach-layers", lower),
        # The sandbox's /etc/hosts in a layer of its own above the template's: not in the writable
        # layer, so a snapshot holds it only if the sandbox changed it; no mount, no superblock.
        *(
            [
                Step(
                    "hosts",
                    os.path.join(lower, HOSTS_DIRECTORY),
                    source=HOSTNAME_LINE[1],
                    data=spec.hosts + HOSTNAME_LINE[0],
                    mode=spec.etc_mode,
                )
            ]
            if spec.hosts
            else []
        ),
        Step("chdir", lower),
        Step("mount", spec.root_dir, source="overlay", fstype="overlay", data=overlay_options(spec, upper, work)),
        Step("enter-root", spec.root_dir),
        _mount_on("proc", "proc", "proc", LOCKED),
        (
            Step("bind-remount", "sys", source=spec.sys_dir, flags=MS_REMOUNT | MS_BIND | MS_RDONLY | LOCKED, mode=0o755, missing="create")
            if spec.sys_dir
            else _mount_on("sys", "sysfs", "sysfs", MS_RDONLY | LOCKED)
        ),
        _mount_on("dev", spec.dev_dir, "", MS_BIND),
        _mount_on("pts", "devpts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5", "dev"),
        Step("bind-remount", "shm", "dev", shared_memory, flags=MS_REMOUNT | MS_BIND | LOCKED),
        _mount_on("mqueue", "mqueue", "mqueue", LOCKED, within="dev"),
        *(Step("mount", name, "proc", "/dev/null", flags=MS_BIND, missing="skip") for name in MASKED_PROC_FILES),
        *(Step("mount", name, "sys", "/dev/null", flags=MS_BIND, missing="skip") for name in MASKED_SYS_FILES),
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
