"""Running a command in a sandbox: the engine's side of the init protocol.

Exec, in the order the code runs it:

1. Connect to the sandbox's control socket (a host path only the engine can
   reach; its init accepts on it).
2. Make three pipes and send init the request (cwd, argv, env) with the
   command's ends of the pipes attached (SCM_RIGHTS).  The command therefore
   writes straight into pipes the engine reads: no copy through init.
3. init vforks; the child joins the command's own cgroup (when the engine
   passed its ``cgroup.procs``: cgroups.py), starts a new session, points
   stdio at the pipes, chdirs and execs.  init answers 'S' (started) or 'F'
   (could not start).
4. The engine feeds stdin, reads stdout and stderr up to the cap (and counts
   what it drops), and waits for 'W' (the wait status).  What it reads goes
   straight on to the caller (``on_output``), never gathered: when the
   caller's connection has a full buffer (``Flow``), the engine stops reading
   until it drains, the pipes fill, and the command waits.  So the engine
   holds a few chunks per exec, whatever the command prints.
5. On timeout it sends 'K': init SIGKILLs the command's process group.  The
   result says ``timed_out``; a timeout is a result, not an error.
6. After 'W' it drains what is already in the pipes (up to ``DRAIN_LIMIT``)
   and returns.  A background process that keeps the pipes open does not
   hold the exec.
7. If the caller goes away (``Flow.drained`` fails, or the server cancels the
   call), the connection to init is closed, and init kills the command's
   process group.
8. A connection whose command ended with 'W' (not timed out, not cancelled)
   is kept for the sandbox's next command (``InitConnections``, for a sandbox
   whose init takes more than one command per connection): connecting and
   closing was a fifth of the engine's time per exec.  Any other is closed.

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
from typing import Any, Protocol

from .errors import InvalidRequest, SandboxNotRunning, TooLarge

MAX_REQUEST_BYTES = 256 * 1024 - 64
MAX_ARGS = 4096  # init's limit on argv items, and on environment variables (native/init.c)
READ_CHUNK = 65536
KILL_GRACE_S = 2.0
# What is read after the command ended, at most: what its pipes hold (a pipe
# holds up to 1 MiB, /proc/sys/fs/pipe-max-size), not what a background
# process that keeps them open goes on writing meanwhile.
DRAIN_LIMIT = 4 << 20
OutputCallback = Callable[[str, bytes], None]
X_TERMINAL = 1  # an exec request's flag (native/init.c): stdin is the command's controlling terminal
# Why a command could not start, by init's step letter ('F' replies).
START_STEPS = {
    ord("c"): "change to directory",
    ord("g"): "join the command's cgroup",
    ord("t"): "take its terminal",
    ord("u"): "become user",
}


class Flow(Protocol):
    """Backpressure from where the output goes (the caller's connection)."""

    def congested(self) -> bool:
        """Should reading stop until :meth:`drained`?"""

    async def drained(self) -> None:
        """Wait until there is room again; raise ConnectionError if the caller is gone."""


EXEC_AS_USER = 1  # init.c: the request carries the ids the command runs as


@dataclass(frozen=True)
class Identity:
    """Whom a command runs as, in the sandbox's own ids (users.py resolves a name)."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    def encode(self) -> bytes:
        return struct.pack(f"=III{len(self.groups)}I", self.uid, self.gid, len(self.groups), *self.groups)


@dataclass(frozen=True)
class ExecRequest:
    argv: list[str]
    cwd: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    stdin: bytes = b""
    timeout_s: float = 60.0
    max_output_bytes: int = 1 << 20
    identity: Identity | None = None  # None: root of the sandbox, as init is
    terminal: bool = False  # stdin is a terminal the command takes as its controlling terminal (processes.py)

    def encode(self) -> bytes:
        strings = [self.cwd, *self.argv, *(f"{key}={value}" for key, value in self.env.items())]
        body = b"".join(item.encode("utf-8", "surrogateescape") + b"\0" for item in strings)
        flags, identity = (EXEC_AS_USER, self.identity.encode()) if self.identity is not None else (0, b"")
        terminal = X_TERMINAL if self.terminal else 0
        message = struct.pack("=cB2xIII", b"X", flags, len(self.argv), len(self.env), terminal) + identity + body
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
    replayed: bool = False  # a second exec with the same key: this is the first one's result, without output
    caller_left: bool = False  # its caller went away first: it was killed, with everything it started

    def summary(self) -> dict[str, Any]:
        return {
            "replayed": self.replayed,
            "caller_left": self.caller_left,
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


class InitConnections:
    """Idle connections to sandboxes' inits, kept between commands.

    Only a connection whose command ended with 'W' comes back here: its init
    has set it idle again (native/init.c).  One whose command was cancelled,
    timed out or could not start is closed, never reused (closing before 'W'
    kills the command's process group).  Bounded per sandbox and in all; the
    engine drops a sandbox's with the sandbox.  Used from the event loop only.
    """

    def __init__(self, per_sandbox: int = 4, total: int = 4096) -> None:
        self.per_sandbox = per_sandbox
        self.total = total
        self._idle: dict[str, list[socket.socket]] = {}
        self._count = 0
        self.made = 0  # connections made to an init
        self.reused = 0  # commands sent on a kept connection

    def take(self, socket_path: str) -> socket.socket | None:
        idle = self._idle.get(socket_path)
        if not idle:
            return None
        connection = idle.pop()
        self._count -= 1
        if not idle:
            del self._idle[socket_path]
        return connection

    def give_back(self, socket_path: str, connection: socket.socket) -> None:
        idle = self._idle.setdefault(socket_path, [])
        if len(idle) >= self.per_sandbox or self._count >= self.total:
            connection.close()
        else:
            idle.append(connection)
            self._count += 1

    def forget(self, socket_path: str) -> None:
        for connection in self._idle.pop(socket_path, []):
            connection.close()
            self._count -= 1

    def close_all(self) -> None:
        for socket_path in list(self._idle):
            self.forget(socket_path)

    def status(self) -> dict[str, int]:
        return {"made": self.made, "reused": self.reused, "idle": self._count}


def validate_argv(command: Any) -> list[str]:
    """A shell string becomes ``sh -c``; a list must be non-empty strings."""
    if isinstance(command, str):
        if not command.strip():
            raise InvalidRequest("cmd is an empty string", field="cmd")
        if "\0" in command:
            raise InvalidRequest("cmd holds a NUL byte", field="cmd")
        return ["/bin/sh", "-c", command]
    if not isinstance(command, list) or not command:
        raise InvalidRequest("cmd must be a string (run by /bin/sh) or a non-empty list of strings", field="cmd")
    if len(command) > MAX_ARGS:
        raise InvalidRequest(f"cmd has more than {MAX_ARGS} items", field="cmd")
    for item in command:
        if not isinstance(item, str):
            raise InvalidRequest("every item of cmd must be a string", field="cmd")
        if "\0" in item:
            raise InvalidRequest("cmd holds a NUL byte", field="cmd")
    if not command[0]:
        raise InvalidRequest("cmd[0] is empty", field="cmd")
    return list(command)


def validate_directory(path: Any, field_name: str) -> str:
    """An absolute path without NUL bytes, at most 4 KiB: a command's working directory."""
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path or len(path) > 4096:
        raise InvalidRequest(f"{field_name} must be an absolute path", field=field_name)
    return path


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


async def _connect(loop: asyncio.AbstractEventLoop, socket_path: str) -> socket.socket:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        await loop.sock_connect(connection, socket_path)
    except (FileNotFoundError, ConnectionRefusedError) as error:
        connection.close()
        raise SandboxNotRunning("the sandbox is not running (its init does not answer)", step="connect") from error
    except BaseException:
        connection.close()
        raise
    return connection


async def run(
    socket_path: str,
    request: ExecRequest,
    on_output: OutputCallback | None = None,
    flow: Flow | None = None,
    cgroup_procs: int | None = None,
    connections: InitConnections | None = None,
    reuse: bool = True,
) -> ExecResult:
    """Run one command through the sandbox's init; see the module docstring.

    With ``on_output``, output goes there as it is read (the result's
    ``stdout`` and ``stderr`` stay empty), paced by ``flow``; without, it is
    kept in the result (for the engine's own short commands).
    ``cgroup_procs``: an fd on the ``cgroup.procs`` of a cgroup the command
    joins before it execs (cgroups.py: a cgroup per exec).
    ``connections``: where to take a kept connection from and give it back
    (with ``reuse``: the sandbox's init takes more than one command per
    connection; without, it only counts the connections made)."""
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    message = request.encode()
    connection: socket.socket | None = None
    keep = False
    ours: list[int] = []
    theirs: list[int] = []
    try:
        stdin_read, stdin_write = os.pipe2(os.O_CLOEXEC)
        ours.append(stdin_write)
        theirs.append(stdin_read)
        for _ in ("stdout", "stderr"):
            read_end, write_end = os.pipe2(os.O_CLOEXEC)
            ours.append(read_end)
            theirs.append(write_end)
        for fd in ours:
            os.set_blocking(fd, False)
        passed = [
            (socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", theirs if cgroup_procs is None else [*theirs, cgroup_procs]))
        ]
        connection = connections.take(socket_path) if connections is not None and reuse else None
        if connection is not None:
            try:
                connection.sendmsg([message], passed)
                connections.reused += 1  # type: ignore[union-attr]
            except OSError:  # its init dropped it meanwhile: a new one decides
                connection.close()
                connection = None
        if connection is None:
            connection = await _connect(loop, socket_path)
            if connections is not None:
                connections.made += 1
            try:
                connection.sendmsg([message], passed)
            except OSError as error:
                raise SandboxNotRunning(f"the sandbox's init refused the request: {error.strerror}", step="send") from error
        for fd in theirs:
            os.close(fd)
        theirs.clear()
        result, reusable = await _supervise(loop, connection, request, ours, started, on_output, flow)
        keep = reusable and reuse and connections is not None
        return result
    finally:
        for fd in theirs + ours:
            try:
                os.close(fd)
            except OSError:
                pass
        if connection is not None:
            if keep:
                connections.give_back(socket_path, connection)  # type: ignore[union-attr]
            else:
                connection.close()


async def _supervise(
    loop: asyncio.AbstractEventLoop,
    connection: socket.socket,
    request: ExecRequest,
    fds: list[int],
    started: float,
    on_output: OutputCallback | None,
    flow: Flow | None,
) -> tuple[ExecResult, bool]:
    """The command's result, and whether its connection is idle again (it ended with 'W', untouched by a kill)."""
    stdin_write, stdout_read, stderr_read = fds
    outputs = {
        stdout_read: _Output("stdout", request.max_output_bytes, on_output),
        stderr_read: _Output("stderr", request.max_output_bytes, on_output),
    }
    finished: asyncio.Future[tuple[str, int, int]] = loop.create_future()
    state = {"pid": 0, "timed_out": False}
    open_readers = set(outputs)
    waiting: list[asyncio.Task[None]] = []  # at most one: reading paused until the caller drains

    def read_output(fd: int) -> None:
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            outputs[fd].add(data)
            if flow is not None and not waiting and flow.congested():
                for reader in open_readers:
                    loop.remove_reader(reader)
                waiting.append(loop.create_task(resume_reading(flow)))
        else:
            loop.remove_reader(fd)
            open_readers.discard(fd)

    async def resume_reading(flow: Flow) -> None:
        try:
            await flow.drained()
        except ConnectionError as error:
            if not finished.done():
                finished.set_exception(error)
            return
        finally:
            waiting.clear()
        if not finished.done():
            for reader in open_readers:
                loop.add_reader(reader, read_output, reader)

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
        for task in waiting:
            task.cancel()
    # What the command wrote before it exited is already in the pipes.
    drained = 0
    for fd in list(open_readers):
        while drained < DRAIN_LIMIT:
            try:
                data = os.read(fd, READ_CHUNK)
            except (BlockingIOError, OSError):
                break
            if not data:
                break
            drained += len(data)
            outputs[fd].add(data)
            if flow is not None and flow.congested():
                await flow.drained()
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
        where = START_STEPS.get(step, "execute")
        target = {ord("c"): request.cwd, ord("u"): str(request.identity and request.identity.uid)}.get(step, request.argv[0])
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
    return result, outcome == "exited" and not result.timed_out
