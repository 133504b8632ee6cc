"""Snapshot layers: a sandbox's changes copied out, hashed, merged, moved.

A sandbox's writes live in its overlay's upper directory, on a tmpfs inside
its own mount namespace; init keeps a handle on it (its fd 5), which the host
reaches as ``/proc/<init>/fd/5``.  Overlayfs (mounted with ``userxattr``)
writes two kinds of markers there, and a layer keeps both so that it can sit
below another sandbox's overlay unchanged:

* a *whiteout*, a character device 0:0, hides a lower file that was deleted;
* ``user.overlay.opaque=y`` on a directory hides everything below it that
  the lower layers hold (a directory deleted and made again).

The contents are hostile.  Every walk goes one directory fd at a time
(``O_NOFOLLOW``), never through a path string, so a symlink planted or a
directory swapped mid-walk fails to open rather than leading to a host path;
FIFOs are opened non-blocking and anything that is not a regular file when
opened is skipped.  Only ``user.`` xattrs are kept, device nodes other than
whiteouts are dropped, owners outside the sandboxes' uid range become nobody.
Hard links become copies (the layer holds the same bytes twice, no more).

A :class:`LayerCopy` may run over the same source several times: each pass
copies only what changed since the previous one (by type, mode, owner, size,
mtime and ctime, which no one can set back), and removes what went away.  A
snapshot therefore copies while the sandbox runs, then freezes it for a
second pass that only re-copies what moved meanwhile.

A layer's id is the sha256 of a canonical listing: each entry's path, type,
mode, owner (inside the sandbox), size, content hash or link target, and
kept xattrs, in path order.  Times are left out, so the same changes made
twice give the same layer.  :func:`tree_digest` recomputes it from a layer
on disk; a copy computes it as it goes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from .errors import InvalidRequest, TooLarge
from .trees import NOBODY, IdShift, read_directory

OPAQUE = "user.overlay.opaque"
CHUNK = 1 << 20
MAX_DEPTH = 256  # directories deep; real trees (node_modules included) stay well under
# A change within this long of a pass's first look at it may share its ctime
# tick (the kernel's coarse clock): the next pass copies it again anyway.
CTIME_SLACK_NS = 50_000_000
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
DIR_FLAGS = OPEN_FLAGS | os.O_DIRECTORY
Progress = Callable[[dict[str, Any]], None]


@dataclass
class _Entry:
    signature: tuple[int, ...]
    line: bytes  # this entry's line in the canonical listing
    size: int = 0


@dataclass
class PassStats:
    copied_files: int = 0
    copied_bytes: int = 0
    removed: int = 0
    skipped: int = 0  # vanished, swapped mid-walk, or not representable (devices, sockets)
    seconds: float = 0.0


def _kind(mode: int, rdev: int) -> str | None:
    if stat.S_ISREG(mode):
        return "f"
    if stat.S_ISDIR(mode):
        return "d"
    if stat.S_ISLNK(mode):
        return "l"
    if stat.S_ISFIFO(mode):
        return "p"
    if stat.S_ISCHR(mode) and rdev == 0:
        return "w"  # a whiteout
    return None  # devices and sockets: not part of a layer


def _signature(info: os.stat_result) -> tuple[int, ...]:
    return (info.st_mode, info.st_uid, info.st_gid, info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_rdev)


def _kept_xattrs(fd: int) -> list[tuple[str, bytes]]:
    """``user.`` xattrs worth keeping in a layer: the opaque marker, and the
    sandbox's own (not overlay's bookkeeping, which names lower inodes)."""
    try:
        names = os.listxattr(fd)
    except OSError:
        return []
    kept = []
    for name in sorted(names):
        if not name.startswith("user.") or (name.startswith("user.overlay.") and name != OPAQUE):
            continue
        try:
            kept.append((name, os.getxattr(fd, name)))
        except OSError:
            continue
    return kept


def _line(
    path: str, kind: str, info: os.stat_result, shift: IdShift, content: str, xattrs: list[tuple[str, bytes]], size: int = 0
) -> bytes:
    """One entry of the canonical listing (the layer id hashes these, in path order)."""
    owner = f"{shift.inside(info.st_uid)}:{shift.inside(info.st_gid)}"
    attributes = ",".join(f"{name}={value.hex()}" for name, value in xattrs)
    return b"\0".join(
        [
            os.fsencode(path),
            f"{kind} {stat.S_IMODE(info.st_mode):o} {owner} {size} {content} {attributes}".encode(),
        ]
    )


def listing_digest(lines: Iterator[bytes] | list[bytes]) -> str:
    digest = hashlib.sha256()
    for line in sorted(lines):
        digest.update(line)
        digest.update(b"\n")
    return "sha256:" + digest.hexdigest()


def _remove(dir_fd: int, name: str) -> None:
    """Remove an entry of a directory we own (the copy), whatever it is."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)


class LayerCopy:
    """Copies a tree (a sandbox's upper directory) into a layer directory, pass after pass.

    Owners are read as ``source_shift`` sees them (a sandbox's own uid range)
    and written as ``shift`` (the layers' range, on disk): a layer reads the
    same to every sandbox that mounts it, whatever its range.
    """

    def __init__(
        self, shift: IdShift, max_bytes: int, progress: Progress | None = None, source_shift: IdShift | None = None
    ) -> None:
        self.shift = shift
        self.source_shift = source_shift or shift
        self.max_bytes = max_bytes
        self.entries: dict[str, _Entry] = {}  # changed through _put and _drop only: they keep the total
        self._total_bytes = 0
        self.progress = progress or (lambda _event: None)
        self._pass_started_ns = 0
        self._last_pass_started_ns = 0
        self._seen: set[str] = set()
        self._stats = PassStats()

    @property
    def total_bytes(self) -> int:
        return self._total_bytes  # kept as entries change: asked before every file's copy (a sum was O(files))

    @property
    def files(self) -> int:
        return len(self.entries)

    def digest(self) -> str:
        return listing_digest([entry.line for entry in self.entries.values()])

    def sync(self, source_fd: int, dest_fd: int) -> PassStats:
        """One pass: make ``dest`` match ``source``, copying only what changed since the last pass."""
        started = time.monotonic()
        self._stats = PassStats()
        self._last_pass_started_ns, self._pass_started_ns = self._pass_started_ns, time.time_ns()
        self._seen = set()
        self._copy_metadata(source_fd, dest_fd, os.fstat(source_fd))
        self._sync_directory(source_fd, dest_fd, "", 0)
        for gone in self.entries.keys() - self._seen:
            self._drop(gone)
        self._stats.seconds = time.monotonic() - started
        return self._stats

    def _put(self, path: str, entry: _Entry) -> None:
        previous = self.entries.get(path)
        self._total_bytes += entry.size - (previous.size if previous else 0)
        self.entries[path] = entry

    def _drop(self, path: str) -> None:
        self._total_bytes -= self.entries.pop(path).size

    # --- the walk ----------------------------------------------------------------------

    def _sync_directory(self, source_fd: int, dest_fd: int, prefix: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise TooLarge(f"the sandbox's changes nest directories more than {MAX_DEPTH} deep", limit=MAX_DEPTH)
        present = set()
        for item in read_directory(source_fd, prefix or "/"):
            present.add(item.name)
            try:
                info = item.stat(follow_symlinks=False)
            except OSError:
                self._stats.skipped += 1
                continue
            self._sync_entry(source_fd, dest_fd, item.name, prefix + item.name, info, depth)
        for name in os.listdir(dest_fd):
            if name not in present:
                _remove(dest_fd, name)
                self._stats.removed += 1

    def _unchanged(self, path: str, info: os.stat_result) -> bool:
        entry = self.entries.get(path)
        return (
            entry is not None
            and entry.signature == _signature(info)
            # A change in the same clock tick as our last look would not move ctime.
            and info.st_ctime_ns < self._last_pass_started_ns - CTIME_SLACK_NS
        )

    def _sync_entry(self, source_fd: int, dest_fd: int, name: str, path: str, info: os.stat_result, depth: int) -> None:
        kind = _kind(info.st_mode, info.st_rdev)
        if kind is None:
            self._stats.skipped += 1
            _remove(dest_fd, name)
            return
        if kind == "d":
            self._sync_subdirectory(source_fd, dest_fd, name, path, info, depth)
            return
        self._seen.add(path)
        if self._unchanged(path, info):
            return
        _remove(dest_fd, name)
        if kind == "f":
            copied = self._copy_file(source_fd, dest_fd, name, path, info)
            if copied is None:
                self._stats.skipped += 1
                self._seen.discard(path)
            return
        if kind == "l":
            try:
                target = os.readlink(name, dir_fd=source_fd)
            except OSError:
                self._stats.skipped += 1
                self._seen.discard(path)
                return
            os.symlink(target, name, dir_fd=dest_fd)
            content = hashlib.sha256(os.fsencode(target)).hexdigest()
        elif kind == "p":
            os.mkfifo(name, 0o600, dir_fd=dest_fd)
            content = ""
        else:
            os.mknod(name, stat.S_IFCHR | 0o000, 0, dir_fd=dest_fd)
            content = ""
        self._set_owner_and_times(dest_fd, name, info, symlink=kind == "l")
        if kind == "p":
            os.chmod(name, stat.S_IMODE(info.st_mode), dir_fd=dest_fd)
        self._put(path, _Entry(_signature(info), _line(path, kind, info, self.source_shift, content, [])))

    def _sync_subdirectory(self, source_fd: int, dest_fd: int, name: str, path: str, info: os.stat_result, depth: int) -> None:
        try:
            child = os.open(name, DIR_FLAGS, dir_fd=source_fd)
        except OSError:
            self._stats.skipped += 1  # swapped for something else since the listing
            return
        try:
            if os.fstat(child).st_ino != info.st_ino:
                self._stats.skipped += 1
                return
            self._seen.add(path)
            try:
                existing = os.stat(name, dir_fd=dest_fd, follow_symlinks=False)
            except FileNotFoundError:
                existing = None
            if existing is not None and not stat.S_ISDIR(existing.st_mode):
                _remove(dest_fd, name)
                existing = None
            if existing is None:
                os.mkdir(name, 0o700, dir_fd=dest_fd)
            copy = os.open(name, DIR_FLAGS, dir_fd=dest_fd)
            try:
                self._sync_directory(child, copy, path + "/", depth + 1)
                # After the children: creating them moved the copy's mtime.
                xattrs = self._copy_metadata(child, copy, info)
            finally:
                os.close(copy)
            self._put(path, _Entry(_signature(info), _line(path, "d", info, self.source_shift, "", xattrs)))
        finally:
            os.close(child)

    def _copy_file(self, source_fd: int, dest_fd: int, name: str, path: str, info: os.stat_result) -> bool | None:
        try:
            source = os.open(name, OPEN_FLAGS | os.O_NONBLOCK, dir_fd=source_fd)
        except OSError:
            return None
        try:
            opened = os.fstat(source)
            if not stat.S_ISREG(opened.st_mode) or opened.st_ino != info.st_ino:
                return None  # swapped since the listing
            previous = self.entries.get(path)
            if self.total_bytes - (previous.size if previous else 0) + opened.st_size > self.max_bytes:
                raise TooLarge(
                    f"the sandbox's changes exceed {self.max_bytes} bytes (sparse files count at their full size)",
                    limit=self.max_bytes,
                )
            target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dest_fd)
            try:
                content = hashlib.sha256()
                buffer = bytearray(CHUNK)
                view = memoryview(buffer)
                copied = 0
                while True:
                    count = os.readv(source, [buffer])
                    if not count:
                        break
                    content.update(view[:count])
                    written = 0
                    while written < count:
                        written += os.write(target, view[written:count])
                    copied += count
                xattrs = self._copy_metadata(source, target, info)
            finally:
                os.close(target)
        finally:
            os.close(source)
        self._stats.copied_files += 1
        self._stats.copied_bytes += copied
        # The listing says what the copy holds: the size read, not the size listed.
        line = _line(path, "f", info, self.source_shift, content.hexdigest(), xattrs, size=copied)
        self._put(path, _Entry(_signature(info), line, copied))
        if self._stats.copied_files % 500 == 0:
            self.progress({"phase": "copy", "files": self._stats.copied_files, "bytes": self._stats.copied_bytes})
        return True

    # --- metadata ----------------------------------------------------------------------

    def _owner(self, uid: int) -> int:
        """A source owner (as the sandbox's range has it) as the layer keeps it."""
        inside = self.source_shift.inside(uid)
        return self.shift.outside(inside if 0 <= inside < NOBODY else NOBODY)

    def _copy_metadata(self, source: int, target: int, info: os.stat_result) -> list[tuple[str, bytes]]:
        """Owner, mode, kept xattrs and times, from one open file or directory to another."""
        os.fchown(target, self._owner(info.st_uid), self._owner(info.st_gid))
        os.fchmod(target, stat.S_IMODE(info.st_mode))
        xattrs = _kept_xattrs(source)
        for name in _kept_xattr_names(target):
            if name not in dict(xattrs):
                os.removexattr(target, name)
        for name, value in xattrs:
            os.setxattr(target, name, value)
        os.utime(target, ns=(info.st_atime_ns, info.st_mtime_ns))
        return xattrs

    def _set_owner_and_times(self, dir_fd: int, name: str, info: os.stat_result, symlink: bool) -> None:
        os.chown(name, self._owner(info.st_uid), self._owner(info.st_gid), dir_fd=dir_fd, follow_symlinks=False)
        os.utime(name, ns=(info.st_atime_ns, info.st_mtime_ns), dir_fd=dir_fd, follow_symlinks=False)


def _kept_xattr_names(fd: int) -> list[str]:
    try:
        return [name for name in os.listxattr(fd) if name.startswith("user.")]
    except OSError:
        return []


# --- reading a layer back: its digest, its size, its tar stream ------------------------------


@dataclass
class TreeSummary:
    digest: str
    total_bytes: int
    entries: int
    lines: list[bytes] = field(default_factory=list, repr=False)


def _walk(dir_fd: int, prefix: str, depth: int = 0) -> Iterator[tuple[int, str, str, os.stat_result]]:
    """(parent fd, name, path, stat) for every entry below ``dir_fd``, parents first."""
    if depth > MAX_DEPTH:
        raise TooLarge(f"the layer nests directories more than {MAX_DEPTH} deep", limit=MAX_DEPTH)
    items = sorted(read_directory(dir_fd, prefix or "/"), key=lambda item: os.fsencode(item.name))
    for item in items:
        info = item.stat(follow_symlinks=False)
        path = prefix + item.name
        yield dir_fd, item.name, path, info
        if stat.S_ISDIR(info.st_mode):
            child = os.open(item.name, DIR_FLAGS, dir_fd=dir_fd)
            try:
                yield from _walk(child, path + "/", depth + 1)
            finally:
                os.close(child)


def tree_digest(root_fd: int, shift: IdShift) -> TreeSummary:
    """The layer id of a layer on disk, reading every file: what :class:`LayerCopy` computes as it goes."""
    lines = []
    total = 0
    for parent, name, path, info in _walk(root_fd, ""):
        kind = _kind(info.st_mode, info.st_rdev)
        if kind is None:
            continue
        content, xattrs = "", []
        if kind == "f":
            fd = os.open(name, OPEN_FLAGS | os.O_NONBLOCK, dir_fd=parent)
            try:
                digest = hashlib.sha256()
                while chunk := os.read(fd, CHUNK):
                    digest.update(chunk)
                content, xattrs = digest.hexdigest(), _kept_xattrs(fd)
            finally:
                os.close(fd)
            total += info.st_size
        elif kind == "d":
            fd = os.open(name, DIR_FLAGS, dir_fd=parent)
            try:
                xattrs = _kept_xattrs(fd)
            finally:
                os.close(fd)
        elif kind == "l":
            content = hashlib.sha256(os.fsencode(os.readlink(name, dir_fd=parent))).hexdigest()
        lines.append(_line(path, kind, info, shift, content, xattrs, size=info.st_size if kind == "f" else 0))
    return TreeSummary(listing_digest(lines), total, len(lines), lines)


class Spool:
    """A write-only file object whose writes are taken as chunks by a generator."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.chunks.append(bytes(data))
        return len(data)

    def take(self) -> list[bytes]:
        chunks, self.chunks = self.chunks, []
        return chunks


def export_tar(root_fd: int, shift: IdShift, prefix: str = "") -> Iterator[bytes]:
    """A layer as PAX tar entries named ``prefix + path``: owners as seen inside,
    whiteouts as 0:0 character devices, kept xattrs as ``SCHILY.xattr`` records."""
    spool = Spool()
    archive = tarfile.open(fileobj=spool, mode="w|", format=tarfile.PAX_FORMAT, encoding="utf-8", errors="surrogateescape")  # type: ignore[call-overload]
    yield from add_layer(archive, spool, root_fd, shift, prefix)
    archive.close()
    yield from spool.take()


def add_layer(archive: tarfile.TarFile, spool: Spool, root_fd: int, shift: IdShift, prefix: str = "") -> Iterator[bytes]:
    """A layer's entries into an open archive (several layers may share one stream)."""
    for parent, name, path, info in _walk(root_fd, ""):
        kind = _kind(info.st_mode, info.st_rdev)
        if kind is None:
            continue
        member = tarfile.TarInfo(prefix + path)
        member.mode = stat.S_IMODE(info.st_mode)
        member.uid, member.gid = shift.inside(info.st_uid), shift.inside(info.st_gid)
        member.mtime = info.st_mtime
        fd = None
        if kind in ("f", "d"):
            fd = os.open(name, (DIR_FLAGS if kind == "d" else OPEN_FLAGS | os.O_NONBLOCK), dir_fd=parent)
            member.pax_headers = {f"SCHILY.xattr.{key}": value.decode("latin-1") for key, value in _kept_xattrs(fd)}
        try:
            if kind == "f":
                assert fd is not None
                member.type, member.size = tarfile.REGTYPE, info.st_size
                with os.fdopen(os.dup(fd), "rb") as stream:
                    archive.addfile(member, stream)
            else:
                member.type = {"d": tarfile.DIRTYPE, "l": tarfile.SYMTYPE, "p": tarfile.FIFOTYPE, "w": tarfile.CHRTYPE}[kind]
                if kind == "l":
                    member.linkname = os.readlink(name, dir_fd=parent)
                archive.addfile(member)
        finally:
            if fd is not None:
                os.close(fd)
        yield from spool.take()


def _safe_parts(name: str) -> list[str]:
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if not parts or ".." in parts or name.startswith("/"):
        raise InvalidRequest(f"layer archive entry {name!r} is not a relative path inside the layer", field="body")
    return parts


class LayerExtractor:
    """Unpacks :func:`export_tar`'s entries into an empty directory; entries the
    export never makes (hard links, devices, absolute or ``..`` paths) are refused."""

    def __init__(self, root_fd: int, shift: IdShift) -> None:
        self.root_fd = root_fd
        self.shift = shift
        self.directories: list[tuple[list[str], tarfile.TarInfo]] = []
        self.count = 0

    def add(self, archive: tarfile.TarFile, member: tarfile.TarInfo, name: str) -> None:
        parts = _safe_parts(name)
        parent = _open_parent(self.root_fd, parts[:-1])
        leaf = parts[-1]
        owner = (self.shift.outside(member.uid), self.shift.outside(member.gid))
        try:
            if member.isdir():
                os.mkdir(leaf, 0o700, dir_fd=parent)
                self.directories.append((parts, member))
            elif member.isfile():
                source = archive.extractfile(member)
                assert source is not None
                fd = os.open(leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent)
                try:
                    while chunk := source.read(CHUNK):
                        os.write(fd, chunk)
                    _apply(fd, member, self.shift)
                finally:
                    os.close(fd)
            elif member.issym() or member.isfifo() or (member.ischr() and member.devmajor == 0 and member.devminor == 0):
                if member.issym():
                    os.symlink(member.linkname, leaf, dir_fd=parent)
                elif member.isfifo():
                    os.mkfifo(leaf, 0o600, dir_fd=parent)
                else:
                    os.mknod(leaf, stat.S_IFCHR, 0, dir_fd=parent)
                os.chown(leaf, *owner, dir_fd=parent, follow_symlinks=False)
                if not member.issym():
                    os.chmod(leaf, member.mode & 0o7777, dir_fd=parent)
                os.utime(leaf, (member.mtime, member.mtime), dir_fd=parent, follow_symlinks=False)
            else:
                raise InvalidRequest(f"layer archive entry {member.name!r} is of a kind a layer never holds", field="body")
        except FileExistsError:
            raise InvalidRequest(f"layer archive holds {member.name!r} twice", field="body") from None
        finally:
            if parent != self.root_fd:
                os.close(parent)
        self.count += 1

    def finish(self) -> int:
        """Directories' own metadata, children first (creating them moved the parents' mtimes)."""
        for parts, member in reversed(self.directories):
            parent = _open_parent(self.root_fd, parts[:-1])
            try:
                fd = os.open(parts[-1], DIR_FLAGS, dir_fd=parent)
                try:
                    _apply(fd, member, self.shift)
                finally:
                    os.close(fd)
            finally:
                if parent != self.root_fd:
                    os.close(parent)
        return self.count


def import_tar(stream: IO[bytes], root_fd: int, shift: IdShift) -> int:
    """Unpack one layer's :func:`export_tar` stream into an empty directory."""
    extractor = LayerExtractor(root_fd, shift)
    with tarfile.open(fileobj=stream, mode="r|", encoding="utf-8", errors="surrogateescape") as archive:
        for member in archive:
            extractor.add(archive, member, member.name)
    return extractor.finish()


def _open_parent(root_fd: int, parts: list[str]) -> int:
    fd = root_fd
    for part in parts:
        try:
            child = os.open(part, DIR_FLAGS, dir_fd=fd)
        except OSError as error:
            raise InvalidRequest(
                f"layer archive names a path through {part!r}, which is not a directory", field="body"
            ) from error
        finally:
            if fd != root_fd:
                os.close(fd)
        fd = child
    return fd


def _apply(fd: int, member: tarfile.TarInfo, shift: IdShift) -> None:
    os.fchown(fd, shift.outside(member.uid), shift.outside(member.gid))
    os.fchmod(fd, member.mode & 0o7777)
    for key, value in member.pax_headers.items():
        if key.startswith("SCHILY.xattr.user."):
            os.setxattr(fd, key[len("SCHILY.xattr.") :], value.encode("latin-1"))
    os.utime(fd, (member.mtime, member.mtime))


# --- flattening: several layers merged into one, with overlay's own rules ----------------


def merge_into(layer_fd: int, dest_fd: int, shift: IdShift, max_bytes: int) -> None:
    """Lay ``layer`` over ``dest`` as overlayfs would show it, keeping markers:
    a whiteout replaces what is below it (and stays, for the layers further
    down); an opaque directory replaces the directory below it; any other
    directory merges; anything else replaces."""
    copier = LayerCopy(shift, max_bytes)
    _merge_directory(copier, layer_fd, dest_fd, "", 0)


def _merge_directory(copier: LayerCopy, source_fd: int, dest_fd: int, prefix: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise TooLarge(f"the layers nest directories more than {MAX_DEPTH} deep", limit=MAX_DEPTH)
    items = read_directory(source_fd, prefix or "/")
    for item in items:
        info = item.stat(follow_symlinks=False)
        kind = _kind(info.st_mode, info.st_rdev)
        if kind is None:
            continue
        if kind != "d":
            copier._sync_entry(source_fd, dest_fd, item.name, prefix + item.name, info, depth)
            continue
        child = os.open(item.name, DIR_FLAGS, dir_fd=source_fd)
        try:
            opaque = any(name == OPAQUE for name, _ in _kept_xattrs(child))
            try:
                existing = os.stat(item.name, dir_fd=dest_fd, follow_symlinks=False)
            except FileNotFoundError:
                existing = None
            if existing is not None and (opaque or not stat.S_ISDIR(existing.st_mode)):
                _remove(dest_fd, item.name)
                existing = None
            if existing is None:
                os.mkdir(item.name, 0o700, dir_fd=dest_fd)
            copy = os.open(item.name, DIR_FLAGS, dir_fd=dest_fd)
            try:
                # Merged into a directory that hid what lies below: it still does.
                hides = any(name == OPAQUE for name, _ in _kept_xattrs(copy))
                _merge_directory(copier, child, copy, prefix + item.name + "/", depth + 1)
                copier._copy_metadata(child, copy, info)
                if hides:
                    os.setxattr(copy, OPAQUE, b"y")
            finally:
                os.close(copy)
        finally:
            os.close(child)
