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


@dataclass(frozen=True)
class Size:
    """What a sandbox may use.  Sizes are data: operators can add their own."""

    cpu: float
    memory_mib: int
    pids: int = 1024
    # The writable layer is memory-backed (see ARCHITECTURE.md); by default it
    # may grow as large as the memory limit, which bounds it anyway.
    disk_mib: int = 0

    @property
    def disk_bytes(self) -> int:
        return (self.disk_mib or self.memory_mib) * MEBIBYTE

    def has_shape(self, cpu: float, memory_mib: int) -> bool:
        """Whether this size is exactly that shape: only then may a create that
        gives the shape use the size (and a warm pool of it)."""
        return self.cpu == cpu and self.memory_mib == memory_mib


def explicit_size(cpu: float, memory_mib: int) -> Size:
    """The size of a shape given as ``cpu`` and ``memory_mib``: pids scale with memory."""
    pids = max(EXPLICIT_PIDS_MIN, min(EXPLICIT_PIDS_MAX, memory_mib * EXPLICIT_PIDS_PER_MIB))
    return Size(cpu=cpu, memory_mib=memory_mib, pids=pids)


# Read-only: the engine and the control plane share it, and neither may change
# the other's sizes by accident (an engine's own sizes are in EngineConfig.sizes).
DEFAULT_SIZES: Mapping[str, Size] = MappingProxyType(
    {
        "tiny": Size(cpu=1, memory_mib=128, pids=256),
        "default": Size(cpu=2, memory_mib=4096, pids=4096),
    }
)
