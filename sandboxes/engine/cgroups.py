"""Cgroup v1 and v2 behind one small interface.

A sandbox gets one cgroup (``fy-<id>``) under the engine's parent, with CPU,
memory and pid limits; it is also how the engine freezes a sandbox, counts its
OOM kills and finds stray processes during recovery.

Each exec's command runs in a cgroup of its own below it (``fy-<id>/x-<n>``,
in the pids hierarchy on v1; no controllers of its own, so every limit and
count stays the sandbox's): nothing in a sandbox can leave its cgroup, so
that cgroup is every process the command started, even one that left its
session with ``setsid`` and was reparented to init.  Ending a command whose
caller went away kills that cgroup; one that ends normally leaves it to what
it started (a service), and it is removed once empty.

* v2 (most hosts): one hierarchy; limits in ``cpu.max``, ``memory.max``,
  ``pids.max``; ``cgroup.freeze`` and ``cgroup.kill`` are built in.
* v1 / hybrid (this project's development machines): one hierarchy per
  controller (cpu, cpuacct, memory, pids, freezer); a sandbox has a directory
  in each and its pid is written to each ``cgroup.procs``.

The engine only ever touches cgroups under its own parent, with one
exception: at start it sets ``favordynmods`` on the host's cgroup2 hierarchy
(:func:`favor_moves`), without which every create's move of its init into
its cgroups waited for an RCU grace period.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from . import kernel
from .config import EngineConfig
from .errors import EngineError

CPU_PERIOD_US = 100_000
PREFIX = "fy-"
GROUP_PREFIX = "mg-"  # a memory group: sandboxes of one launch sharing one memory cgroup (see ``Cgroups``)
GROUP_CPU_MAX = 4096  # the most cores a group's CPU quota may hold: more than any host has, so no limit at all


def split_name(name: str) -> tuple[str, str]:
    """A sandbox's cgroup name as (its memory group, "" for none; its own name): ``mg-<g>/fy-<id>`` or ``fy-<id>``."""
    group, _, own = name.rpartition("/")
    return group, own


class CgroupError(EngineError):
    code = "cgroup_error"


@dataclass(frozen=True)
class Limits:
    cpu: float
    memory_bytes: int
    pids: int


@dataclass(frozen=True)
class Stats:
    memory_bytes: int
    cpu_usage_us: int
    oom_kills: int
    pids: int
    # The most memory it has held (v2 ``memory.peak``, Linux 5.19 or later; v1
    # ``memory.max_usage_in_bytes``); 0 where the kernel keeps none.
    memory_peak_bytes: int = 0


FAVOR_MOVES = "favordynmods"
# A mount's own options (mountinfo's sixth field), as the flags a remount must pass again to keep them.
_MOUNT_FLAGS = {
    "ro": kernel.MS_RDONLY,
    "nosuid": kernel.MS_NOSUID,
    "nodev": kernel.MS_NODEV,
    "noexec": kernel.MS_NOEXEC,
    "noatime": kernel.MS_NOATIME,
    "nodiratime": kernel.MS_NODIRATIME,
    "relatime": kernel.MS_RELATIME,
    "strictatime": kernel.MS_STRICTATIME,
}


@dataclass(frozen=True)
class Remount:
    """The remount that sets ``favordynmods`` on a cgroup2 mount and keeps everything else it has."""

    target: str
    flags: int
    data: str


def favor_moves_plan(mountinfo: str) -> Remount | str:
    """The remount :func:`favor_moves` makes, from ``/proc/self/mountinfo``; or why none is needed or
    possible ("already", "no cgroup2 mount").

    A cgroup2 remount resets every option of the hierarchy it does not name
    (``nsdelegate``, ``memory_recursiveprot``, as systemd sets them), and a
    remount's flags replace the mount's own (``nosuid``...): both are passed
    again, as they are."""
    for line in mountinfo.splitlines():
        mount, separator, filesystem = line.partition(" - ")
        fields, described = mount.split(), filesystem.split()
        if not separator or len(fields) < 6 or len(described) < 3 or described[0] != "cgroup2":
            continue
        options = [option for option in described[2].split(",") if option not in ("rw", "ro")]
        if FAVOR_MOVES in options:
            return "already"
        flags = kernel.MS_REMOUNT
        for option in fields[5].split(","):
            flags |= _MOUNT_FLAGS.get(option, 0)
        target = fields[4].replace("\\040", " ")  # mountinfo writes a space as \040 (as recovery.py reads it)
        return Remount(target=target, flags=flags, data=",".join([*options, FAVOR_MOVES]))
    return "no cgroup2 mount"


def favor_moves(system: kernel.Kernel, proc_dir: Path) -> str:
    """Make moving a process into a cgroup cheap, for every hierarchy: ``favordynmods`` (Linux 6.0) on the
    host's cgroup2 hierarchy. What it did: "set", "already", or why not.

    Every create writes its init's pid into its cgroups (and a command with a
    cgroup of its own writes itself into it). Each such move takes the
    kernel's cgroup_threadgroup_rwsem for writing, which by default waits for
    an RCU grace period unless another move came just before: 6-16 ms here,
    most of a create's time (docs/benchmarks.md). The option, on the one v2
    hierarchy, makes that lock cheap to take for writing (v1 hierarchies
    too: the lock is the kernel's, not a hierarchy's), at a small cost to
    every fork and exit. It is the host's setting: it stays after the engine."""
    try:
        plan = favor_moves_plan((proc_dir / "self" / "mountinfo").read_text())
    except OSError as error:
        return f"mountinfo unreadable: {error.strerror}"
    if isinstance(plan, str):
        return plan
    try:
        system.mount("none", plan.target, None, plan.flags, plan.data)
    except kernel.KernelError as error:
        return f"remount of {plan.target} refused ({os.strerror(error.errno or 0)}; a kernel before 6.0 has no {FAVOR_MOVES})"
    return "set"


def _write(path: Path, value: str) -> None:
    # One open, one write: a text-mode open() would also stat, seek and ask
    # whether a cgroup file is a terminal, several times per create.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)  # as open(path, "w")
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)
    except OSError as error:
        raise CgroupError(f"cannot write {value!r} to {path}: {error.strerror}", path=str(path), step="write") from error


def _read(path: Path | str) -> str:
    # Raw system calls: open() with its buffered text layers cost more than
    # the kernel's read, and the engine reads a cgroup file or two per exec.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode()


def _read_or_empty(path: Path) -> str:
    try:
        return _read(path)
    except FileNotFoundError:
        return ""


def _read_int(path: Path, default: int = 0) -> int:
    try:
        return int(_read(path).split()[0])
    except (OSError, ValueError, IndexError):
        return default


def _keyed(path: Path) -> dict[str, int]:
    """Parse 'key value' lines (memory.events, cpu.stat, memory.oom_control)."""
    result: dict[str, int] = {}
    try:
        for line in _read(path).splitlines():
            key, _, value = line.partition(" ")
            if value.strip().lstrip("-").isdigit():
                result[key] = int(value)
    except OSError:
        pass
    return result


def _own_cgroups(proc_dir: Path) -> dict[str, str]:
    """Map each controller (and '' for v2) to our own cgroup path."""
    own: dict[str, str] = {}
    for line in _read(proc_dir / "self" / "cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            own[""] = path
        for controller in controllers.split(","):
            own[controller] = path
    return own


def _children(path: Path) -> list[Path]:
    try:
        return [Path(entry.path) for entry in os.scandir(path) if entry.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _remove_directory(path: Path, timeout_s: float = 2.0) -> bool:
    """rmdir a cgroup and the ones below it (exec cgroups); the kernel answers
    EBUSY until its last task is gone. The directory is only listed (every
    control file with it) when the kernel refuses it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return False
        except OSError as error:
            if error.errno != errno.EBUSY or time.monotonic() > deadline:
                raise CgroupError(f"cannot remove cgroup {path}: {error.strerror}", path=str(path), step="rmdir") from error
            children = _children(path)
            for child in children:
                _remove_directory(child, timeout_s)
            if not children:
                time.sleep(0.005)


def _set_cfs_quota(directory: Path, cpu: float) -> None:
    """v1's CPU quota of ``cpu`` cores. Each write of the period or the quota walks every CPU cgroup on
    the host (the kernel checks the hierarchy still fits), so each is written only where it is not
    that already (the period is 100 ms on a new cgroup; a group's quota is there after its first member)."""
    if _read_int(directory / "cpu.cfs_period_us") != CPU_PERIOD_US:
        _write(directory / "cpu.cfs_period_us", str(CPU_PERIOD_US))
    quota = int(cpu * CPU_PERIOD_US)
    if _read_int(directory / "cpu.cfs_quota_us") != quota:
        _write(directory / "cpu.cfs_quota_us", str(quota))


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Cgroups(ABC):
    """A sandbox's cgroup, named ``fy-<id>``; or ``mg-<group>/fy-<id>`` for one in a memory group.

    A memory group is the opt-in answer to the memory cgroup's cost at scale
    (every memory cgroup holds a slot for every superblock on the host, so a
    cgroup per sandbox makes kernel memory grow with the square of their
    number; memory cgroup ids also run out at 65,535): the group's sandboxes
    share one memory cgroup, with the group's limit, and each keeps its own CPU
    and pid limits, freezer and exec cgroups below it. The trade: inside the
    group one sandbox's memory can crowd out another's (and the OOM killer
    picks within the group); the group cannot pass its own limit, nor touch
    another group's. On v2 the group is the sandbox cgroup's parent, with the
    memory controller on and not handed down; on v1 it is a directory of the
    memory hierarchy that its sandboxes' processes join, and one of the CPU
    hierarchy that their own CPU cgroups sit below; their other controllers'
    directories are their own.

    A group may also carry the CPU quota (``group_cpu``: the control plane
    asks for its members' cores summed), its members then none of their own:
    every write of a CPU quota makes the kernel walk every CPU cgroup on the
    host, so a quota each made each create slower by the number already
    there. The trade: inside the group a busy sandbox may use what idle
    mates leave (equal shares when all are busy); the group cannot pass its
    quota."""

    version: int

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def setup(self) -> None:
        """Create the parent and make the controllers available under it."""

    @abstractmethod
    def directories(self, name: str) -> list[Path]:
        """Every directory that makes up cgroup ``name``."""

    @abstractmethod
    def apply_limits(self, name: str, limits: Limits, own_cpu: bool = True) -> None:
        """Write the sandbox's limits; its CPU quota only with ``own_cpu`` (a member of a memory group
        with a CPU quota has the group's)."""

    @abstractmethod
    def freeze(self, name: str, frozen: bool) -> None: ...

    @abstractmethod
    def stats(self, name: str) -> Stats: ...

    @abstractmethod
    def oom_kills(self, name: str) -> int:
        """How many processes the kernel's OOM killer has killed in the cgroup
        (one small file, where :meth:`stats` reads several)."""

    @abstractmethod
    def names(self) -> list[str]:
        """The cgroups that exist under our parent."""

    @abstractmethod
    def ensure_group(self, group: str, memory_bytes: int, cpu: float = 0.0) -> None:
        """Make memory group ``group`` (if it is not there yet) with this memory limit, and with ``cpu``
        a CPU quota of that many cores for the whole group."""

    @abstractmethod
    def group_directory(self, group: str) -> Path:
        """Where memory group ``group``'s memory cgroup is."""

    def group_directories(self, group: str) -> list[Path]:
        """Every directory memory group ``group`` has (on v1 one in the CPU hierarchy too)."""
        return [self.group_directory(group)]

    def own_directories(self, name: str) -> list[Path]:
        """The directories that are the sandbox's alone (not its memory group's)."""
        return self.directories(name)

    def remove_empty_group(self, group: str) -> bool:
        """Remove a memory group with no sandbox left in it (never waits: a member still there keeps it)."""
        if not group:
            return False
        removed = False
        for directory in self.group_directories(group):
            try:
                os.rmdir(directory)
                removed = True
            except OSError:
                continue  # gone already, or a member left
        return removed

    def groups(self) -> list[str]:
        """The memory groups under our parent."""
        found: set[str] = set()
        for parent in {directory.parent for directory in self.group_directories("x")}:
            try:
                found.update(entry.name for entry in parent.iterdir() if entry.is_dir() and entry.name.startswith(GROUP_PREFIX))
            except FileNotFoundError:
                continue
        return sorted(found)

    def create(self, name: str, limits: Limits, group_memory_bytes: int = 0, group_cpu: float = 0.0) -> list[str]:
        """Make the cgroup and its limits (and its memory group's, with ``group_memory_bytes`` and, with
        ``group_cpu``, the group's CPU quota in place of the sandbox's); return the files a pid is written to."""
        group, _ = split_name(name)
        if group:
            self.ensure_group(group, group_memory_bytes, group_cpu)
        directories = self.directories(name)
        for directory in directories:
            try:
                directory.mkdir()
            except FileExistsError:
                pass
            except OSError as error:
                raise CgroupError(
                    f"cannot create cgroup {directory}: {error.strerror}", path=str(directory), step="mkdir"
                ) from error
        self.apply_limits(name, limits, own_cpu=not (group and group_cpu))
        return [f"{directory}/cgroup.procs" for directory in directories]

    def exists(self, name: str) -> bool:
        return any(directory.is_dir() for directory in self.own_directories(name))

    def pids(self, name: str) -> list[int]:
        """Every process in the cgroup, its exec cgroups included (never its memory group mates)."""
        found: set[int] = set()
        for directory in self.own_directories(name):
            for place in (directory, *_children(directory)):
                try:
                    found.update(int(line) for line in _read(place / "cgroup.procs").split())
                except OSError:
                    continue
        return sorted(found)

    # --- a cgroup per exec -------------------------------------------------------

    @abstractmethod
    def exec_directory(self, name: str, command: str) -> Path:
        """Where the exec cgroup ``command`` of sandbox cgroup ``name`` lives."""

    def create_exec(self, name: str, command: str) -> Path:
        """Make an exec cgroup; returns its ``cgroup.procs`` (the command writes itself there)."""
        directory = self.exec_directory(name, command)
        try:
            directory.mkdir()
        except FileExistsError:
            raise  # the caller picks another name
        except OSError as error:
            raise CgroupError(f"cannot create cgroup {directory}: {error.strerror}", path=str(directory), step="mkdir") from error
        return directory / "cgroup.procs"

    def exec_pids(self, name: str, command: str) -> list[int]:
        """The host pids in an exec cgroup (a background process finds its own there: processes.py)."""
        try:
            return [int(line) for line in _read(self.exec_directory(name, command) / "cgroup.procs").split()]
        except OSError:
            return []

    def exec_empty(self, name: str, command: str) -> bool:
        """Does the exec cgroup exist and hold no process?  (One read: the engine
        checks this before it gives a kept exec cgroup to another command.)"""
        try:
            return not _read(f"{self.exec_directory(name, command)}/cgroup.procs").strip()
        except OSError:
            return False

    def kill_exec(self, name: str, command: str, timeout_s: float = 2.0) -> int:
        """Kill every process in an exec cgroup (none can leave it); how many."""
        procs = self.exec_directory(name, command) / "cgroup.procs"
        killed: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                pids = [int(line) for line in _read(procs).split()]
            except OSError:
                break
            if not pids:
                break
            # A process forked between the read and the kill is caught by the next round.
            _kill_pids(pids)
            killed.update(pids)
            time.sleep(0.001)
        return len(killed)

    def remove_exec(self, name: str, command: str) -> bool:
        """Remove an exec cgroup if nothing runs in it any more."""
        try:
            os.rmdir(self.exec_directory(name, command))
            return True
        except FileNotFoundError:
            return True
        except OSError:
            return False  # EBUSY: something it started still runs

    def kill_all(self, name: str) -> int:
        """Kill every process in the cgroup, even ones forking while we look."""
        pids = self.pids(name)
        if not pids:
            return 0
        self.freeze(name, True)
        try:
            pids = self.pids(name)
            _kill_pids(pids)
        finally:
            self.freeze(name, False)
        deadline = time.monotonic() + 2.0
        while self.pids(name) and time.monotonic() < deadline:
            _kill_pids(self.pids(name))
            time.sleep(0.005)
        return len(pids)

    def remove(self, name: str) -> bool:
        """Kill what is left and remove every directory; False if none existed.

        Each directory is removed first: the kernel refuses (``EBUSY``) one that
        still holds a process or an exec cgroup, and only those cost the kill and
        the walk below them. A destroyed sandbox's init has exited by now, which
        ended every process of its pid namespace, so most teardowns remove an
        empty directory per hierarchy and read nothing (the kill and the walk
        were most of what the engine spent on a destroy's cgroups)."""
        removed = False
        busy = []
        for directory in self.own_directories(name):
            try:
                os.rmdir(directory)
                removed = True
            except FileNotFoundError:
                pass
            except OSError as error:
                if error.errno != errno.EBUSY:
                    raise CgroupError(
                        f"cannot remove cgroup {directory}: {error.strerror}", path=str(directory), step="rmdir"
                    ) from error
                busy.append(directory)
        if busy:
            self.kill_all(name)
            for directory in busy:
                removed = _remove_directory(directory) or removed
        return removed


class CgroupsV2(Cgroups):
    version = 2
    CONTROLLERS = ("cpu", "memory", "pids")

    def __init__(self, config: EngineConfig, require_controllers: bool = True) -> None:
        super().__init__(config)
        self.require_controllers = require_controllers
        self.available: set[str] = set()
        self.parent = self._parent_path()

    def _parent_path(self) -> Path:
        root = self.config.cgroup_root
        parent = self.config.cgroup_parent
        if parent.startswith("/"):
            return root / parent.strip("/")
        own = _own_cgroups(self.config.proc_dir).get("", "/").strip("/")
        # A v2 cgroup with processes cannot also hand controllers to children
        # ("no internal processes"), so the engine lives in a leaf "engine"
        # beside our parent: <own>/engine and <own>/<parent>.
        if own == "engine" or own.endswith("/engine"):
            own = own.rpartition("/")[0]
        return root / own / parent if own else root / parent

    def setup(self) -> None:
        owner = self.parent.parent
        if owner != self.config.cgroup_root and not self.config.cgroup_parent.startswith("/"):
            # Step out of the way of our own subtree: move ourselves to a leaf.
            leaf = owner / "engine"
            leaf.mkdir(exist_ok=True)
            for pid in _read(owner / "cgroup.procs").split():
                try:
                    _write(leaf / "cgroup.procs", pid)
                except CgroupError:
                    pass  # a process that exited meanwhile
        self.parent.mkdir(parents=True, exist_ok=True)
        offered = set(_read(owner / "cgroup.controllers").split())
        self.available = offered & set(self.CONTROLLERS)
        missing = set(self.CONTROLLERS) - self.available
        if missing and self.require_controllers:
            raise CgroupError(
                "cgroup v2 controllers missing: " + ", ".join(sorted(missing)) + f" (delegate them to {owner})",
                missing=sorted(missing),
            )
        for directory in (owner, self.parent):
            enabled = set(_read(directory / "cgroup.subtree_control").split())
            wanted = self.available - enabled
            if wanted:
                _write(directory / "cgroup.subtree_control", " ".join(f"+{name}" for name in sorted(wanted)))

    def directories(self, name: str) -> list[Path]:
        return [self.parent / name]

    def group_directory(self, group: str) -> Path:
        return self.parent / group

    def ensure_group(self, group: str, memory_bytes: int, cpu: float = 0.0) -> None:
        directory = self.parent / group
        directory.mkdir(exist_ok=True)
        quota = f"{int(cpu * CPU_PERIOD_US)} {CPU_PERIOD_US}"
        # Written by the group's first member only: each write walks every CPU cgroup on the host.
        if cpu and "cpu" in self.available and _read_or_empty(directory / "cpu.max").strip() != quota:
            _write(directory / "cpu.max", quota)
        if "memory" in self.available:
            _write(directory / "memory.max", str(memory_bytes))
            if (directory / "memory.swap.max").exists():
                _write(directory / "memory.swap.max", "0")
        # Its sandboxes get CPU and pid limits of their own, and no memory cgroup: the group's is theirs.
        enabled = set(_read(directory / "cgroup.subtree_control").split())
        wanted = (self.available - {"memory"}) - enabled
        if wanted:
            _write(directory / "cgroup.subtree_control", " ".join(f"+{controller}" for controller in sorted(wanted)))

    def _memory_directory(self, name: str) -> Path:
        group, _ = split_name(name)
        return self.parent / (group or name)

    def exec_directory(self, name: str, command: str) -> Path:
        return self.parent / name / command

    def kill_exec(self, name: str, command: str, timeout_s: float = 2.0) -> int:
        kill = self.exec_directory(name, command) / "cgroup.kill"
        if kill.exists():
            count = len(_read(kill.with_name("cgroup.procs")).split())
            _write(kill, "1")
            return count
        return super().kill_exec(name, command, timeout_s)

    def apply_limits(self, name: str, limits: Limits, own_cpu: bool = True) -> None:
        directory = self.parent / name
        if own_cpu and "cpu" in self.available:
            _write(directory / "cpu.max", f"{int(limits.cpu * CPU_PERIOD_US)} {CPU_PERIOD_US}")
        if "memory" in self.available and not split_name(name)[0]:  # a group's member has the group's
            _write(directory / "memory.max", str(limits.memory_bytes))
            if (directory / "memory.swap.max").exists():
                _write(directory / "memory.swap.max", "0")
        if "pids" in self.available:
            _write(directory / "pids.max", str(limits.pids))

    def freeze(self, name: str, frozen: bool) -> None:
        directory = self.parent / name
        _write(directory / "cgroup.freeze", "1" if frozen else "0")
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if _keyed(directory / "cgroup.events").get("frozen", int(not frozen)) == int(frozen):
                return
            time.sleep(0.001)

    def kill_all(self, name: str) -> int:
        directory = self.parent / name
        pids = self.pids(name)
        if pids and (directory / "cgroup.kill").exists():
            _write(directory / "cgroup.kill", "1")
            deadline = time.monotonic() + 2.0
            while self.pids(name) and time.monotonic() < deadline:
                time.sleep(0.002)
            return len(pids)
        return super().kill_all(name)

    def stats(self, name: str) -> Stats:
        directory, memory = self.parent / name, self._memory_directory(name)
        return Stats(
            memory_bytes=_read_int(memory / "memory.current"),
            cpu_usage_us=_keyed(directory / "cpu.stat").get("usage_usec", 0),
            oom_kills=self.oom_kills(name),
            pids=len(self.pids(name)),
            memory_peak_bytes=_read_int(memory / "memory.peak"),
        )

    def oom_kills(self, name: str) -> int:
        return _keyed(self._memory_directory(name) / "memory.events").get("oom_kill", 0)

    def names(self) -> list[str]:
        """Every sandbox cgroup under our parent: ``fy-<id>``, and ``mg-<group>/fy-<id>`` in memory groups."""
        found: list[str] = []
        try:
            for entry in self.parent.iterdir():
                if not entry.is_dir():
                    continue
                if entry.name.startswith(PREFIX):
                    found.append(entry.name)
                elif entry.name.startswith(GROUP_PREFIX):
                    found.extend(f"{entry.name}/{member.name}" for member in _children(entry) if member.name.startswith(PREFIX))
        except FileNotFoundError:
            return []
        return sorted(found)


class CgroupsV1(Cgroups):
    """One directory per controller hierarchy (also hybrid hosts)."""

    version = 1
    CONTROLLERS = ("cpu", "cpuacct", "memory", "pids", "freezer")

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        own = _own_cgroups(config.proc_dir)
        self.parents: dict[str, Path] = {}
        for controller in self.CONTROLLERS:
            mount = config.cgroup_root / controller
            if not (mount / "cgroup.procs").exists():
                continue
            if config.cgroup_parent.startswith("/"):
                relative = config.cgroup_parent.strip("/")
            else:
                # The engine may already sit in a nested cgroup (say a memory
                # cgroup its host put it in): stay inside it.
                base = own.get(controller, "/").strip("/")
                relative = f"{base}/{config.cgroup_parent}" if base else config.cgroup_parent
            self.parents[controller] = mount / relative

    def setup(self) -> None:
        for controller in ("memory", "pids", "freezer"):
            if controller not in self.parents:
                raise CgroupError(f"cgroup v1 controller {controller!r} is not mounted under {self.config.cgroup_root}")
        for parent in self.parents.values():
            parent.mkdir(parents=True, exist_ok=True)

    # A memory group's members share its memory cgroup, and sit below its CPU
    # cgroup (where the group's CPU quota is, if it has one), each with its own.
    NESTED = ("cpu", "cpuacct")

    def directory(self, controller: str, name: str) -> Path:
        """Sandbox ``name``'s directory in ``controller``'s hierarchy."""
        group, own = split_name(name)
        if group and controller == "memory":
            return self.parents[controller] / group
        if group and controller in self.NESTED:
            return self.parents[controller] / group / own
        return self.parents[controller] / own

    def directories(self, name: str) -> list[Path]:
        return [self.directory(controller, name) for controller in self.parents]

    def own_directories(self, name: str) -> list[Path]:
        group = split_name(name)[0]
        return [self.directory(controller, name) for controller in self.parents if not (group and controller == "memory")]

    def group_directory(self, group: str) -> Path:
        return self.parents["memory"] / group

    def group_directories(self, group: str) -> list[Path]:
        # On most hosts cpu and cpuacct are one hierarchy under two names: both paths name one directory.
        nested = {self.parents[controller] / group for controller in self.NESTED if controller in self.parents}
        return [*sorted(nested), self.group_directory(group)]

    def ensure_group(self, group: str, memory_bytes: int, cpu: float = 0.0) -> None:
        for controller in self.NESTED:
            if controller in self.parents:
                (self.parents[controller] / group).mkdir(exist_ok=True)
        if cpu and "cpu" in self.parents:
            _set_cfs_quota(self.parents["cpu"] / group, cpu)
        directory = self.parents["memory"] / group
        directory.mkdir(exist_ok=True)
        _write(directory / "memory.limit_in_bytes", str(memory_bytes))
        if (directory / "memory.memsw.limit_in_bytes").exists():
            _write(directory / "memory.memsw.limit_in_bytes", str(memory_bytes))

    def _memory_directory(self, name: str) -> Path:
        group, own = split_name(name)
        return self.parents["memory"] / (group or own)

    def exec_directory(self, name: str, command: str) -> Path:
        # One hierarchy is enough to know a command's processes: pids (its
        # count is hierarchical, so the sandbox's limit still holds).
        return self.parents["pids"] / split_name(name)[1] / command

    def apply_limits(self, name: str, limits: Limits, own_cpu: bool = True) -> None:
        group, own = split_name(name)
        if own_cpu and "cpu" in self.parents:
            _set_cfs_quota(self.directory("cpu", name), limits.cpu)
        if not group:  # a group's member has the group's
            memory = self.parents["memory"] / own
            _write(memory / "memory.limit_in_bytes", str(limits.memory_bytes))
            if (memory / "memory.memsw.limit_in_bytes").exists():
                _write(memory / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        _write(self.parents["pids"] / own / "pids.max", str(limits.pids))

    def freeze(self, name: str, frozen: bool) -> None:
        state = self.parents["freezer"] / split_name(name)[1] / "freezer.state"
        wanted = "FROZEN" if frozen else "THAWED"
        _write(state, wanted)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                if _read(state).strip() == wanted:
                    return
            except OSError:
                return
            time.sleep(0.001)

    def stats(self, name: str) -> Stats:
        memory = self._memory_directory(name)
        cpu_ns = _read_int(self.directory("cpuacct", name) / "cpuacct.usage") if "cpuacct" in self.parents else 0
        return Stats(
            memory_bytes=_read_int(memory / "memory.usage_in_bytes"),
            cpu_usage_us=cpu_ns // 1000,
            oom_kills=self.oom_kills(name),
            pids=len(self.pids(name)),
            memory_peak_bytes=_read_int(memory / "memory.max_usage_in_bytes"),
        )

    def oom_kills(self, name: str) -> int:
        return _keyed(self._memory_directory(name) / "memory.oom_control").get("oom_kill", 0)

    def names(self) -> list[str]:
        """Every sandbox cgroup under our parent, by its own name (``fy-<id>``): on v1 the memory group a
        sandbox is in shows only in the memory and CPU hierarchies (compare names with ``split_name(...)[1]``)."""
        found: set[str] = set()
        for parent in self.parents.values():
            try:
                found.update(entry.name for entry in parent.iterdir() if entry.is_dir() and entry.name.startswith(PREFIX))
            except FileNotFoundError:
                continue
        return sorted(found)


def detect(config: EngineConfig) -> Cgroups:
    """v2 when the root is a unified hierarchy with controllers, else v1."""
    if (config.cgroup_root / "cgroup.controllers").exists():
        return CgroupsV2(config)
    return CgroupsV1(config)
