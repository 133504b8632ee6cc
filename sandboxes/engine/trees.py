"""Reading and writing file trees that someone else controls, without escaping them.

Used for a sandbox's files (its root is reached through /proc/<pid>/root) and
for template and snapshot layers (a directory on the host).  The contents are
hostile: a sandbox or an image may hold symlinks to ``/``, ``..`` in names,
directories swapped for symlinks mid-walk, FIFOs that block a reader, names
that are not UTF-8.  Two rules keep the engine inside:

* a path given by a caller is resolved with ``openat2(RESOLVE_IN_ROOT)`` from
  a handle on the tree's root: symlinks and ``..`` resolve as if that root
  were ``/``, and magic links and other mounts are refused;
* a walk goes one directory fd at a time with ``O_NOFOLLOW``, so a directory
  replaced by a symlink fails to open instead of leading elsewhere.

Ownership is shifted by an :class:`IdShift`: uid ``u`` in a tar or on the
host becomes ``base + u`` (and nobody beyond the range), ``base`` being the
layers' range for a layer and a sandbox's own range for its tree.  Only the
engine's own trees (layers) are changed here as root; a sandbox's are
changed by the sandbox's file writer (sandbox_files.py).
"""

from __future__ import annotations

import errno
import os
import stat
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from .errors import EngineError, FileNotFound, InvalidPath, NotADirectory, NotAFile, TooLarge
from .kernel import (
    RESOLVE_IN_ROOT,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_XDEV,
    Kernel,
    KernelError,
    mount_id,
)

CHUNK = 256 * 1024
NOBODY = 65534
MAX_PATH = 4096
MAX_DEPTH = 256  # directories deep a walk goes; real trees stay well under
MAX_LISTED = 1_000_000  # entries of one directory a walk reads
WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"


def clean_path(path: str) -> str:
    """Validate a caller's path and make it relative to the tree root."""
    if not isinstance(path, str) or not path:
        raise InvalidPath("path must be a non-empty string", path=path)
    if "\0" in path or len(path.encode(errors="surrogateescape")) > MAX_PATH:
        raise InvalidPath("path holds a NUL byte or is too long", path=path[:200])
    parts = [part for part in path.split("/") if part not in ("", ".")]
    return "/".join(parts) or "."


def split_parent(relative: str) -> tuple[str, str]:
    parent, _, name = relative.rpartition("/")
    if name in ("", ".", ".."):
        raise InvalidPath("path must name an entry, not a directory reference", path="/" + relative)
    return parent or ".", name


def display_name(raw: str) -> str:
    """Names come from the sandbox: show undecodable bytes as U+FFFD."""
    return raw.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


@dataclass(frozen=True)
class IdShift:
    base: int
    count: int

    def outside(self, inside_id: int) -> int:
        return self.base + (inside_id if 0 <= inside_id < self.count else NOBODY)

    def inside(self, outside_id: int) -> int:
        return outside_id - self.base if self.base <= outside_id < self.base + self.count else NOBODY


def read_directory(dir_fd: int, path: str = ".") -> list[os.DirEntry[str]]:
    """The entries of a directory that may change while it is read, once each.

    A name read twice was renamed while we read (the kernel hands out a new
    position for it): it is kept once.  Should reading go on and on (a
    directory that changes faster than it can be read, or a kernel whose
    readdir then never ends, as tmpfs's did before Linux 6.13), it stops once
    it has read more duplicates than distinct names, with what it saw; past
    ``MAX_LISTED`` distinct names it is an error.  Either way it ends.
    """
    entries: dict[str, os.DirEntry[str]] = {}
    read = 0
    with os.scandir(dir_fd) as iterator:
        for item in iterator:
            read += 1
            entries.setdefault(item.name, item)
            if len(entries) > MAX_LISTED:
                raise TooLarge(f"{path} holds more than {MAX_LISTED} entries", path=path, limit=MAX_LISTED)
            if read > 2 * len(entries) + 1024:
                break  # changing faster than we read it: what we saw is what there is
    return [entries[name] for name in sorted(entries)]


def _entry_type(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "device"


class Tree:
    """A directory tree reached through ``root_fd`` (an O_PATH directory)."""

    def __init__(self, root_fd: int, shift: IdShift, kernel: Kernel | None = None, one_mount: bool = True) -> None:
        self.root_fd = root_fd
        self.shift = shift
        self.kernel = kernel or Kernel()
        self.resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | (RESOLVE_NO_XDEV if one_mount else 0)
        self.root_mount = mount_id(root_fd)

    # --- resolving -----------------------------------------------------------

    def open(self, path: str, flags: int, mode: int = 0) -> int:
        relative = clean_path(path)
        try:
            return self.kernel.openat2(self.root_fd, relative, flags | os.O_CLOEXEC, self.resolve, mode)
        except KernelError as error:
            raise self._translate(error, path) from None

    def _translate(self, error: OSError, path: str) -> Exception:
        if error.errno == errno.ENOENT:
            return FileNotFound(f"no such file or directory: {path}", path=path)
        if error.errno == errno.ENOTDIR:
            return NotADirectory(f"a component of the path is not a directory: {path}", path=path)
        if error.errno == errno.EISDIR:
            return NotAFile(f"{path} is a directory", path=path)
        if error.errno == errno.ENXIO:
            return NotAFile(f"{path} is a FIFO or socket, not a regular file", path=path)
        if error.errno == errno.EXDEV:
            return InvalidPath(f"{path} crosses into a special filesystem (/proc, /dev, /sys)", path=path)
        if error.errno == errno.ELOOP:
            return InvalidPath(f"too many levels of symbolic links: {path}", path=path)
        if error.errno == errno.ENAMETOOLONG:
            return InvalidPath(f"path too long: {path[:200]}", path=path[:200])
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            return TooLarge(f"the sandbox's disk is full (its size or its number of files) writing {path}", path=path)
        if error.errno == errno.ENOMEM:
            return TooLarge(f"the sandbox is out of memory writing {path}", path=path)
        return InvalidPath(f"{path}: {os.strerror(error.errno or errno.EIO)}", path=path)

    def parent(self, path: str) -> tuple[int, str]:
        """An O_PATH fd on the parent directory, and the final name."""
        parent, name = split_parent(clean_path(path))
        return self.open(parent, os.O_PATH | os.O_DIRECTORY), name

    # --- reading -------------------------------------------------------------

    def stat(self, path: str) -> dict[str, object]:
        """The entry at ``path`` itself: a symlink is described (with its target), not followed."""
        fd = self.open(path, os.O_PATH | os.O_NOFOLLOW)
        try:
            info = os.fstat(fd)
            link = os.readlink("", dir_fd=fd) if stat.S_ISLNK(info.st_mode) else None
        finally:
            os.close(fd)
        return self._describe(os.path.basename(clean_path(path)), info, link)

    def _describe(self, name: str, info: os.stat_result, link: str | None = None) -> dict[str, object]:
        entry: dict[str, object] = {
            "name": display_name(name),
            "type": _entry_type(info.st_mode),
            "size": info.st_size,
            "mode": stat.S_IMODE(info.st_mode),
            "uid": self.shift.inside(info.st_uid),
            "gid": self.shift.inside(info.st_gid),
            "mtime": info.st_mtime,
        }
        if link is not None:
            entry["link_target"] = display_name(link)
        return entry

    def list(self, path: str, limit: int = 10000) -> dict[str, object]:
        fd = self.open(path, os.O_RDONLY | os.O_DIRECTORY)
        entries: list[dict[str, object]] = []
        truncated = False
        try:
            with os.scandir(fd) as iterator:
                for item in iterator:
                    if len(entries) >= limit:
                        truncated = True
                        break
                    try:
                        info = os.stat(item.name, dir_fd=fd, follow_symlinks=False)
                        link = os.readlink(item.name, dir_fd=fd) if stat.S_ISLNK(info.st_mode) else None
                    except OSError:
                        continue  # it vanished while we looked
                    entries.append(self._describe(item.name, info, link))
        finally:
            os.close(fd)
        entries.sort(key=lambda entry: str(entry["name"]))
        return {"path": path, "entries": entries, "truncated": truncated}

    def open_regular(self, path: str) -> tuple[int, int]:
        """Open a regular file to read; (fd, size).  Never blocks on a FIFO."""
        fd = self.open(path, os.O_RDONLY | os.O_NONBLOCK)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            kind = _entry_type(info.st_mode)
            if kind == "directory":
                raise NotAFile(f"{path} is a directory: list it, or download it as a tar", path=path)
            raise NotAFile(f"{path} is a {kind}, not a regular file", path=path, type=kind)
        os.set_blocking(fd, True)
        return fd, info.st_size

    def read_bytes(self, path: str, limit: int) -> bytes:
        fd, size = self.open_regular(path)
        try:
            if size > limit:
                raise TooLarge(f"{path} is {size} bytes, over the {limit}-byte limit: read it as a stream", path=path, size=size)
            chunks = []
            remaining = limit + 1
            while remaining > 0 and (chunk := os.read(fd, min(CHUNK, remaining))):
                chunks.append(chunk)
                remaining -= len(chunk)
            data = b"".join(chunks)
            if len(data) > limit:
                raise TooLarge(f"{path} grew over the {limit}-byte limit while read", path=path)
            return data
        finally:
            os.close(fd)

    # --- writing -------------------------------------------------------------

    def _chown(self, fd: int, uid: int, gid: int) -> None:
        os.fchown(fd, self.shift.outside(uid), self.shift.outside(gid))

    def make_directories(self, path: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> None:
        """mkdir -p, one verified component at a time."""
        relative = clean_path(path)
        if relative == ".":
            return
        built = ""
        for part in relative.split("/"):
            if part == "..":
                raise InvalidPath("'..' is not allowed when creating directories", path=path)
            built = f"{built}/{part}" if built else part
            parent_fd, name = self.parent(built)
            try:
                os.mkdir(name, mode, dir_fd=parent_fd)
                # fchownat on the name we just made, never following a link.
                os.chown(name, self.shift.outside(uid), self.shift.outside(gid), dir_fd=parent_fd, follow_symlinks=False)
            except FileExistsError:
                pass
            except OSError as error:
                raise self._translate(error, "/" + built) from None
            finally:
                os.close(parent_fd)
        fd = self.open(relative, os.O_PATH | os.O_DIRECTORY)
        os.close(fd)

    def write(
        self,
        path: str,
        chunks: Callable[[], Iterator[bytes]] | bytes,
        mode: int = 0o644,
        uid: int = 0,
        gid: int = 0,
        limit: int | None = None,
        make_parents: bool = False,
        mtime: float | None = None,
    ) -> int:
        """Create or replace a regular file; returns bytes written."""
        relative = clean_path(path)
        if make_parents and "/" in relative:
            self.make_directories(relative.rsplit("/", 1)[0])
        fd = self.open(relative, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, mode & 0o7777)
        written = 0
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise NotAFile(f"{path} exists and is a {_entry_type(info.st_mode)}", path=path)
            os.set_blocking(fd, True)
            os.ftruncate(fd, 0)
            self._chown(fd, uid, gid)
            os.fchmod(fd, mode & 0o1777)  # no setuid/setgid from outside
            source = [chunks] if isinstance(chunks, bytes) else chunks()
            for chunk in source:
                if limit is not None and written + len(chunk) > limit:
                    raise TooLarge(f"{path}: more than {limit} bytes", path=path, limit=limit)
                view = memoryview(chunk)
                while view:
                    count = os.write(fd, view)
                    view = view[count:]
                    written += count
            if mtime is not None:
                os.utime(fd, (mtime, mtime))
        except OSError as error:
            raise self._translate(error, path) from None
        finally:
            os.close(fd)
        return written

    def replace_file(self, relative: str, chunks: Callable[[], Iterator[bytes]], mode: int, uid: int, gid: int,
                     mtime: float) -> int:  # fmt: skip
        """A tar member's file: it replaces a symlink or a file at its name
        (and an empty directory) rather than writing through it."""
        try:
            self.remove(relative)
        except (EngineError, OSError):
            pass  # nothing there, or a directory: write() reports the latter
        return self.write(relative, chunks, mode, uid, gid, mtime=mtime)

    def set_directory_mode(self, relative: str, mode: int) -> None:
        fd = self.open(relative, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)

    def symlink(self, path: str, target: str, uid: int = 0, gid: int = 0) -> None:
        parent_fd, name = self.parent(path)
        try:
            self._remove_entry(parent_fd, name)
            os.symlink(target, name, dir_fd=parent_fd)
            os.chown(name, self.shift.outside(uid), self.shift.outside(gid), dir_fd=parent_fd, follow_symlinks=False)
        except OSError as error:
            raise self._translate(error, path) from None
        finally:
            os.close(parent_fd)

    def hardlink(self, path: str, existing: str) -> None:
        source_parent, source_name = self.parent(existing)
        parent_fd, name = self.parent(path)
        try:
            self._remove_entry(parent_fd, name)
            os.link(source_name, name, src_dir_fd=source_parent, dst_dir_fd=parent_fd, follow_symlinks=False)
        except OSError as error:
            raise self._translate(error, path) from None
        finally:
            os.close(parent_fd)
            os.close(source_parent)

    def remove(self, path: str, recursive: bool = False) -> bool:
        parent_fd, name = self.parent(path)
        try:
            return self._remove_entry(parent_fd, name, recursive=recursive, must_be_empty=not recursive)
        except OSError as error:
            raise self._translate(error, path) from None
        finally:
            os.close(parent_fd)

    def rename(self, path: str, target: str, replace: bool = False) -> None:
        """Only a sandbox's file writer renames (sandbox_files.py)."""
        raise InvalidPath("this sandbox was made by an older engine: its files cannot be renamed", path=path)

    def clear_directory(self, path: str) -> None:
        """Remove everything inside ``path`` (an OCI opaque directory)."""
        fd = self.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for name in os.listdir(fd):
                self._remove_entry(fd, name, recursive=True)
        finally:
            os.close(fd)

    def _remove_entry(self, parent_fd: int, name: str, recursive: bool = True, must_be_empty: bool = False) -> bool:
        try:
            info = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(info.st_mode):
            os.unlink(name, dir_fd=parent_fd)
            return True
        if not recursive and must_be_empty:
            os.rmdir(name, dir_fd=parent_fd)
            return True
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
        try:
            if mount_id(fd) != self.root_mount:
                raise InvalidPath("refusing to remove a mount point", path=name)
            for child in os.listdir(fd):
                self._remove_entry(fd, child, recursive=True)
        finally:
            os.close(fd)
        os.rmdir(name, dir_fd=parent_fd)
        return True

    # --- tar streams -----------------------------------------------------------

    def tar_chunks(self, path: str) -> Iterator[bytes]:
        """A tar stream of the directory (or file) at ``path``, as it is walked.

        Headers are built one member at a time and file contents streamed in
        chunks, so a large tree never sits in memory.
        """
        relative = clean_path(path)
        fd = self.open(relative, os.O_RDONLY | os.O_NONBLOCK)
        try:
            info = os.fstat(fd)
            base = "." if relative == "." else os.path.basename(relative)
            if stat.S_ISDIR(info.st_mode):
                yield from self._tar_directory(fd, base, info, 0)
            elif stat.S_ISREG(info.st_mode):
                os.set_blocking(fd, True)
                yield from self._tar_file(fd, base, info)
            else:
                raise NotAFile(f"{path} is a {_entry_type(info.st_mode)}", path=path)
        finally:
            os.close(fd)
        yield tarfile.NUL * (2 * tarfile.BLOCKSIZE)

    def _header(self, name: str, info: os.stat_result, kind: bytes, size: int = 0, link: str = "") -> bytes:
        member = tarfile.TarInfo(name)
        member.type = kind
        member.mode = stat.S_IMODE(info.st_mode)
        member.uid = self.shift.inside(info.st_uid)
        member.gid = self.shift.inside(info.st_gid)
        member.mtime = int(info.st_mtime)
        member.size = size
        member.linkname = link
        return member.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")

    def _tar_file(self, fd: int, name: str, info: os.stat_result) -> Iterator[bytes]:
        size = info.st_size
        yield self._header(name, info, tarfile.REGTYPE, size)
        # The file may change while we read: send exactly what the header says.
        remaining = size
        while remaining > 0:
            chunk = os.read(fd, min(CHUNK, remaining)) or tarfile.NUL * min(CHUNK, remaining)
            remaining -= len(chunk)
            yield chunk
        padding = -size % tarfile.BLOCKSIZE
        if padding:
            yield tarfile.NUL * padding

    def _tar_directory(self, dir_fd: int, name: str, info: os.stat_result, depth: int) -> Iterator[bytes]:
        if depth > MAX_DEPTH:
            raise TooLarge(f"{display_name(name)} nests directories more than {MAX_DEPTH} deep", limit=MAX_DEPTH)
        yield self._header(name, info, tarfile.DIRTYPE)
        names = [item.name for item in read_directory(dir_fd, display_name(name))]
        for child in names:
            child_name = f"{name}/{child}"
            try:
                child_info = os.stat(child, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                continue
            mode = child_info.st_mode
            try:
                if stat.S_ISDIR(mode) and mount_id(dir_fd, child) != self.root_mount:
                    continue  # a mount point inside the tree (/proc, /dev): not part of it
            except KernelError:
                continue  # gone (renamed, removed) since we looked
            if stat.S_ISLNK(mode):
                try:
                    target = os.readlink(child, dir_fd=dir_fd)
                except OSError:
                    continue
                yield self._header(child_name, child_info, tarfile.SYMTYPE, link=target)
            elif stat.S_ISDIR(mode) or stat.S_ISREG(mode):
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                flags |= os.O_DIRECTORY if stat.S_ISDIR(mode) else 0
                try:
                    child_fd = os.open(child, flags, dir_fd=dir_fd)
                except OSError:
                    continue  # swapped for a symlink, or gone: skip it
                try:
                    opened = os.fstat(child_fd)
                    if (opened.st_ino, opened.st_dev) != (child_info.st_ino, child_info.st_dev):
                        continue
                    if stat.S_ISDIR(mode):
                        yield from self._tar_directory(child_fd, child_name, opened, depth + 1)
                    else:
                        os.set_blocking(child_fd, True)
                        yield from self._tar_file(child_fd, child_name, opened)
                finally:
                    os.close(child_fd)
            # FIFOs, sockets and devices are not content: left out.

    def extract(self, stream: IO[bytes], path: str, oci_whiteouts: bool = False) -> dict[str, Any]:
        """Unpack a tar stream under ``path``; returns counts of what it did.

        A member that cannot be unpacked (a ``..`` name, a device, a parent
        that resolves to nothing) is skipped and named in ``errors``: one bad
        member does not cost the rest.
        """
        self.make_directories(path)
        base = clean_path(path)
        counts: dict[str, Any] = {
            "files": 0,
            "directories": 0,
            "symlinks": 0,
            "hardlinks": 0,
            "skipped": 0,
            "whiteouts": 0,
            "bytes": 0,
        }
        errors: list[dict[str, str]] = []
        try:
            archive = tarfile.open(fileobj=stream, mode="r|*")
        except tarfile.TarError as error:
            raise InvalidPath(f"not a tar stream: {error}") from None
        with archive:
            try:
                for member in archive:
                    try:
                        reason = self._extract_member(archive, member, base, counts, oci_whiteouts)
                    except EngineError as error:
                        if isinstance(error, TooLarge):
                            raise
                        reason = error.message
                    if reason:
                        counts["skipped"] += 1
                        if len(errors) < 20:
                            errors.append({"name": display_name(member.name), "reason": reason})
            except tarfile.TarError as error:
                raise InvalidPath(f"broken tar stream: {error}") from None
        counts["errors"] = errors
        return counts

    def _extract_member(
        self, archive: tarfile.TarFile, member: tarfile.TarInfo, base: str, counts: dict[str, Any], oci: bool
    ) -> str:
        """Unpack one member; returns why it was skipped, or ''."""
        parts = [part for part in member.name.split("/") if part not in ("", ".")]
        if any(part == ".." for part in parts) or "\0" in member.name:
            return "'..' in the name"
        if not parts:
            return ""  # the root itself
        relative = "/".join(([] if base == "." else [base]) + parts)
        name = parts[-1]
        if oci and name.startswith(WHITEOUT_PREFIX):
            counts["whiteouts"] += 1
            return ""  # applied by the caller in a first pass
        parent = relative.rsplit("/", 1)[0] if "/" in relative else "."
        if parent != ".":
            self.make_directories(parent)
        if member.isdir():
            self.make_directories(relative, 0o755, member.uid, member.gid)
            self.set_directory_mode(relative, member.mode & 0o1777)
            counts["directories"] += 1
        elif member.isreg():
            source = archive.extractfile(member)
            assert source is not None

            def chunks() -> Iterator[bytes]:
                while chunk := source.read(CHUNK):
                    yield chunk

            counts["bytes"] += self.replace_file(relative, chunks, member.mode, member.uid, member.gid, member.mtime)
            counts["files"] += 1
        elif member.issym():
            self.symlink(relative, member.linkname, member.uid, member.gid)
            counts["symlinks"] += 1
        elif member.islnk():
            target_parts = [part for part in member.linkname.split("/") if part not in ("", ".")]
            if any(part == ".." for part in target_parts):
                return "hard link target has '..'"
            target = "/".join(([] if base == "." else [base]) + target_parts)
            self.hardlink(relative, target)
            counts["hardlinks"] += 1
        else:
            return "devices and FIFOs are not accepted"
        return ""

    def oci_whiteouts(self, stream: IO[bytes], path: str = ".") -> int:
        """First pass over an OCI layer: apply its whiteouts to what is below."""
        applied = 0
        base = clean_path(path)
        with tarfile.open(fileobj=stream, mode="r|*") as archive:
            for member in archive:
                parts = [part for part in member.name.split("/") if part not in ("", ".")]
                if not parts or any(part == ".." for part in parts) or not parts[-1].startswith(WHITEOUT_PREFIX):
                    continue
                directory = "/".join(([] if base == "." else [base]) + parts[:-1]) or "."
                try:
                    if parts[-1] == OPAQUE_MARKER:
                        self.clear_directory(directory)
                    else:
                        hidden = parts[-1][len(WHITEOUT_PREFIX) :]
                        self.remove(f"{directory}/{hidden}" if directory != "." else hidden, recursive=True)
                    applied += 1
                except (FileNotFound, NotADirectory):
                    pass
        return applied
