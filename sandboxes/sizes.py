"""The catalogue of sandbox sizes: one table for validation, placement, billing and the engine.

A size names a shape (vCPUs and memory).  The shipped sizes, ``tiny`` and
``default``, are the engine's own table (``sandboxes/engine/sizes.py``), so
an engine and its control plane agree without asking each other; the default
rate card prices them (``billing.services.DEFAULT_PRICES``).  An operator
adds a size, or reshapes one, with a rate-card line that gives ``cpu`` and
``memory_mib``: the rate card wins.

Every create sends the engine the size's name *and* its shape: the engine
uses its own size of that name (and its warm pool) only when the shapes
agree, so an operator's reshaped size is never served from a pool of the
old shape.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from billing.models import Price
from console.errors import InvalidRequest
from sandboxes.engine.sizes import DEFAULT_SIZES, included_disk_mib

DEFAULT = "default"


@dataclass(frozen=True)
class Shape:
    """What a create asks for: a size's name ("" for an explicit shape), vCPUs, memory and disk."""

    size: str
    cpu: float
    memory_mib: int
    disk_mib: int = 0  # 0: the size's own (included_disk_mib)

    @property
    def included_disk_mib(self) -> int:
        """The disk its size comes with (and its price includes): a shipped size's own, else what the engine
        gives an explicit shape of its memory (twice it, 1 to 64 GiB)."""
        return included_disk_mib(self.size, self.cpu, self.memory_mib)

    @property
    def extra_disk_mib(self) -> int:
        """Disk asked for beyond what the size includes: what the rate card's disk line prices."""
        return max(0, self.disk_mib - self.included_disk_mib) if self.disk_mib else 0


def catalogue() -> dict[str, Shape]:
    """Every size a create may name: the shipped ones, then the rate card's."""
    sizes = {name: Shape(name, float(size.cpu), int(size.memory_mib)) for name, size in DEFAULT_SIZES.items()}
    for name, cpu, memory_mib in Price.objects.filter(kind=Price.Kind.RUNNING).values_list("size", "cpu", "memory_mib"):
        if name and cpu and memory_mib:
            sizes[name] = Shape(name, float(cpu), int(memory_mib))
    return sizes


def shape_of(size: str | None, cpu: float | None, memory_mib: int | None, disk_mib: int | None = None) -> Shape:
    """The shape a create asks for: a size on the catalogue, or explicit ``cpu`` and ``memory_mib``; with
    ``disk_mib``, a disk other than the size's."""
    shape = _named_or_explicit(size, cpu, memory_mib)
    return replace(shape, disk_mib=disk_mib) if disk_mib else shape


def _named_or_explicit(size: str | None, cpu: float | None, memory_mib: int | None) -> Shape:
    explicit = cpu is not None or memory_mib is not None
    if explicit and size:
        raise InvalidRequest("invalid_size", "give either size or cpu and memory_mib, not both", field="size")
    if explicit:
        if cpu is None or memory_mib is None:
            raise InvalidRequest("invalid_size", "cpu and memory_mib go together", field="cpu" if cpu is None else "memory_mib")
        return Shape("", float(cpu), int(memory_mib))
    sizes = catalogue()
    name = size or DEFAULT
    if name not in sizes:
        raise InvalidRequest(
            "invalid_size", f"unknown size {name!r}: one of {', '.join(sorted(sizes))}, or cpu and memory_mib", field="size"
        )
    return sizes[name]
