"""A local directory to and from a sandbox's tar archives (``upload_dir``, ``download_dir``).

An archive from a sandbox is hostile: its names and links are whatever code in
the sandbox made them.  Each entry is checked with the standard library's
``data`` extraction filter (``tarfile.data_filter``, PEP 706) before anything
is written: an absolute name, a ``..`` that leaves the target, a symlink or
hard link whose target lies outside it, a device or a FIFO is refused with
``UnsafeArchive``, and the download writes nothing.  The archive is spooled
(in memory up to ``SPOOL_BYTES``, then a temporary file) and checked whole
first, so that a refusal leaves the target directory as it was; then it is
extracted with the same filter, which also checks each entry against what the
entries before it made (a symlink planted earlier in the archive).

The filter alone is not enough: before CPython 3.11.13 / 3.12.11 / 3.13.4 it
resolves with ``os.path.realpath``, which silently stops following links once
the expanded path exceeds PATH_MAX (CVE-2025-4517), so a chain of links to
long directory names let an entry be written outside the target.  Each entry's
path, and each link's target, is therefore also resolved here, component by
component as the kernel would (``_stays_inside``): through the links the
archive makes and those already in the target, refusing a ``..`` above the
target, an absolute link, more than ``MAX_LINKS`` links or any error.
"""

from __future__ import annotations

import os
import stat
import tarfile
import tempfile
from pathlib import Path
from typing import IO

from .errors import ConfigurationError, UnsafeArchive

SPOOL_BYTES = 8 << 20
MAX_LINKS = 40  # links one resolution may follow, as Linux's ELOOP


def spool() -> IO[bytes]:
    return tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)  # noqa: SIM115 - the caller closes it


def pack(local: str | os.PathLike[str]) -> IO[bytes]:
    """A tar archive of the directory ``local``'s contents (not the directory itself), rewound."""
    root = Path(local)
    if not root.is_dir():
        raise ConfigurationError("not_a_directory", f"{root} is not a local directory")
    archive = spool()
    with tarfile.open(fileobj=archive, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(root.iterdir()):
            tar.add(entry, arcname=entry.name, recursive=True)  # links stay links, never followed
    archive.seek(0)
    return archive


def _filter() -> object:
    data_filter = getattr(tarfile, "data_filter", None)
    if data_filter is None:  # Python before 3.11.4
        raise ConfigurationError("unsupported", "download_dir needs Python 3.11.4 or later (tarfile's data filter)")
    return data_filter


def _refuse(member: tarfile.TarInfo, target: Path, why: str) -> UnsafeArchive:
    return UnsafeArchive(
        "unsafe_archive", f"the archive's entry {member.name!r} {why} ({target})", details={"entry": member.name}
    )


def _relative(member: tarfile.TarInfo, base: str, target: Path) -> str | None:
    """The entry's name below the archive's top directory (``base``, the remote directory's own name,
    as the engine names its entries); None for that directory itself.  An absolute name, a ``..``
    or a name outside ``base`` is refused, whatever a filter would make of it."""
    parts = member.name.split("/")
    if member.name.startswith("/") or ".." in parts:
        raise _refuse(member, target, "is absolute or climbs with '..'")
    parts = [part for part in parts if part not in ("", ".")]
    if base != "." and (not parts or parts[0] != base):
        raise _refuse(member, target, "is outside the directory downloaded")
    rest = parts if base == "." else parts[1:]
    return "/".join(rest) or None


def _parts(path: str) -> list[str]:
    return [part for part in path.split("/") if part not in ("", ".")]


def _stays_inside(destination: str, relative: str, links: dict[str, str], made: set[str]) -> bool:
    """Whether ``relative``, below ``destination``, resolved as the kernel would, stays inside it.

    Each component is looked up first among the archive's entries (``links``: a symlink's name to
    its target; ``made``: the other entries' names), then in ``destination`` itself (``lstat``); one
    that is in neither is taken as named (it will be made as a directory).  A ``..`` above the
    destination, an absolute link, more than ``MAX_LINKS`` links, or an error (a name too long)
    is outside."""
    pending = list(reversed(_parts(relative)))
    resolved: list[str] = []
    followed = 0
    while pending:
        part = pending.pop()
        if part == "..":
            if not resolved:
                return False
            resolved.pop()
            continue
        name = "/".join([*resolved, part])
        target = links.get(name)
        if target is None and name not in made:
            try:
                mode = os.lstat(os.path.join(destination, name)).st_mode
                target = os.readlink(os.path.join(destination, name)) if stat.S_ISLNK(mode) else None
            except FileNotFoundError:
                target = None
            except OSError:
                return False
        if target is None:
            resolved.append(part)
            continue
        followed += 1
        if followed > MAX_LINKS or target.startswith("/"):
            return False
        pending.extend(reversed(_parts(target)))
    return True


def _check_paths(members: list[tarfile.TarInfo], destination: str, target: Path) -> None:
    """Every entry (named below the target already) written, and every link resolved, inside the target,
    through the links the entries before it make; then every link again, once all are made (a link
    checked before a later one changed where it leads)."""
    links: dict[str, str] = {}
    made: set[str] = set()

    def check(member: tarfile.TarInfo) -> None:
        parent = "/".join(_parts(member.name)[:-1])
        written = parent if member.issym() else member.name  # a link is made in its directory, not followed
        if not _stays_inside(destination, written, links, made):
            raise _refuse(member, target, "would be written through a link that leads out")
        if member.issym() and not _stays_inside(destination, f"{parent}/{member.linkname}", links, made):
            raise _refuse(member, target, "is a link that leads out")
        if member.islnk() and not _stays_inside(destination, member.linkname, links, made):
            raise _refuse(member, target, "is a hard link to a path that leads out")

    for member in members:
        check(member)
        name = "/".join(_parts(member.name))
        if member.issym():
            links[name] = member.linkname
            made.discard(name)
        else:
            made.add(name)
            links.pop(name, None)
    for member in members:
        if member.issym():
            check(member)


def unpack(archive: IO[bytes], local: str | os.PathLike[str]) -> int:
    """Check every entry of ``archive`` (rewound: the engine's tar of one directory) against ``local``,
    then extract them into it; how many."""
    target = Path(local)
    data_filter = _filter()
    with tarfile.open(fileobj=archive, mode="r:") as tar:
        members = tar.getmembers()
        if not members:
            return 0
        base = members[0].name.strip("/") if members[0].isdir() else "."
        base = "." if base in ("", ".") else base
        kept = []
        target.mkdir(parents=True, exist_ok=True)
        destination = os.path.realpath(target)
        for member in members:
            name = _relative(member, base, target)
            if name is None:
                continue
            if member.islnk():  # a hard link names another entry of the archive
                linked = tarfile.TarInfo(member.linkname)
                link_name = _relative(linked, base, target)
                if link_name is None:
                    raise _refuse(member, target, "links to a directory")
                member.linkname = link_name
            member.name = name
            try:
                data_filter(member, destination)  # type: ignore[operator]
            except tarfile.FilterError as error:
                raise _refuse(member, target, f"would not stay inside or is not a plain entry: {error}") from None
            kept.append(member)
        _check_paths(kept, destination, target)
        for member in kept:
            written = os.path.dirname(member.name) if member.issym() else member.name
            if not _stays_inside(destination, written, {}, set()):  # what is on disk now, once more
                raise _refuse(member, target, "would be written through a link that leads out")
            try:
                tar.extract(member, destination, filter="data")
            except tarfile.FilterError as error:  # a link made by an earlier entry leads out
                raise _refuse(member, target, f"leads out: {error}") from None
    return len(kept)
