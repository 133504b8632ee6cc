"""The spawner's side of the zygote (``native/zygote.c``): start it, and speak its protocol.

The zygote is the native program, started by the spawner from its sealed
memfd with one end of a SOCK_SEQPACKET socket pair as fd 3.  Every message is
NUL-terminated text fields; see zygote.c for the grammar.  This module is the
only place that writes or reads them.
"""

from __future__ import annotations

import array
import errno
import fcntl
import functools
import os
import socket
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from . import rootfs

CONFIG_TIMEOUT_S = 10.0
MAX_REPLY = 16384


class Reply(NamedTuple):
    token: int
    pid: int  # 0 when no child was cloned
    error: dict[str, Any] | None


def failure(step: str, number: int, target: str) -> dict[str, Any]:
    """A failed step as the engine reports it (CreateFailed names step and target)."""
    message = f"{step} failed" + (f" on {target}" if target else "") + f": {os.strerror(number)}"
    return {"step": step, "errno": number, "target": target, "message": message}


def encode_fields(values: Sequence[str | int]) -> bytes:
    encoded = []
    for value in values:
        raw = os.fsencode(str(value))
        if b"\0" in raw:
            raise ValueError(f"a NUL byte in {raw[:64]!r}")
        encoded.append(raw + b"\0")
    return b"".join(encoded)


@functools.lru_cache(maxsize=256)
def encoded_plan(spec: rootfs.RootfsSpec) -> bytes:
    """The plan's fields; the same for every sandbox of a template and size, so cached."""
    steps = rootfs.plan(spec)
    values: list[str | int] = [len(steps)]
    for step in steps:
        values += [step.op, step.within, step.target, step.source, step.fstype, step.data, step.flags, step.mode, step.missing]
    return encode_fields(values)


def encode_spawn(
    token: int,
    hostname: str,
    uid_base: int,
    uid_count: int,
    layers_uid: int,
    nofile: int,
    cgroup_procs: Sequence[str],
    layers: Sequence[str],
    plan: bytes,
    resolv: str = "",
) -> bytes:
    """``uid_base``: the sandbox's own range (root inside); ``layers_uid``: the
    range that owns ``layers`` (host paths, topmost first) on disk; ``resolv``:
    its /etc/resolv.conf, written beside its /etc/hosts ("": none)."""
    fields: list[str | int] = ["spawn", token, hostname, resolv, uid_base, uid_count, layers_uid, nofile]
    fields += [len(cgroup_procs), *cgroup_procs, len(layers), *layers]
    return encode_fields(fields) + plan


def _split(raw: bytes) -> list[str]:
    if not raw.endswith(b"\0"):
        raise ValueError("a message must end in NUL")
    return [os.fsdecode(field) for field in raw[:-1].split(b"\0")]


def decode_reply(raw: bytes) -> Reply:
    """``ok token pid`` or ``error token pid step errno target``."""
    fields = _split(raw)
    if fields[0] == "ok" and len(fields) == 3:
        return Reply(int(fields[1]) if fields[1].isdigit() else 0, int(fields[2]), None)
    if fields[0] == "error" and len(fields) == 6:
        token = int(fields[1]) if fields[1].isdigit() else 0
        return Reply(token, int(fields[2]), failure(fields[3], int(fields[4]), fields[5]))
    raise ValueError(f"unexpected reply from the zygote: {raw[:200]!r}")


def decode_report(data: bytes) -> dict[str, Any]:
    """What a sandbox's child wrote on its ready pipe before it died: 'E' step errno target."""
    try:
        step, number, target = _split(data[1:])[:3]
        return failure(step, int(number), target)
    except ValueError:
        return {"step": "unknown", "errno": errno.EIO, "target": "", "message": data.decode(errors="replace")[:4000]}


class Zygote:
    """A running zygote: its pid (the spawner reaps it) and our end of its socket."""

    def __init__(self, pid: int, connection: socket.socket) -> None:
        self.pid = pid
        self.socket = connection
        self.closed = False  # it went away (EOF, or a broken pipe): talk to the next one

    @classmethod
    def start(cls, binary_fd: int, kept_capabilities: int, seccomp_program: str) -> Zygote:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Both above fd 3, which the child's dup2 fills: dup2 onto the same
        # number would leave close-on-exec set, and the binary must still be
        # there when exec opens it.
        executable = fcntl.fcntl(binary_fd, fcntl.F_DUPFD_CLOEXEC, 4)
        try:
            if theirs.fileno() == 3:
                moved = fcntl.fcntl(theirs.fileno(), fcntl.F_DUPFD_CLOEXEC, 4)
                theirs.close()
                theirs = socket.socket(fileno=moved)
            # Executed through the memfd: every sandbox's /proc/1/exe is then a
            # sealed file nobody can write.  (The zygote resets the signal
            # dispositions it inherits from us itself.)
            pid = os.posix_spawn(
                f"/proc/self/fd/{executable}",
                ["forkyard-init"],
                {},
                file_actions=[(os.POSIX_SPAWN_DUP2, theirs.fileno(), 3)],
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            os.close(executable)
        zygote = cls(pid, ours)
        try:
            zygote._configure(kept_capabilities, seccomp_program)
        except BaseException:
            zygote.close()
            raise
        return zygote

    def _configure(self, kept_capabilities: int, seccomp_program: str) -> None:
        program = os.open(seccomp_program, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.socket.sendmsg([encode_fields(["config", kept_capabilities])], [fd_rights([program])])
        finally:
            os.close(program)
        self.socket.settimeout(CONFIG_TIMEOUT_S)
        try:
            raw = self.socket.recv(MAX_REPLY)
        finally:
            self.socket.setblocking(False)
        if not raw:
            raise OSError(errno.ECHILD, "the zygote exited at start")
        reply = decode_reply(raw)
        if reply.error:
            raise OSError(reply.error["errno"], reply.error["message"])

    def spawn(self, message: bytes, listen_fd: int, ready_fd: int) -> None:
        """Hand one sandbox over; the answer comes through :meth:`replies`."""
        self.socket.sendmsg([message], [fd_rights([listen_fd, ready_fd])])

    def replies(self) -> Iterator[Reply]:
        """The replies waiting now.  Raises EOFError once the zygote has gone."""
        while True:
            try:
                raw = self.socket.recv(MAX_REPLY)
            except BlockingIOError:
                return
            if not raw:
                raise EOFError("the zygote closed its socket")
            yield decode_reply(raw)

    def close(self) -> None:
        """The zygote exits when it sees its socket close."""
        self.closed = True
        self.socket.close()


def fd_rights(fds: Sequence[int]) -> tuple[int, int, bytes]:
    return (socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())
