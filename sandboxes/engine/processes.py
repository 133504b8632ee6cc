"""Background processes: commands started without waiting for them, and terminals.

A background process is an exec whose connection to init the engine keeps
(execution.py has the protocol): init runs the command exactly as it runs an
exec, in a cgroup of its own, and the engine keeps reading its output into a
bounded buffer per stream instead of handing it to a caller.  In order:

1. Start (``Engine.start_process``): the sandbox must be running and hold
   fewer than ``MAX_PER_SANDBOX`` processes (the oldest exited one is
   forgotten to make room; all of them running is ``too_many_processes``).
   The command gets its own cgroup (as an exec), and pipes, or a terminal: the
   engine opens ``/dev/pts/ptmx`` *of the sandbox's devpts* through
   ``/proc/<init>/root`` (``openat2``, no symlinks, no escaping the root; a
   character device 5:2 or nothing), unlocks it and opens its other end with
   ``TIOCGPTPEER`` (no path lookup), owned by the sandbox's root.  init is
   asked with the ``X_TERMINAL`` flag: the command makes it its controlling
   terminal after ``setsid``, so ^C and job control reach it.  The answer
   comes once init says started (its pid inside the sandbox) or could not
   start (an exited process, 127 or 126, like an exec).
2. Output: read as it comes into a ``Tail`` per stream (one for a terminal):
   the last ``buffer_bytes`` are kept, what fell off the front is counted.
   A flood from inside the sandbox grows nothing: the engine reads on, and
   answers say how many bytes a reader missed.  Readers ask from an offset
   (the bytes written so far are the offsets), so they read each byte once.
3. Signals go through a pidfd taken when it started (the command's host pid
   found by its pid inside the sandbox in its cgroup, then checked again on
   the pidfd), so a reused pid is never signalled; ``group`` signals its
   process group (it leads one: init starts it with ``setsid``).
4. It ends when init says so (``W``), on its ``timeout_s`` (everything in its
   cgroup is killed, as a caller leaving an exec does), or with its sandbox
   (or the engine: init kills what a closed connection ran).  The exit is
   kept until a ``wait`` sees it (the answer carries what was left to read,
   and the record is gone: a second wait is ``process_not_found``) or
   ``EXITED_TTL_S`` after it ended: nothing accumulates.  What it started
   and left running (with ``setsid``) stays in its cgroup, as after an exec,
   and goes once empty or with the sandbox.

A terminal's input and size (``input``, ``resize``) go to the terminal's
engine end; a pipe-fed process's input goes to its stdin (``eof`` closes it).
"""

from __future__ import annotations

import array
import asyncio
import base64
import collections
import errno
import fcntl
import logging
import os
import signal
import socket
import stat
import struct
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import InputNotRead, InvalidRequest, ProcessNotFound, ProcessNotRunning, SandboxNotRunning, TooManyProcesses
from .execution import READ_CHUNK, START_STEPS, ExecRequest

log = logging.getLogger("forkyard.engine.processes")

MAX_PER_SANDBOX = 32
MAX_PER_HOST = 4096  # so that the tails a host holds stay bounded (2 GiB at worst), whatever its sandboxes do
BUFFER_BYTES = 256 * 1024  # kept of each stream: the tail
EXITED_TTL_S = 600.0  # an exited process no wait asked about is forgotten this long after it ended
MAX_WAIT_S = 300.0
START_TIMEOUT_S = 30.0  # for init's answer to a start (a sandbox paused meanwhile never gives one)
MAX_INPUT_BYTES = 1 << 20
INPUT_STALL_S = 10.0  # a process that reads none of its input for this long refuses more
MAX_TERMINAL = 1000  # rows and columns
PTMX_DEVICE = os.makedev(5, 2)
TIOCGPTPEER = 0x5441
TIOCSPTLCK = 0x40045431


class Tail:
    """The last ``cap`` bytes of a stream, as chunks; offsets count every byte the stream ever wrote."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.chunks: collections.deque[bytes] = collections.deque()
        self.kept = 0
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        self.chunks.append(data)
        self.kept += len(data)
        while self.kept > self.cap:
            first = self.chunks[0]
            over = self.kept - self.cap
            if len(first) <= over:
                self.chunks.popleft()
                self.kept -= len(first)
            else:
                self.chunks[0] = first[over:]
                self.kept -= over

    @property
    def start(self) -> int:
        """The offset of the oldest byte kept (every byte before it was dropped)."""
        return self.total - self.kept

    def since(self, offset: int) -> tuple[bytes, int, int]:
        """What was written from ``offset`` on that is still kept: (bytes, their offset, bytes missed before them)."""
        offset = min(max(0, offset), self.total)
        begin = max(offset, self.start)
        skip = begin - self.start
        parts: list[bytes] = []
        for chunk in self.chunks:
            if skip >= len(chunk):
                skip -= len(chunk)
                continue
            parts.append(chunk[skip:] if skip else chunk)
            skip = 0
        return b"".join(parts), begin, begin - offset

    def view(self, offset: int) -> dict[str, Any]:
        data, begin, missed = self.since(offset)
        return {
            "data_b64": base64.b64encode(data).decode(),
            "offset": begin,
            "next_offset": begin + len(data),
            "missed_bytes": missed,
            "total_bytes": self.total,
            "dropped_bytes": self.start,
        }


@dataclass(frozen=True)
class Terminal:
    rows: int
    cols: int


def parse_terminal(value: Any) -> Terminal | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"rows", "cols"}:
        raise InvalidRequest("pty must be an object with rows and cols", field="pty")
    rows, cols = value.get("rows", 24), value.get("cols", 80)
    for name, number in (("rows", rows), ("cols", cols)):
        if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= MAX_TERMINAL:
            raise InvalidRequest(f"pty {name} must be a whole number from 1 to {MAX_TERMINAL}", field=f"pty.{name}")
    return Terminal(rows, cols)


def parse_signal(value: Any) -> int:
    """A signal by number (1-64) or name (``TERM``, ``SIGTERM``)."""
    if isinstance(value, str):
        name = value.upper()
        name = name if name.startswith("SIG") else "SIG" + name
        number = getattr(signal.Signals, name, None) if name.isidentifier() else None
        if number is None:
            raise InvalidRequest(f"unknown signal {value[:20]!r}", field="signal")
        return int(number)
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 64:
        return value
    raise InvalidRequest("signal must be a name (TERM, KILL, INT, ...) or a number from 1 to 64", field="signal")


def set_size(fd: int, terminal: Terminal) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", terminal.rows, terminal.cols, 0, 0))


def open_terminal(open_ptmx: Callable[[], int], owner_uid: int, terminal: Terminal) -> tuple[int, int]:
    """A new terminal of the sandbox's own devpts: (the engine's end, the command's end)."""
    master = open_ptmx()
    try:
        info = os.fstat(master)
        if not stat.S_ISCHR(info.st_mode) or info.st_rdev != PTMX_DEVICE:
            raise SandboxNotRunning("the sandbox's /dev/pts/ptmx is not a terminal multiplexer", step="pty")
        fcntl.ioctl(master, TIOCSPTLCK, struct.pack("i", 0))
        peer = fcntl.ioctl(master, TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
        try:
            os.fchown(peer, owner_uid, -1)  # the sandbox's root, not an unmapped host root
            set_size(master, terminal)
        except BaseException:
            os.close(peer)
            raise
        return master, peer
    except BaseException:
        os.close(master)
        raise


def host_pid(candidates: list[int], inner_pid: int, proc_dir: str) -> int | None:
    """The host pid of the process whose pid in the sandbox is ``inner_pid`` (``NSpid`` in its status)."""
    for pid in candidates:
        try:
            with open(f"{proc_dir}/{pid}/status") as status:
                for line in status:
                    if line.startswith("NSpid:"):
                        if int(line.split()[-1]) == inner_pid:
                            return pid
                        break
        except (OSError, ValueError):
            continue
    return None


class Process:
    """One background process: its state, its output's tails, and the engine's ends of its pipes."""

    def __init__(self, sandbox_id: str, argv: list[str], cwd: str, terminal: Terminal | None, buffer_bytes: int) -> None:
        self.sandbox_id = sandbox_id
        self.argv = argv
        self.cwd = cwd
        self.terminal = terminal
        self.pid = 0
        self.state = "starting"
        self.exit_code: int | None = None
        self.signal: int | None = None
        self.timed_out = False
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.stdout = Tail(buffer_bytes)
        self.stderr = Tail(buffer_bytes)
        self.connection: socket.socket | None = None
        self.input_fd = -1  # stdin's write end, or the terminal
        self.output_fds: dict[int, Tail] = {}
        self.pidfd = -1
        self.cgroup = ""  # its exec cgroup's name, if it has one
        self.exited: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters: list[asyncio.Future[None]] = []  # attached readers waiting for more
        self.timer: asyncio.TimerHandle | None = None
        self.forget_timer: asyncio.TimerHandle | None = None

    @property
    def running(self) -> bool:
        return self.state == "running"

    def summary(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "cmd": self.argv,
            "cwd": self.cwd,
            "state": self.state,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "timed_out": self.timed_out,
            "pty": None if self.terminal is None else {"rows": self.terminal.rows, "cols": self.terminal.cols},
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "stdout_bytes": self.stdout.total,
            "stderr_bytes": self.stderr.total,
        }

    def answer(self, stdout_offset: int = 0, stderr_offset: int = 0) -> dict[str, Any]:
        """Its summary and its output from the given offsets."""
        return {**self.summary(), "stdout": self.stdout.view(stdout_offset), "stderr": self.stderr.view(stderr_offset)}

    def notify(self) -> None:
        waiters, self.waiters = self.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def changed(self) -> None:
        """Until new output comes or it ends."""
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        await waiter

    def close_fds(self) -> None:
        loop = asyncio.get_running_loop()
        for fd in list(self.output_fds):
            loop.remove_reader(fd)
            if fd != self.input_fd:
                _close(fd)
        self.output_fds.clear()
        if self.input_fd >= 0:
            _close(self.input_fd)
            self.input_fd = -1
        if self.pidfd >= 0:
            _close(self.pidfd)
            self.pidfd = -1
        if self.connection is not None:
            loop.remove_reader(self.connection.fileno())
            self.connection.close()
            self.connection = None


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class Processes:
    """Every sandbox's background processes, in the engine's memory (an engine restart ends them: init
    kills what a closed connection ran)."""

    def __init__(
        self,
        proc_dir: str,
        end_cgroup: Callable[[str, str], None],
        kill_cgroup: Callable[[str, str], None],
        cgroup_procs: Callable[[str, str], list[int]],
        buffer_bytes: int = BUFFER_BYTES,
        limit: int = MAX_PER_SANDBOX,
        host_limit: int = MAX_PER_HOST,
    ) -> None:
        self.proc_dir = proc_dir
        self.end_cgroup = end_cgroup  # (sandbox id, exec cgroup): remove it once empty
        self.kill_cgroup = kill_cgroup  # (sandbox id, exec cgroup): kill everything in it (blocking: a thread)
        self.cgroup_procs = cgroup_procs  # (sandbox id, exec cgroup): the host pids in it
        self.buffer_bytes = buffer_bytes
        self.limit = limit
        self.host_limit = host_limit
        self.held = 0  # records held, every sandbox's
        self.by_sandbox: dict[str, dict[int, Process]] = {}

    # --- lookups ---------------------------------------------------------------------

    def find(self, sandbox_id: str, pid: Any) -> Process:
        if not isinstance(pid, int) or isinstance(pid, bool):
            raise InvalidRequest("pid must be a process id (a whole number)", field="pid")
        process = self.by_sandbox.get(sandbox_id, {}).get(pid)
        if process is None:
            raise ProcessNotFound(f"no process {pid} in sandbox {sandbox_id} (never started, or exited and reaped)", pid=pid)
        return process

    def listing(self, sandbox_id: str) -> list[dict[str, Any]]:
        return [process.summary() for process in sorted(self.by_sandbox.get(sandbox_id, {}).values(), key=lambda p: p.started_at)]

    def count(self) -> int:
        return self.held

    def make_room(self, sandbox_id: str) -> None:
        """Forget the sandbox's oldest exited process if it is at its limit, or the host at its own; refuse
        if none of the sandbox's has exited (its tails are what the engine holds for it: bounded per host too)."""
        table = self.by_sandbox.get(sandbox_id, {})
        if len(table) < self.limit and self.held < self.host_limit:
            return
        exited = sorted((process for process in table.values() if not process.running), key=lambda p: p.ended_at or 0)
        if not exited:
            if len(table) >= self.limit:
                message = f"sandbox {sandbox_id} already runs {self.limit} background processes: wait for or signal one first"
            else:
                message = f"this host already holds {self.host_limit} background processes: wait for or signal one first"
            raise TooManyProcesses(message, limit=min(self.limit, self.host_limit))
        self.forget(exited[0])

    # --- start -----------------------------------------------------------------------

    async def start(
        self,
        sandbox_id: str,
        socket_path: str,
        request: ExecRequest,
        timeout_s: float | None,
        terminal: Terminal | None,
        terminal_fds: tuple[int, int] | None,
        cgroup: tuple[str, int] | None,
    ) -> Process:
        """Start ``request`` through init; see the module docstring.  ``terminal_fds`` (engine's end, command's
        end) and ``cgroup`` (name, fd on its cgroup.procs) are taken over: closed here whatever happens."""
        loop = asyncio.get_running_loop()
        process = Process(sandbox_id, request.argv, request.cwd, terminal, self.buffer_bytes)
        theirs: list[int] = []
        ours: list[int] = []
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        procs_fd = -1
        try:
            if cgroup is not None:
                process.cgroup, procs_fd = cgroup
            if terminal_fds is not None:
                master, peer = terminal_fds
                ours.append(master)
                theirs.append(peer)
                passed = [peer, peer, peer]
                process.input_fd = master
                process.output_fds[master] = process.stdout
            else:
                stdin_read, stdin_write = os.pipe2(os.O_CLOEXEC)
                ours.append(stdin_write)
                theirs.append(stdin_read)
                process.input_fd = stdin_write
                passed = [stdin_read]
                for tail in (process.stdout, process.stderr):
                    read_end, write_end = os.pipe2(os.O_CLOEXEC)
                    ours.append(read_end)
                    theirs.append(write_end)
                    passed.append(write_end)
                    process.output_fds[read_end] = tail
            for fd in ours:
                os.set_blocking(fd, False)
            if procs_fd >= 0:
                passed.append(procs_fd)
            try:
                await loop.sock_connect(connection, socket_path)
                connection.sendmsg([request.encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", passed))])
            except OSError as error:
                raise SandboxNotRunning("the sandbox is not running (its init does not answer)", step="process") from error
            for fd in theirs:
                _close(fd)
            theirs.clear()
            try:
                reply = await asyncio.wait_for(loop.sock_recv(connection, 64), START_TIMEOUT_S)
            except (TimeoutError, OSError) as error:  # paused meanwhile, or gone
                raise SandboxNotRunning("the sandbox's init did not start the process", step="process") from error
        except BaseException:
            for fd in theirs + ours:
                _close(fd)
            connection.close()
            if procs_fd >= 0:
                _close(procs_fd)
            if process.cgroup:
                self.end_cgroup(sandbox_id, process.cgroup)
            raise
        if procs_fd >= 0:
            _close(procs_fd)
        ours.clear()  # the process owns them now
        process.connection = connection
        if reply[:1] == b"S" and len(reply) >= 5:
            process.pid = struct.unpack("=i", reply[1:5])[0]
            process.state = "running"
            self._take_pidfd(process)
        elif reply[:1] == b"F" and len(reply) >= 6:
            status, step = struct.unpack("=i", reply[1:5])[0], reply[5]
            where = START_STEPS.get(step, "execute")
            target = request.cwd if step == ord("c") else request.argv[0]
            process.stderr.add(f"forkyard: cannot {where} {target}: {os.strerror(status)}\n".encode())
            self._ended(process, 127 if status in (errno.ENOENT, errno.ENOTDIR) else 126, None)
            return process
        else:
            process.close_fds()
            if process.cgroup:
                self.end_cgroup(sandbox_id, process.cgroup)
            raise SandboxNotRunning("the sandbox stopped while the process started", step="process")
        table = self.by_sandbox.setdefault(sandbox_id, {})
        previous = table.get(process.pid)
        if previous is not None:  # a pid reused since that one exited (never while it ran)
            self.forget(previous)
            table = self.by_sandbox.setdefault(sandbox_id, {})
        table[process.pid] = process
        self.held += 1
        for fd in process.output_fds:
            loop.add_reader(fd, self._read, process, fd)
        loop.add_reader(connection.fileno(), self._control, process)
        if timeout_s is not None:
            process.timer = loop.call_later(timeout_s, self._time_out, process)
        return process

    def _take_pidfd(self, process: Process) -> None:
        """A pidfd on the process (its host pid found by its pid in the sandbox), for signals that never reach
        a reused pid.  One that exited already gets none: there is nothing left to signal."""
        if not process.cgroup:
            return
        candidates = self._cgroup_pids(process)
        pid = host_pid(candidates, process.pid, self.proc_dir)
        if pid is None:
            return
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return
        if host_pid([pid], process.pid, self.proc_dir) == pid:  # still it, now that the pidfd holds it
            process.pidfd = pidfd
        else:
            _close(pidfd)

    def _cgroup_pids(self, process: Process) -> list[int]:
        return self.cgroup_procs(process.sandbox_id, process.cgroup)

    # --- while it runs ---------------------------------------------------------------

    def _read(self, process: Process, fd: int) -> None:
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:  # EIO: a terminal whose other end every process closed
            data = b""
        if data:
            process.output_fds[fd].add(data)
            process.notify()
            return
        asyncio.get_running_loop().remove_reader(fd)
        if fd != process.input_fd:
            _close(fd)
        del process.output_fds[fd]

    def _control(self, process: Process) -> None:
        assert process.connection is not None
        try:
            reply = process.connection.recv(64)
        except BlockingIOError:
            return
        except OSError:
            reply = b""
        if reply[:1] == b"W" and len(reply) >= 5:
            status = struct.unpack("=i", reply[1:5])[0]
            if os.WIFSIGNALED(status):
                self._ended(process, 128 + os.WTERMSIG(status), os.WTERMSIG(status))
            else:
                self._ended(process, os.WEXITSTATUS(status), None)
        elif not reply:  # init is gone: so is the sandbox, and the process with it
            self._ended(process, 128 + signal.SIGKILL, signal.SIGKILL)

    def _time_out(self, process: Process) -> None:
        if process.running:
            process.timed_out = True
            if process.connection is not None:
                try:
                    process.connection.send(b"K")
                except OSError:
                    pass
            if process.cgroup:
                asyncio.get_running_loop().run_in_executor(None, self.kill_cgroup, process.sandbox_id, process.cgroup)

    def _ended(self, process: Process, exit_code: int, signal_number: int | None) -> None:
        if process.state == "exited":
            return
        loop = asyncio.get_running_loop()
        # What it wrote before it ended is in the pipes already: take it (a terminal's, until EIO).
        for fd, tail in list(process.output_fds.items()):
            drained = 0
            while drained < BUFFER_BYTES * 4:
                try:
                    data = os.read(fd, READ_CHUNK)
                except OSError:
                    break
                if not data:
                    break
                drained += len(data)
                tail.add(data)
        process.state = "exited"
        process.exit_code, process.signal = exit_code, signal_number
        process.ended_at = time.time()
        if process.timer is not None:
            process.timer.cancel()
        process.close_fds()
        if process.cgroup:
            self.end_cgroup(process.sandbox_id, process.cgroup)
        if not process.exited.done():
            process.exited.set_result(None)
        process.notify()
        process.forget_timer = loop.call_later(EXITED_TTL_S, self.forget, process)

    # --- what callers do -------------------------------------------------------------

    def send_signal(self, process: Process, number: int, group: bool) -> None:
        if not process.running or process.pidfd < 0:
            raise ProcessNotRunning(f"process {process.pid} is not running", pid=process.pid, state=process.state)
        try:
            signal.pidfd_send_signal(process.pidfd, 0)  # it still runs: its pid (and group id) are its own
            if group:
                os.killpg(_pid_of(process.pidfd, self.proc_dir), number)
            else:
                signal.pidfd_send_signal(process.pidfd, number)
        except ProcessLookupError:
            raise ProcessNotRunning(f"process {process.pid} is not running", pid=process.pid, state="exiting") from None

    async def wait(self, process: Process, timeout_s: float) -> bool:
        """Until it ends or ``timeout_s`` passes: whether it ended."""
        try:
            await asyncio.wait_for(asyncio.shield(process.exited), timeout_s)
        except TimeoutError:
            return False
        return True

    async def write_input(self, process: Process, data: bytes, eof: bool) -> int:
        if not process.running or process.input_fd < 0:
            raise ProcessNotRunning(
                f"process {process.pid} takes no more input (it ended, or its input was closed)",
                pid=process.pid,
                state=process.state,
            )
        loop = asyncio.get_running_loop()
        view = memoryview(data)
        deadline = loop.time() + INPUT_STALL_S
        fd = process.input_fd
        while view:
            try:
                view = view[os.write(fd, view) :]
                continue
            except BlockingIOError:
                pass
            except OSError as error:  # EPIPE: it closed its stdin; EIO: the terminal is gone
                raise ProcessNotRunning(f"process {process.pid} no longer reads its input: {error.strerror}") from None
            if not await _writable(loop, fd, deadline - loop.time()):
                raise InputNotRead(
                    f"process {process.pid} read none of its input for {INPUT_STALL_S:g}s",
                    pid=process.pid,
                    written=len(data) - len(view),
                )
            if process.input_fd != fd:
                raise ProcessNotRunning(f"process {process.pid} ended while its input was written", pid=process.pid)
        if eof and process.terminal is None:
            _close(fd)
            process.input_fd = -1
        elif eof:
            os.write(fd, b"\x04")  # a terminal's end of input: ^D
        return len(data)

    def resize(self, process: Process, terminal: Terminal) -> None:
        if process.terminal is None:
            raise InvalidRequest(f"process {process.pid} has no terminal (start it with pty)", field="pty")
        if not process.running or process.input_fd < 0:
            raise ProcessNotRunning(f"process {process.pid} is not running", pid=process.pid, state=process.state)
        set_size(process.input_fd, terminal)
        process.terminal = terminal

    # --- forgetting ------------------------------------------------------------------

    def forget(self, process: Process) -> None:
        """Drop its record (reaped by a wait, expired, or pushed out by a newer process)."""
        table = self.by_sandbox.get(process.sandbox_id)
        if table is not None and table.get(process.pid) is process:
            del table[process.pid]
            self.held -= 1
            if not table:
                del self.by_sandbox[process.sandbox_id]
        if process.forget_timer is not None:
            process.forget_timer.cancel()
        if process.timer is not None:
            process.timer.cancel()
        if process.running:  # pushed out while running never happens; the sandbox's end does
            process.state = "exited"
            if not process.exited.done():
                process.exited.set_result(None)
        process.close_fds()
        process.notify()

    def forget_sandbox(self, sandbox_id: str) -> None:
        """The sandbox is gone, and every process with it."""
        for process in list(self.by_sandbox.get(sandbox_id, {}).values()):
            if process.running:
                process.exit_code, process.signal = 128 + signal.SIGKILL, signal.SIGKILL
                process.ended_at = time.time()
            self.forget(process)
        self.by_sandbox.pop(sandbox_id, None)


async def _writable(loop: asyncio.AbstractEventLoop, fd: int, timeout_s: float) -> bool:
    """Whether ``fd`` takes more bytes within ``timeout_s``."""
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_writer(fd, wake)
    try:
        await asyncio.wait_for(ready, max(0.0, timeout_s))
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_writer(fd)


def _pid_of(pidfd: int, proc_dir: str) -> int:
    """The host pid a pidfd holds (``Pid:`` in its fdinfo)."""
    with open(f"{proc_dir}/self/fdinfo/{pidfd}") as info:
        for line in info:
            if line.startswith("Pid:") and int(line.split()[1]) > 0:
                return int(line.split()[1])
    raise ProcessLookupError(pidfd)
