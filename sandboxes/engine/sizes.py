"""Sandbox sizes: the one catalogue of named shapes.

The engine's default sizes and the control plane's default shapes both come
from :data:`DEFAULT_SIZES`, so that "tiny" means the same limits on either
side.  This is a leaf module: it imports nothing from the rest of the engine,
so the control plane can import it without pulling the engine in.

A create names a size, gives an explicit shape (``cpu`` and ``memory_mib``),
or both (the control plane always sends both).  An explicit shape gets its
pids limit from :func:`explicit_size`; a named size brings its own pids and
disk.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

MEBIBYTE = 1024 * 1024
# The control plane keeps size names in 32-character columns; leave it room.
MAX_SIZE_NAME = 64
# Pids for an explicit shape: two per MiB of memory, within these bounds (a
# process needs far more memory than two per MiB would give it anyway).
EXPLICIT_PIDS_PER_MIB = 2
EXPLICIT_PIDS_MIN = 64
EXPLICIT_PIDS_MAX = 16384
EXPLICIT_DISK_MIN_MIB = 1024
EXPLICIT_DISK_MAX_MIB = 64 * 1024
MIN_DISK_MIB = 16  # the least disk a create may ask for (disk_mib)


@dataclass(frozen=True)
class Size:
    """What a sandbox may use.  Sizes are data: operators can add their own."""

    cpu: float
    memory_mib: int
    pids: int = 1024
    # What its writable layer may hold: a quota on disk (disks.py), or, on a host without a disk backend,
    # a tmpfs of that size that its memory limit bounds too. 0: as much as its memory.
    disk_mib: int = 0

    @property
    def disk_bytes(self) -> int:
        return (self.disk_mib or self.memory_mib) * MEBIBYTE

    def has_shape(self, cpu: float, memory_mib: int) -> bool:
        """Whether this size is exactly that shape: only then may a create that
        gives the shape use the size (and a warm pool of it)."""
        return self.cpu == cpu and self.memory_mib == memory_mib


def explicit_size(cpu: float, memory_mib: int) -> Size:
    """The size of a shape given as ``cpu`` and ``memory_mib``: pids scale with memory, and so does the
    disk (twice the memory, 1 to 64 GiB) unless the create names one (``disk_mib``)."""
    pids = max(EXPLICIT_PIDS_MIN, min(EXPLICIT_PIDS_MAX, memory_mib * EXPLICIT_PIDS_PER_MIB))
    disk_mib = max(EXPLICIT_DISK_MIN_MIB, min(EXPLICIT_DISK_MAX_MIB, memory_mib * 2))
    return Size(cpu=cpu, memory_mib=memory_mib, pids=pids, disk_mib=disk_mib)


def included_disk_mib(size: str, cpu: float, memory_mib: int) -> int:
    """The disk a sandbox of this size and shape gets unless its create names one: a shipped size's own (when
    its shape is that size's), else an explicit shape's (twice its memory, 1 to 64 GiB)."""
    shipped = DEFAULT_SIZES.get(size)
    if shipped is not None and shipped.has_shape(cpu, memory_mib):
        return shipped.disk_mib
    return explicit_size(cpu, memory_mib).disk_mib


# Read-only: the engine and the control plane share it, and neither may change
# the other's sizes by accident (an engine's own sizes are in EngineConfig.sizes).
DEFAULT_SIZES: Mapping[str, Size] = MappingProxyType(
    {
        "tiny": Size(cpu=1, memory_mib=128, pids=256, disk_mib=1024),
        "default": Size(cpu=2, memory_mib=4096, pids=4096, disk_mib=10 * 1024),
    }
)
