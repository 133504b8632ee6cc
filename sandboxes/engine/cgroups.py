"""Cgroup v1 and v2 behind one small interface.

A sandbox gets one cgroup (``fy-<id>``) under the engine's parent, with CPU,
memory and pid limits; it is also how the engine freezes a sandbox, counts its
OOM kills and finds stray processes during recovery.

* v2 (most hosts): one hierarchy; limits in ``cpu.max``, ``memory.max``,
  ``pids.max``; ``cgroup.freeze`` and ``cgroup.kill`` are built in.
* v1 / hybrid (this project's development machines): one hierarchy per
  controller (cpu, cpuacct, memory, pids, freezer); a sandbox has a directory
  in each and its pid is written to each ``cgroup.procs``.

The engine only ever touches cgroups under its own parent.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from .config import EngineConfig
from .errors import EngineError

CPU_PERIOD_US = 100_000
PREFIX = "fy-"


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


def _read(path: Path) -> str:
    with open(path) as handle:
        return handle.read()


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


def _remove_directory(path: Path, timeout_s: float = 2.0) -> bool:
    """rmdir a cgroup; the kernel answers EBUSY until its last task is gone."""
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
            time.sleep(0.005)


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Cgroups(ABC):
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
    def apply_limits(self, name: str, limits: Limits) -> None: ...

    @abstractmethod
    def freeze(self, name: str, frozen: bool) -> None: ...

    @abstractmethod
    def stats(self, name: str) -> Stats: ...

    @abstractmethod
    def names(self) -> list[str]:
        """The cgroups that exist under our parent."""

    def create(self, name: str, limits: Limits) -> list[str]:
        """Make the cgroup and its limits; return the files a pid is written to."""
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
        self.apply_limits(name, limits)
        return [f"{directory}/cgroup.procs" for directory in directories]

    def exists(self, name: str) -> bool:
        return any(directory.is_dir() for directory in self.directories(name))

    def pids(self, name: str) -> list[int]:
        found: set[int] = set()
        for directory in self.directories(name):
            try:
                found.update(int(line) for line in _read(directory / "cgroup.procs").split())
            except OSError:
                continue
        return sorted(found)

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
        """Kill what is left and remove every directory; False if none existed."""
        if not self.exists(name):
            return False
        self.kill_all(name)
        removed = False
        for directory in self.directories(name):
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

    def apply_limits(self, name: str, limits: Limits) -> None:
        directory = self.parent / name
        if "cpu" in self.available:
            _write(directory / "cpu.max", f"{int(limits.cpu * CPU_PERIOD_US)} {CPU_PERIOD_US}")
        if "memory" in self.available:
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
        directory = self.parent / name
        return Stats(
            memory_bytes=_read_int(directory / "memory.current"),
            cpu_usage_us=_keyed(directory / "cpu.stat").get("usage_usec", 0),
            oom_kills=_keyed(directory / "memory.events").get("oom_kill", 0),
            pids=len(self.pids(name)),
        )

    def names(self) -> list[str]:
        try:
            return sorted(entry.name for entry in self.parent.iterdir() if entry.is_dir() and entry.name.startswith(PREFIX))
        except FileNotFoundError:
            return []


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

    def directories(self, name: str) -> list[Path]:
        return [parent / name for parent in self.parents.values()]

    def apply_limits(self, name: str, limits: Limits) -> None:
        if "cpu" in self.parents:
            directory = self.parents["cpu"] / name
            _write(directory / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(directory / "cpu.cfs_quota_us", str(int(limits.cpu * CPU_PERIOD_US)))
        memory = self.parents["memory"] / name
        _write(memory / "memory.limit_in_bytes", str(limits.memory_bytes))
        if (memory / "memory.memsw.limit_in_bytes").exists():
            _write(memory / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        _write(self.parents["pids"] / name / "pids.max", str(limits.pids))

    def freeze(self, name: str, frozen: bool) -> None:
        state = self.parents["freezer"] / name / "freezer.state"
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
        memory = self.parents["memory"] / name
        cpu_ns = _read_int(self.parents["cpuacct"] / name / "cpuacct.usage") if "cpuacct" in self.parents else 0
        return Stats(
            memory_bytes=_read_int(memory / "memory.usage_in_bytes"),
            cpu_usage_us=cpu_ns // 1000,
            oom_kills=_keyed(memory / "memory.oom_control").get("oom_kill", 0),
            pids=len(self.pids(name)),
        )

    def names(self) -> list[str]:
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
