"""Output for the CLI: JSON, aligned tables, and a launch's progress bar drawn with ANSI and ``\\r``."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Iterable, Sequence
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal
from typing import Any, TextIO

from .models import LaunchFields, ProcessFields, SandboxFields, SnapshotFields

GREEN, RED, YELLOW, DIM, RESET = "\x1b[32m", "\x1b[31m", "\x1b[33m", "\x1b[2m", "\x1b[0m"
CLEAR_LINE = "\r\x1b[2K"


def jsonable(value: Any) -> Any:
    """Anything the SDK returns, as plain JSON types (sandboxes and launches as the API sent them)."""
    if isinstance(value, SandboxFields | LaunchFields | SnapshotFields | ProcessFields):
        return value.data
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {item.name: jsonable(getattr(value, item.name)) for item in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    return value


def print_json(value: Any, stream: TextIO | None = None, *, compact: bool = False) -> None:
    """``compact``: on one line (one of many: newline-delimited JSON)."""
    print(json.dumps(jsonable(value), indent=None if compact else 2, sort_keys=False), file=stream or sys.stdout, flush=compact)


def table(rows: Iterable[Sequence[Any]], headers: Sequence[str], stream: TextIO | None = None) -> None:
    """Columns aligned on their widest cell; the last column is not padded."""
    cells = [[str(header) for header in headers]] + [["" if cell is None else str(cell) for cell in row] for row in rows]
    widths = [max(len(row[column]) for row in cells) for column in range(len(headers))]
    for row in cells:
        line = "  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths[:-1], strict=True))
        print(f"{line}  {row[-1]}" if len(row) > 1 else row[0], file=stream or sys.stdout)


def when(value: datetime | None) -> str:
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def money(amount: Decimal, currency: str = "USD") -> str:
    """An amount as people read money: ``0.00 USD`` for nothing, cents from a cent up, up to six
    places below that (a sandbox's fraction of a cent is not nothing); never ``0E-8``."""
    if amount == 0:
        return f"0.00 {currency}"
    sign, amount = ("-" if amount < 0 else ""), abs(amount)
    if amount >= Decimal("0.01"):
        return f"{sign}{amount.quantize(Decimal('0.01'), rounding=ROUND_HALF_UP):,} {currency}"
    small = amount.quantize(Decimal("0.000001"), rounding=ROUND_HALF_UP)
    return f"{sign}{format(small, 'f').rstrip('0')} {currency}" if small else f"{sign}<0.000001 {currency}"


def size_of(count: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    index = 0
    while count >= 1024 and index < len(units) - 1:
        count /= 1024
        index += 1
    return f"{count:.0f} B" if index == 0 else f"{count:.1f} {units[index]}"


def ready_text(ready: dict[str, Any]) -> str:
    """A readiness check as the CLI takes it: ``tcp:8080``, ``http:8080/health``, ``exec:...``."""
    if "http" in ready:
        return f"http:{ready['http'].get('port')}{ready['http'].get('path', '/')}"
    return ", ".join(f"{kind}:{value}" for kind, value in ready.items())


def labels_text(labels: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items())) or "-"


class ProgressBar:
    """One line on a terminal, redrawn in place: ``[####....] 40/100 running  2 failed  12.3/s  3.2s``.

    Green for running, red for failed, yellow for creating; ``enabled=False``
    draws nothing (the summary is printed either way).
    """

    def __init__(self, stream: TextIO, *, enabled: bool, width: int = 32) -> None:
        self.stream, self.enabled, self.width = stream, enabled, width
        self.started = time.monotonic()
        self.drawn = False

    def draw(self, launch: LaunchFields) -> None:
        if not self.enabled:
            return
        progress = launch.progress
        total = max(progress.requested, 1)

        def cells(count: int) -> int:
            return round(self.width * count / total)

        running, failed = cells(progress.running), cells(progress.failed)
        creating = min(cells(progress.creating), self.width - running - failed)
        rest = max(0, self.width - running - failed - creating)
        bar = f"{GREEN}{'#' * running}{RED}{'#' * failed}{YELLOW}{'+' * creating}{DIM}{'.' * rest}{RESET}"
        counts = f"{progress.running}/{progress.requested} running"
        if progress.failed:
            counts += f"  {RED}{progress.failed} failed{RESET}"
        if progress.creating:
            counts += f"  {progress.creating} creating"
        elapsed = time.monotonic() - self.started
        self.stream.write(f"{CLEAR_LINE}[{bar}] {counts}  {launch.rate_per_s:.1f}/s  {elapsed:.1f}s")
        self.stream.flush()
        self.drawn = True

    def finish(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
