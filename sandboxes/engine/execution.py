"""Running a command in a sandbox: the engine's side of the init protocol.

Exec, in the order the code runs it:

1. Connect to the sandbox's control socket (a host path only the engine can
   reach; its init accepts on it).
2. Make three pipes and send init the request (cwd, argv, env) with the
   command's ends of the pipes attached (SCM_RIGHTS).  The command therefore
   writes straight into pipes the engine reads: no copy through init.
3. init vforks, puts the child in a new session, points stdio at the pipes,
   chdirs and execs.  It answers 'S' (started) or 'F' (could not start).
4. The engine feeds stdin, reads stdout and stderr up to the cap (and counts
   what it drops), and waits for 'W' (the wait status).
5. On timeout it sends 'K': init SIGKILLs the command's process group.  The
   result says ``timed_out``; a timeout is a result, not an error.
6. After 'W' it drains what is already in the pipes and returns.  A
   background process that keeps the pipes open does not hold the exec.

Every exec'd process descends from init, so it has exactly the sandbox's
confinement: namespaces, cgroup, uid, capabilities, no_new_privs, seccomp.
"""

from __future__ import annotations

import array
import asyncio
import errno
import os
import signal
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidRequest, SandboxNotRunning, TooLarge

MAX_REQUEST_BYTES = 256 * 1024 - 64
READ_CHUNK = 65536
KILL_GRACE_S = 2.0
OutputCallback = Callable[[str, bytes], None]


@dataclass(frozen=True)
class ExecRequest:
    argv: list[str]
    cwd: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    stdin: bytes = b""
    timeout_s: float = 60.0
    max_output_bytes: int = 1 << 20

    def encode(self) -> bytes:
        strings = [self.cwd, *self.argv, *(f"{key}={value}" for key, value in self.env.items())]
        body = b"".join(item.encode("utf-8", "surrogateescape") + b"\0" for item in strings)
        message = b"X\0\0\0" + struct.pack("=III", len(self.argv), len(self.env), 0) + body
        if len(message) > MAX_REQUEST_BYTES:
            raise TooLarge(f"argv and env together exceed {MAX_REQUEST_BYTES} bytes", field="cmd")
        return message


@dataclass
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    duration_ms: float
    timed_out: bool = False
    signal: int | None = None
    oom_killed: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    pid: int = 0

    def summary(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "duration_ms": round(self.duration_ms, 3),
            "timed_out": self.timed_out,
            "signal": self.signal,
            "oom_killed": self.oom_killed,
            "stdout_truncated": self.stdout_truncated,
            "stderr_truncated": self.stderr_truncated,
            "stdout_bytes": self.stdout_bytes,
            "stderr_bytes": self.stderr_bytes,
        }


class _Output:
    def __init__(self, name: str, cap: int, on_output: OutputCallback | None) -> None:
        self.name = name
        self.cap = cap
        self.chunks: list[bytes] = []
        self.kept = 0
        self.total = 0
        self.on_output = on_output

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.cap - self.kept
        if room <= 0:
            return
        piece = data[:room]
        self.kept += len(piece)
        if self.on_output is not None:
            self.on_output(self.name, piece)
        else:
            self.chunks.append(piece)

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)

    @property
    def truncated(self) -> bool:
        return self.total > self.kept


def validate_argv(command: Any) -> list[str]:
    """A shell string becomes ``sh -c``; a list must be non-empty strings."""
    if isinstance(command, str):
        if not command.strip():
            raise InvalidRequest("cmd is an empty string", field="cmd")
        return ["/bin/sh", "-c", command]
    if not isinstance(command, list) or not command:
        raise InvalidRequest("cmd must be a string (run by /bin/sh) or a non-empty list of strings", field="cmd")
    for item in command:
        if not isinstance(item, str):
            raise InvalidRequest("every item of cmd must be a string", field="cmd")
        if "\0" in item:
            raise InvalidRequest("cmd holds a NUL byte", field="cmd")
    if not command[0]:
        raise InvalidRequest("cmd[0] is empty", field="cmd")
    return list(command)


def validate_env(env: Any, field_name: str = "env") -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise InvalidRequest(f"{field_name} must be an object of strings", field=field_name)
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidRequest(f"{field_name} keys and values must be strings", field=field_name)
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise InvalidRequest(f"{field_name} has an invalid name or a NUL byte: {key[:50]!r}", field=field_name)
    return dict(env)


async def run(socket_path: str, request: ExecRequest, on_output: OutputCallback | None = None) -> ExecResult:
    """Run one command through the sandbox's init; see the module docstring."""
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    message = request.encode()
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    ours: list[int] = []
    theirs: list[int] = []
    try:
        try:
            await loop.sock_connect(connection, socket_path)
        except (FileNotFoundError, ConnectionRefusedError) as error:
            raise SandboxNotRunning("the sandbox is not running (its init does not answer)", step="connect") from error
        stdin_read, stdin_write = os.pipe2(os.O_CLOEXEC)
        ours.append(stdin_write)
        theirs.append(stdin_read)
        for _ in ("stdout", "stderr"):
            read_end, write_end = os.pipe2(os.O_CLOEXEC)
            ours.append(read_end)
            theirs.append(write_end)
        for fd in ours:
            os.set_blocking(fd, False)
        try:
            connection.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", theirs))])
        except OSError as error:
            raise SandboxNotRunning(f"the sandbox's init refused the request: {error.strerror}", step="send") from error
        for fd in theirs:
            os.close(fd)
        theirs.clear()
        return await _supervise(loop, connection, request, ours, started, on_output)
    finally:
        for fd in theirs + ours:
            try:
                os.close(fd)
            except OSError:
                pass
        connection.close()


async def _supervise(
    loop: asyncio.AbstractEventLoop,
    connection: socket.socket,
    request: ExecRequest,
    fds: list[int],
    started: float,
    on_output: OutputCallback | None,
) -> ExecResult:
    stdin_write, stdout_read, stderr_read = fds
    outputs = {
        stdout_read: _Output("stdout", request.max_output_bytes, on_output),
        stderr_read: _Output("stderr", request.max_output_bytes, on_output),
    }
    finished: asyncio.Future[tuple[str, int, int]] = loop.create_future()
    state = {"pid": 0, "timed_out": False}
    open_readers = set(outputs)

    def read_output(fd: int) -> None:
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            outputs[fd].add(data)
        else:
            loop.remove_reader(fd)
            open_readers.discard(fd)

    def read_control() -> None:
        try:
            reply = connection.recv(64)
        except BlockingIOError:
            return
        except OSError:
            reply = b""
        if finished.done():
            return
        if not reply:
            finished.set_result(("gone", 0, 0))
        elif reply[:1] == b"S" and len(reply) >= 5:
            state["pid"] = struct.unpack("=i", reply[1:5])[0]
        elif reply[:1] == b"W" and len(reply) >= 5:
            finished.set_result(("exited", struct.unpack("=i", reply[1:5])[0], 0))
        elif reply[:1] == b"F" and len(reply) >= 6:
            finished.set_result(("failed", struct.unpack("=i", reply[1:5])[0], reply[5]))

    stdin_view = memoryview(request.stdin)

    def write_stdin() -> None:
        nonlocal stdin_view
        try:
            count = os.write(stdin_write, stdin_view[:READ_CHUNK])
            stdin_view = stdin_view[count:]
        except BlockingIOError:
            return
        except OSError:
            stdin_view = stdin_view[:0]  # the command closed its stdin: fine
        if not stdin_view:
            loop.remove_writer(stdin_write)
            os.close(stdin_write)
            fds[0] = -1

    for fd in outputs:
        loop.add_reader(fd, read_output, fd)
    loop.add_reader(connection.fileno(), read_control)
    if request.stdin:
        loop.add_writer(stdin_write, write_stdin)
    else:
        os.close(stdin_write)
        fds[0] = -1

    def kill() -> None:
        if not finished.done():
            state["timed_out"] = True
            try:
                connection.send(b"K")
            except OSError:
                pass

    timer = loop.call_later(max(0.0, request.timeout_s), kill)
    try:
        try:
            outcome, status, step = await asyncio.wait_for(asyncio.shield(finished), request.timeout_s + KILL_GRACE_S)
        except TimeoutError:
            outcome, status, step = ("unresponsive", 0, 0)
    finally:
        timer.cancel()
        loop.remove_reader(connection.fileno())
        if fds[0] >= 0:
            loop.remove_writer(fds[0])
        for fd in outputs:
            loop.remove_reader(fd)
    # What the command wrote before it exited is already in the pipes.
    for fd in list(open_readers):
        while True:
            try:
                data = os.read(fd, READ_CHUNK)
            except (BlockingIOError, OSError):
                break
            if not data:
                break
            outputs[fd].add(data)
    duration_ms = (time.perf_counter() - started) * 1000
    stdout, stderr = outputs[stdout_read], outputs[stderr_read]
    result = ExecResult(
        exit_code=-1,
        stdout=stdout.data,
        stderr=stderr.data,
        duration_ms=duration_ms,
        timed_out=bool(state["timed_out"]),
        stdout_truncated=stdout.truncated,
        stderr_truncated=stderr.truncated,
        stdout_bytes=stdout.total,
        stderr_bytes=stderr.total,
        pid=int(state["pid"]),
    )
    if outcome == "exited":
        if os.WIFSIGNALED(status):
            result.signal = os.WTERMSIG(status)
            result.exit_code = 128 + result.signal
        else:
            result.exit_code = os.WEXITSTATUS(status)
    elif outcome == "failed":
        # Like a shell: 127 when the program is not found, 126 otherwise.
        result.exit_code = 127 if status in (errno.ENOENT, errno.ENOTDIR) else 126
        where = "change to directory" if step == ord("c") else "execute"
        target = request.cwd if step == ord("c") else request.argv[0]
        message = f"forkyard: cannot {where} {target}: {os.strerror(status)}\n".encode()
        if on_output is not None:
            on_output("stderr", message)
        result.stderr = message + result.stderr
        result.stderr_bytes += len(message)
    elif outcome == "unresponsive" and state["timed_out"]:
        result.exit_code = 128 + signal.SIGKILL
        result.signal = signal.SIGKILL
    else:
        raise SandboxNotRunning("the sandbox stopped while the command ran", step="exec")
    return result
