"""A sandbox's files, changed by a process of the sandbox: the engine's side of ``native/files.c``.

Memory is charged to the memory cgroup of whoever allocates it.  The engine
used to write a sandbox's files from its own threads, so the pages of the
writable layer (a tmpfs in the sandbox's memory cgroup), the page cache and
the inodes went to the engine's cgroup: a 110 MiB upload into a 128 MiB
sandbox left the sandbox's counters at zero.  Now every change the file API
makes (write, upload, mkdir, remove) is made by the sandbox's *file writer*,
a child of its init that init forks for each call: it sits in the sandbox's
cgroups, namespaces and root, so what it writes counts against the sandbox's
memory and its tmpfs's size and inode limits, and it reaches only what the
sandbox reaches.

The engine still does everything that only reads (stat, list, read,
download: :class:`.trees.Tree`) and parses uploads (tar); it sends the writer
one small request per change, and a file's content through a pipe.  Paths are
resolved by the writer exactly as ``Tree`` resolves them (``openat2`` with
``RESOLVE_IN_ROOT``, no magic links, no other mounts).

A write that does not fit fails cleanly: the writer is the OOM killer's
first choice in the sandbox, the engine holds the file being written (the
writer hands it over once opened) and empties it, and the sandbox's own
processes run on.
"""

from __future__ import annotations

import array
import errno
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

from .errors import EngineError, FileExists, InvalidPath, NotADirectory, NotAFile, SandboxNotRunning, TooLarge
from .kernel import RESOLVE_NO_SYMLINKS, Kernel, KernelError
from .trees import IdShift, Tree, clean_path, split_parent

# struct file_request (files.c): op, mode, uid, gid, flags, mtime in nanoseconds.
REQUEST = struct.Struct("=c3xIIIIxxxxq")
FILE_REPLACE, FILE_MTIME, FILE_RECURSIVE = 1, 2, 4
MAX_REPLY = 8192
# How long the engine waits for a writer to answer or take more content.  A
# writer is a process of the sandbox: sandbox code can stop it (SIGSTOP), and
# a worker thread of the engine must not wait on it forever.
WRITER_TIMEOUT_S = 30.0
MOUNT_POINT = "mount point"  # what the writer says of a directory it will not remove (or rename)
TARGET = "target"  # a rename's target, not its source, is in the way
TARGET_PATH = "target path"  # a rename's target's parent could not be opened


class Reply(NamedTuple):
    kind: str  # 'O' opened (with fd), 'K' done (value), 'E' failed (value is the errno)
    value: int
    text: str
    fd: int | None


class WriterGone(Exception):
    """The writer's connection ended before it answered."""


class FileWriter:
    """One connection to a sandbox's init, handed to a new file writer."""

    def __init__(self, socket_path: str, sandbox_id: str) -> None:
        self.sandbox_id = sandbox_id
        self.socket_path = socket_path
        self.settled = True  # every request sent has had its last answer read: the next may follow
        self.served = 0  # calls served, this one included (a kept writer serves several)
        self.oom_kills = 0  # the sandbox's OOM kills when this writer started: did the kernel end it?
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.socket.settimeout(WRITER_TIMEOUT_S)
        try:
            self.socket.connect(socket_path)
            self.socket.send(b"F")
        except OSError as error:
            self.socket.close()
            raise SandboxNotRunning(f"sandbox {sandbox_id} is not running", sandbox=sandbox_id) from error

    def close(self) -> None:
        self.socket.close()

    def send(self, op: str, path: str, text: str = "", *, mode: int = 0, uid: int = 0, gid: int = 0,
             flags: int = 0, mtime_ns: int = 0, fd: int | None = None) -> None:  # fmt: skip
        body = REQUEST.pack(op.encode(), mode, uid, gid, flags, mtime_ns) + os.fsencode(path) + b"\0"
        if text:
            body += os.fsencode(text) + b"\0"
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())] if fd is not None else []
        self.settled = False
        try:
            self.socket.sendmsg([body], rights)
        except OSError as error:
            raise WriterGone(str(error)) from error

    def reply(self) -> Reply:
        try:
            data, ancillary, _, _ = self.socket.recvmsg(MAX_REPLY, socket.CMSG_SPACE(4), socket.MSG_CMSG_CLOEXEC)
        except OSError as error:
            raise WriterGone(str(error)) from error
        fd = None
        for level, message_type, payload in ancillary:
            if level == socket.SOL_SOCKET and message_type == socket.SCM_RIGHTS and len(payload) >= 4:
                fd = array.array("i", payload[:4])[0]
        if not data:
            raise WriterGone("the connection ended")
        kind = chr(data[0])
        if kind == "K" and len(data) == 9:
            return Reply("K", struct.unpack_from("=q", data, 1)[0], "", fd)
        if kind == "E" and len(data) >= 6:
            return Reply("E", struct.unpack_from("=i", data, 1)[0], os.fsdecode(data[5:].split(b"\0", 1)[0]), fd)
        if kind == "O":
            return Reply("O", 0, "", fd)
        if kind == "F" and len(data) >= 5:  # init could not start a writer
            return Reply("E", struct.unpack_from("=i", data, 1)[0], "", fd)
        if fd is not None:
            os.close(fd)
        raise WriterGone(f"an answer the engine does not know: {data[:16]!r}")

    def refusal(self) -> int | None:
        """The errno with which init refused to start this writer (it answers
        'F' and closes the connection: the first request may then fail to go)."""
        try:
            data = self.socket.recv(MAX_REPLY, socket.MSG_DONTWAIT)
        except OSError:
            return None
        return int(struct.unpack_from("=i", data, 1)[0]) if data[:1] == b"F" and len(data) >= 5 else None


def _feed(fd: int, chunk: bytes, path: str) -> int:
    """Write all of ``chunk`` into the (non-blocking) pipe, waiting at most
    WRITER_TIMEOUT_S each time the writer has not made room."""
    view = memoryview(chunk)
    written = 0
    while view:
        try:
            count = os.write(fd, view)
        except BlockingIOError:
            waiting = select.poll()  # not select(): the engine's fds run past FD_SETSIZE
            waiting.register(fd, select.POLLOUT)
            if not waiting.poll(WRITER_TIMEOUT_S * 1000):
                raise EngineError(
                    f"the sandbox's file writer took no content for {WRITER_TIMEOUT_S:g}s writing {path}", path=path
                ) from None
            continue
        view = view[count:]
        written += count
    return written


class IdleWriters:
    """Writers kept a moment between calls, one per sandbox, so that a burst of
    small writes pays for one writer, not one each (a writer is a process of
    the sandbox: its few pages are the sandbox's, and it shows in its ``ps``).

    Thread-safe: calls take and give back writers from worker threads.
    """

    def __init__(self, idle_s: float = 2.0) -> None:
        self.idle_s = idle_s
        self._idle: dict[str, tuple[FileWriter, float]] = {}
        self._lock = threading.Lock()

    def take(self, sandbox_id: str, socket_path: str) -> FileWriter:
        with self._lock:
            kept = self._idle.pop(sandbox_id, None)
        if kept is not None:
            writer, deadline = kept
            if deadline > time.monotonic() and writer.socket_path == socket_path:
                writer.served += 1
                return writer
            writer.close()
        writer = FileWriter(socket_path, sandbox_id)
        writer.served = 1
        return writer

    def give_back(self, writer: FileWriter) -> None:
        """Keep it if it is ready for another request; otherwise close it."""
        closing = [] if writer.settled else [writer]
        with self._lock:
            if writer.settled:
                previous = self._idle.get(writer.sandbox_id)
                if previous is not None:
                    closing.append(previous[0])
                self._idle[writer.sandbox_id] = (writer, time.monotonic() + self.idle_s)
        for each in closing:
            each.close()
        self.expire()

    def forget(self, sandbox_id: str) -> None:
        with self._lock:
            kept = self._idle.pop(sandbox_id, None)
        if kept is not None:
            kept[0].close()

    def expire(self) -> int:
        now = time.monotonic()
        with self._lock:
            expired = [sandbox for sandbox, (_, deadline) in self._idle.items() if deadline <= now]
            writers = [self._idle.pop(sandbox)[0] for sandbox in expired]
        for writer in writers:
            writer.close()  # it sees its connection end, and exits
        return len(writers)

    def close_all(self) -> None:
        with self._lock:
            writers = [writer for writer, _ in self._idle.values()]
            self._idle.clear()
        for writer in writers:
            writer.close()


class SandboxTree(Tree):
    """A sandbox's tree: read by the engine, changed by the sandbox's file writer."""

    def __init__(
        self,
        root_fd: int,
        shift: IdShift,
        writer: FileWriter,
        kernel: Kernel | None = None,
        oom_kills: Callable[[], int] = lambda: 0,
        new_writer: Callable[[], FileWriter] | None = None,
    ) -> None:
        super().__init__(root_fd, shift, kernel)
        self.writer = writer
        self.oom_kills = oom_kills  # the sandbox's OOM kills now (compared with the writer's start)
        self.new_writer = new_writer  # for a kept writer found gone (the sandbox may kill it while it waits)
        self.made: set[str] = set()  # directories made in this call: an upload asks for each once
        self.answered = False  # the writer has answered a request of this call

    # --- talking to the writer ------------------------------------------------------

    def _send(self, op: str, path: str, text: str = "", **fields: int) -> None:
        """Send one request.  A writer kept from an earlier call may have gone
        meanwhile: if it cannot even take the first request, a new one does."""
        try:
            self.writer.send(op, path, text, **fields)
        except WriterGone:
            if self.answered or self.writer.served <= 1 or self.new_writer is None:
                raise
            self.writer.close()
            self.writer = self.new_writer()
            self.writer.send(op, path, text, **fields)

    def _reply(self, last: bool = True) -> Reply:
        reply = self.writer.reply()
        self.answered = True
        if last or reply.kind == "E":
            self.writer.settled = True
        return reply

    def _gone(self, path: str) -> EngineError:
        refused = None if self.answered else self.writer.refusal()
        if refused is not None:
            return self._failure(Reply("E", refused, "", None), path)
        if self.oom_kills() > self.writer.oom_kills:
            return TooLarge(f"the sandbox ran out of memory writing {path}: it holds no more than its memory limit", path=path)
        return EngineError(f"the sandbox's file writer ended before it answered for {path}", path=path)

    def _failure(self, reply: Reply, path: str) -> EngineError:
        if reply.value == errno.ENOMEM:
            return TooLarge(f"the sandbox is out of memory writing {path}", path=path)
        if reply.value == errno.EAGAIN and not reply.text:
            return EngineError(f"the sandbox is at its process limit: no file writer could start for {path}", path=path)
        translated = self._translate(OSError(reply.value, os.strerror(reply.value)), path)
        assert isinstance(translated, EngineError)
        return translated

    def _call(self, op: str, path: str, shown: str, text: str = "", **fields: int) -> int:
        try:
            self._send(op, path, text, **fields)
            reply = self._reply()
        except WriterGone:
            raise self._gone(shown) from None
        if reply.fd is not None:
            os.close(reply.fd)
        if reply.kind == "E":
            raise self._failure(reply, shown)
        return reply.value

    # --- the changes ---------------------------------------------------------------------

    def make_directories(self, path: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> None:
        """mkdir -p, one verified component at a time (by the writer)."""
        relative = clean_path(path)
        if relative == "." or relative in self.made:
            return
        if ".." in relative.split("/"):
            raise InvalidPath("'..' is not allowed when creating directories", path=path)
        if self._directory_there(relative):
            self.made.add(relative)  # nothing to make: a round trip to the writer saved (every SDK write asks)
            return
        try:
            self._send("D", relative, mode=mode, uid=uid, gid=gid)
            reply = self._reply()
        except WriterGone:
            raise self._gone(path) from None
        if reply.kind == "E":
            # The writer names the component that failed, as Tree does.
            raise self._failure(reply, "/" + reply.text if reply.text else path)
        self.made.add(relative)

    def _directory_there(self, relative: str) -> bool:
        """Is every component of ``relative`` a directory already, reached without a symlink? Then the
        writer's mkdir -p would make nothing and find the same directory; anything else (a missing
        component, a symlink, another mount) is left to the writer, whose answer is the one that counts."""
        try:
            fd = self.kernel.openat2(
                self.root_fd, relative, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, self.resolve | RESOLVE_NO_SYMLINKS
            )
        except KernelError:
            return False
        os.close(fd)
        return True

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
        replace: bool = False,
    ) -> int:
        """Create or replace a regular file; returns bytes written.  The content
        goes through a pipe, written by the sandbox's writer as it arrives."""
        relative = clean_path(path)
        if make_parents and "/" in relative:
            self.make_directories(relative.rsplit("/", 1)[0])
        flags = (FILE_REPLACE if replace else 0) | (FILE_MTIME if mtime is not None else 0)
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(write_end, False)
        opened: list[int] = []  # the file the writer opened: ours to empty if this write fails
        try:
            try:
                return self._stream(path, relative, chunks, mode, uid, gid, flags, mtime, limit, read_end, write_end, opened)
            except WriterGone:
                raise self._gone(path) from None
        except BaseException:
            for fd in opened:
                # What a failed write put there would hold the sandbox's memory
                # (a tmpfs cannot be reclaimed): the file is left empty instead.
                try:
                    os.ftruncate(fd, 0)
                except OSError:
                    pass
            raise
        finally:
            for fd in opened:
                os.close(fd)

    def _stream(
        self,
        path: str,
        relative: str,
        chunks: Callable[[], Iterator[bytes]] | bytes,
        mode: int,
        uid: int,
        gid: int,
        flags: int,
        mtime: float | None,
        limit: int | None,
        read_end: int,
        write_end: int,
        opened: list[int],
    ) -> int:
        """One 'W' request: the content through the pipe, then the writer's
        answers (read only once the content is sent: one wait, not two)."""
        try:
            try:
                self._send(
                    "W", relative, mode=mode & 0o7777, uid=uid, gid=gid, flags=flags,
                    mtime_ns=round((mtime or 0) * 1e9), fd=read_end,
                )  # fmt: skip
            finally:
                os.close(read_end)
            failure: BaseException | None = None
            written = 0
            try:
                source = [chunks] if isinstance(chunks, bytes) else chunks()
                for chunk in source:
                    if limit is not None and written + len(chunk) > limit:
                        raise TooLarge(f"{path}: more than {limit} bytes", path=path, limit=limit)
                    written += _feed(write_end, chunk, path)
            except BrokenPipeError:
                pass  # the writer stopped reading (it could not open the file, or not write it): it says why
            except BaseException as error:  # noqa: BLE001 - raised below, once the writer has answered
                failure = error
            os.close(write_end)
            write_end = -1
            first = self._reply(last=False)
            if first.fd is not None:
                opened.append(first.fd)
            if first.kind == "E":
                if failure is not None:
                    raise failure
                if first.text in ("directory", "fifo", "socket", "symlink", "device"):
                    raise NotAFile(f"{path} exists and is a {first.text}", path=path)
                raise self._failure(first, path)
            last = self._reply()  # the writer's account of what it wrote
            if failure is not None:
                raise failure
            if last.kind == "E":
                raise self._failure(last, path)
            return last.value
        finally:
            if write_end >= 0:
                os.close(write_end)

    def replace_file(self, relative: str, chunks: Callable[[], Iterator[bytes]], mode: int, uid: int, gid: int,
                     mtime: float) -> int:  # fmt: skip
        return self.write(relative, chunks, mode, uid, gid, mtime=mtime, replace=True)

    def set_directory_mode(self, relative: str, mode: int) -> None:
        self._call("M", relative, "/" + relative, mode=mode)

    def symlink(self, path: str, target: str, uid: int = 0, gid: int = 0) -> None:
        self._call("L", clean_path(path), path, target, uid=uid, gid=gid)

    def hardlink(self, path: str, existing: str) -> None:
        self._call("H", clean_path(path), path, clean_path(existing))

    def remove(self, path: str, recursive: bool = False) -> bool:
        relative = clean_path(path)
        try:
            self._send("R", relative, flags=FILE_RECURSIVE if recursive else 0)
            reply = self._reply()
        except WriterGone:
            raise self._gone(path) from None
        if reply.kind == "E":
            if reply.text == MOUNT_POINT:
                raise InvalidPath("refusing to remove a mount point", path=path)
            raise self._failure(reply, path)
        return bool(reply.value)

    def rename(self, path: str, target: str, replace: bool = False) -> None:
        """Rename ``path`` to ``target`` (both in the sandbox's root); without
        ``replace``, refuse if something is at ``target`` (``file_exists``)."""
        relative, relative_target = clean_path(path), clean_path(target)
        split_parent(relative)
        split_parent(relative_target)  # neither may be the root, '.' or '..'
        try:
            self._send("N", relative, relative_target, flags=FILE_REPLACE if replace else 0)
            reply = self._reply()
        except WriterGone:
            raise self._gone(path) from None
        if reply.kind == "K":
            return
        error, shown = reply.value, target if reply.text in (TARGET, TARGET_PATH) else path
        if reply.text == TARGET_PATH:
            raise self._failure(reply, shown)
        if reply.text == MOUNT_POINT:
            raise InvalidPath(f"{path} or {target} is a mount point or on another mount: it cannot be renamed", path=path)
        if error == errno.EEXIST:
            raise FileExists(f"{target} exists: pass replace to rename over it", path=target)
        if error == errno.ENOTEMPTY:
            raise FileExists(f"{target} is a directory that is not empty", path=target)
        if error == errno.EISDIR:
            raise NotAFile(f"{target} is a directory: a file cannot replace it", path=target)
        if error == errno.ENOTDIR and reply.text == TARGET:
            raise NotADirectory(f"{target} is not a directory: a directory cannot replace it", path=target)
        if error == errno.EINVAL:
            raise InvalidPath(f"{path} cannot be moved into itself ({target})", path=path)
        raise self._failure(reply, shown)

    def clear_directory(self, path: str) -> None:
        relative = clean_path(path)
        fd = self.open(relative, os.O_RDONLY | os.O_DIRECTORY)
        try:
            names = os.listdir(fd)
        finally:
            os.close(fd)
        for name in names:
            self.remove(f"{relative}/{name}" if relative != "." else name, recursive=True)
