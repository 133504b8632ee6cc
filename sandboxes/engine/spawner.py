"""The spawner: the process that creates sandboxes and is the parent of their PID 1s.

Why a separate process:

* It stays small and single-threaded.  ``unshare(CLONE_NEWUSER)`` is refused
  to multi-threaded processes, and a small process forks fast.
* It outlives the engine.  Started detached, it keeps reaping sandbox init
  processes while the engine is down (this machine's PID 1 reaps nothing), and
  the restarted engine simply reconnects to it.

Create, in the order the code runs it (:func:`Spawner.spawn` then
:func:`_child`):

1. spawner: bind the sandbox's control socket at a host path under the run
   directory; sandboxes cannot see that path.
2. spawner: ``clone()`` with new user, mount, pid, net, ipc and uts
   namespaces.  A raw clone behaves like fork, so the child is at once PID 1
   of its pid namespace: no second fork.
3. spawner: write the child's pid into its cgroup(s), then its uid and gid
   maps (root inside = ``uid_base`` outside), then release it.
4. child: ``unshare(CLONE_NEWCGROUP)``, now that it sits in its own cgroup, so
   that cgroup becomes the root it sees.
5. child: become root of the user namespace, set the hostname (= sandbox id).
6. child: build the root filesystem (:mod:`.rootfs`) and pivot into it.
7. child: bring up loopback, set rlimits, drop every capability outside the
   kept set, set ``no_new_privs``, install the seccomp filter.
8. child: ``execveat`` the init binary from a sealed memfd.  The sandbox can
   never write the binary that enters it (``/proc/self/exe`` points at a
   sealed, anonymous file).
9. init: signals ready on a pipe once it accepts exec requests.

A failing step is reported through a close-on-exec pipe as
``{"step", "errno", "target"}``; the spawner kills the child and answers the
engine with that error.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import json
import os
import resource
import selectors
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING

from . import rootfs
from .kernel import (
    CLONE_NEWCGROUP,
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    CLONE_NEWUTS,
    PR_SET_NO_NEW_PRIVS,
    Kernel,
    KernelError,
    loopback_up,
    process_start_time,
)

if TYPE_CHECKING:
    from typing import Any

NAMESPACES = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS

# Capabilities kept inside the sandbox's user namespace (they mean nothing
# outside it): enough for package managers and servers, nothing that reaches
# mounts, raw sockets, devices, ptrace of others or the kernel.
KEPT_CAPABILITIES = {
    "CHOWN": 0,
    "DAC_OVERRIDE": 1,
    "FOWNER": 3,
    "FSETID": 4,
    "KILL": 5,
    "SETGID": 6,
    "SETUID": 7,
    "SETPCAP": 8,
    "NET_BIND_SERVICE": 10,
    "SYS_CHROOT": 18,
    "AUDIT_WRITE": 29,
    "SETFCAP": 31,
}
FD_LISTEN, FD_READY, FD_LAYER = 3, 4, 5
READY_TIMEOUT_S = 15.0
MAX_MESSAGE = 1 << 20


class SpawnSpec:
    """What the engine asks for; parsed from its JSON request."""

    __slots__ = ("sandbox_id", "uid_base", "uid_count", "cgroup_procs", "rootfs", "socket_path", "nofile")

    def __init__(self, raw: dict[str, Any]) -> None:
        self.sandbox_id = str(raw["sandbox_id"])
        self.uid_base = int(raw["uid_base"])
        self.uid_count = int(raw["uid_count"])
        self.cgroup_procs = tuple(str(path) for path in raw["cgroup_procs"])
        self.rootfs = rootfs.RootfsSpec(**{**raw["rootfs"], "lower": tuple(raw["rootfs"]["lower"])})
        self.socket_path = str(raw["socket_path"])
        self.nofile = int(raw.get("nofile", 65536))


class Settings:
    """The spawner's own configuration, from the environment the engine gives it.

    The spawner imports as little as it can (it is started with ``python -S``
    and without the engine's configuration module): every create copies its
    memory map, so a smaller heap is a faster clone and a faster exec.
    """

    def __init__(self, environ: dict[str, str]) -> None:
        run_dir = environ["FORKYARD_ENGINE_RUN_DIR"]
        self.socket_path = os.path.join(run_dir, "spawner.sock")
        self.init_binary = environ["FORKYARD_ENGINE_INIT_BINARY"]
        self.seccomp_program = environ["FORKYARD_SPAWNER_SECCOMP"]
        self.version = environ["FORKYARD_SPAWNER_VERSION"]


def sealed_copy(path: str) -> int:
    """The init binary in a memfd that no one, root included, can modify."""
    with open(path, "rb") as handle:
        data = handle.read()
    fd = os.memfd_create("forkyard-init", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _child(kernel: Kernel, spec: SpawnSpec, pipes: dict[str, int], listen_fd: int, program: bytes, init_fd: int) -> None:
    """Runs in the clone()d child; never returns."""
    step = "wait for the spawner"
    target = spec.sandbox_id
    # A collection would walk (and so copy-on-write) the whole inherited heap.
    gc.disable()
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if os.read(pipes["sync_read"], 1) != b"1":
            os._exit(1)  # the spawner gave up on us
        step = "unshare cgroup namespace"
        kernel.unshare(CLONE_NEWCGROUP)
        step = "become root in the user namespace"
        os.setresgid(0, 0, 0)
        os.setgroups([])
        os.setresuid(0, 0, 0)
        step = "set hostname"
        kernel.sethostname(spec.sandbox_id)
        step = "build root filesystem"
        upper_fd = rootfs.build(kernel, spec.rootfs)
        step = "bring up loopback"
        loopback_up()
        step = "set rlimits"
        nofile = min(spec.nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        step = "drop capabilities"
        kept = sorted(KEPT_CAPABILITIES.values())
        kernel.drop_bounding_capabilities(kept)
        kernel.set_capabilities(kept)
        step = "set no_new_privs"
        kernel.prctl(PR_SET_NO_NEW_PRIVS, 1)
        step = "install seccomp filter"
        kernel.set_seccomp_filter(program)
        step = "arrange file descriptors"
        # Move everything out of the way first, so dup2 never clobbers a source.
        *sources, init_fd = [
            fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100) for fd in (listen_fd, pipes["ready_write"], upper_fd, init_fd)
        ]
        for wanted, source in zip((FD_LISTEN, FD_READY, FD_LAYER), sources, strict=True):
            os.dup2(source, wanted, inheritable=True)
        null = os.open("/dev/null", os.O_RDWR)
        for stdio in (0, 1, 2):
            os.dup2(null, stdio, inheritable=True)
        step = "execute init"
        kernel.execveat(init_fd, ["forkyard-init"], [])
    except BaseException as error:  # noqa: BLE001 - everything must reach the spawner
        number = getattr(error, "errno", None) or errno.EIO
        failed_target = getattr(error, "target", "") or target
        failed_step = getattr(error, "step", "") or step
        report = {
            "step": step if failed_step == step else f"{step}: {failed_step}",
            "errno": number,
            "target": failed_target,
            "message": str(error) or type(error).__name__,
        }
        try:
            os.write(pipes["error_write"], json.dumps(report).encode()[:4000])
        finally:
            os._exit(1)
    os._exit(1)


class Pending:
    """A sandbox between clone() and its init's ready byte."""

    __slots__ = (
        "request_id",
        "connection",
        "pid",
        "pidfd",
        "error_read",
        "ready_read",
        "deadline",
        "socket_path",
        "error_data",
        "error_closed",
        "ready_closed",
    )

    def __init__(
        self,
        request_id: Any,
        connection: socket.socket,
        pid: int,
        pidfd: int,
        error_read: int,
        ready_read: int,
        deadline: float,
        socket_path: str,
    ) -> None:
        self.request_id = request_id
        self.connection = connection
        self.pid = pid
        self.pidfd = pidfd
        self.error_read = error_read
        self.ready_read = ready_read
        self.deadline = deadline
        self.socket_path = socket_path
        self.error_data = bytearray()
        self.error_closed = False
        self.ready_closed = False


class Spawner:
    def __init__(self, settings: Settings, kernel: Kernel | None = None) -> None:
        self.settings = settings
        self.kernel = kernel or Kernel()
        self.version = settings.version
        with open(settings.seccomp_program, "rb") as handle:
            self.program = handle.read()
        self.init_fd = sealed_copy(settings.init_binary)
        self.selector = selectors.DefaultSelector()
        self.pending: dict[int, Pending] = {}  # by pid
        self.children: set[int] = set()
        self.connections: set[socket.socket] = set()
        self.retiring = False
        self.listener: socket.socket | None = None
        self.signal_read, signal_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        os.set_blocking(signal_write, False)
        signal.set_wakeup_fd(signal_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector.register(self.signal_read, selectors.EVENT_READ, ("signal", None))

    # --- serving -------------------------------------------------------

    def listen(self) -> None:
        path = self.settings.socket_path
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(path)
        os.chmod(path, 0o600)
        listener.listen(16)
        listener.setblocking(False)
        self.listener = listener
        self.selector.register(listener, selectors.EVENT_READ, ("accept", None))

    def serve_forever(self) -> None:
        while True:
            timeout = None
            if self.pending:
                timeout = max(0.0, min(p.deadline for p in self.pending.values()) - time.monotonic())
            for key, _ in self.selector.select(timeout):
                kind, payload = key.data
                if kind == "accept":
                    self._accept()
                elif kind == "request":
                    self._request(payload)
                elif kind == "signal":
                    self._reap()
                elif kind in ("error", "ready"):
                    self._child_output(kind, payload)
            self._expire()
            if self.retiring and not self.children and not self.pending:
                return

    def _accept(self) -> None:
        assert self.listener is not None
        try:
            connection, _ = self.listener.accept()
        except BlockingIOError:
            return
        # Bounded blocking: an engine that stops reading must not stall every
        # create; it will reconcile whatever it missed from the kernel.
        connection.settimeout(5.0)
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        self.connections.add(connection)
        self.selector.register(connection, selectors.EVENT_READ, ("request", connection))

    def _send(self, connection: socket.socket, message: dict[str, Any]) -> None:
        try:
            connection.send(json.dumps(message).encode())
        except OSError:
            pass  # the engine went away; it reconciles from its record

    def _request(self, connection: socket.socket) -> None:
        try:
            raw = connection.recv(MAX_MESSAGE)
        except OSError:
            raw = b""
        if not raw:
            self.selector.unregister(connection)
            self.connections.discard(connection)
            connection.close()
            return
        try:
            message = json.loads(raw)
            op = message["op"]
        except (ValueError, KeyError, TypeError):
            self._send(
                connection,
                {"ok": False, "error": {"step": "parse request", "errno": errno.EINVAL, "target": "", "message": "bad request"}},
            )
            return
        request_id = message.get("request_id")
        if op == "ping":
            self._send(
                connection,
                {
                    "request_id": request_id,
                    "ok": True,
                    "pid": os.getpid(),
                    "version": self.version,
                    "children": len(self.children),
                },
            )
        elif op == "retire":
            self.retire()
            self._send(connection, {"request_id": request_id, "ok": True})
        elif op == "spawn":
            try:
                spec = SpawnSpec(message["spec"])
            except (KeyError, TypeError, ValueError) as error:
                self._send(
                    connection,
                    {
                        "request_id": request_id,
                        "ok": False,
                        "error": {"step": "parse spec", "errno": errno.EINVAL, "target": "", "message": str(error)},
                    },
                )
                return
            error = self.spawn(spec, request_id, connection)
            if error:
                self._send(connection, {"request_id": request_id, "ok": False, "error": error})
        else:
            self._send(
                connection,
                {
                    "request_id": request_id,
                    "ok": False,
                    "error": {"step": "parse request", "errno": errno.EINVAL, "target": op, "message": "unknown op"},
                },
            )

    def retire(self) -> None:
        """Stop taking requests; exit once the last sandbox we parent is gone."""
        self.retiring = True
        if self.listener is not None:
            self.selector.unregister(self.listener)
            self.listener.close()
            self.listener = None

    # --- creating --------------------------------------------------------

    def spawn(self, spec: SpawnSpec, request_id: Any, connection: socket.socket) -> dict[str, Any] | None:
        """Start creating a sandbox; the answer comes when its init is ready."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            try:
                os.unlink(spec.socket_path)
            except FileNotFoundError:
                pass
            listener.bind(spec.socket_path)
            listener.listen(64)
        except OSError as error:
            listener.close()
            return {"step": "bind control socket", "errno": error.errno, "target": spec.socket_path, "message": str(error)}
        sync_read, sync_write = os.pipe2(os.O_CLOEXEC)
        error_read, error_write = os.pipe2(os.O_CLOEXEC)
        ready_read, ready_write = os.pipe2(os.O_CLOEXEC)
        pipes = {"sync_read": sync_read, "error_write": error_write, "ready_write": ready_write}
        try:
            pid = self.kernel.clone_process(NAMESPACES)
        except KernelError as error:
            for fd in (sync_read, sync_write, error_read, error_write, ready_read, ready_write):
                os.close(fd)
            listener.close()
            return {"step": "clone", "errno": error.errno, "target": spec.sandbox_id, "message": str(error)}
        if pid == 0:
            _child(self.kernel, spec, pipes, listener.fileno(), self.program, self.init_fd)
        self.children.add(pid)
        for fd in (sync_read, error_write, ready_write):
            os.close(fd)
        listener.close()
        pidfd = self.kernel.pidfd_open(pid)
        failure = None
        try:
            for procs in spec.cgroup_procs:
                with open(procs, "w") as handle:
                    handle.write(str(pid))
            mapping = f"0 {spec.uid_base} {spec.uid_count}\n"
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{pid}/{name}", "w") as handle:
                    handle.write(mapping)
            os.write(sync_write, b"1")
        except OSError as error:
            failure = {
                "step": "place in cgroup and map ids",
                "errno": error.errno,
                "target": str(error.filename or pid),
                "message": str(error),
            }
        finally:
            os.close(sync_write)
        if failure:
            self._kill(pidfd)
            for fd in (pidfd, error_read, ready_read):
                os.close(fd)
            return failure
        for fd in (error_read, ready_read):
            os.set_blocking(fd, False)
        pending = Pending(
            request_id, connection, pid, pidfd, error_read, ready_read, time.monotonic() + READY_TIMEOUT_S, spec.socket_path
        )
        self.pending[pid] = pending
        self.selector.register(error_read, selectors.EVENT_READ, ("error", pending))
        self.selector.register(ready_read, selectors.EVENT_READ, ("ready", pending))
        return None

    def _kill(self, pidfd: int) -> None:
        try:
            self.kernel.pidfd_send_signal(pidfd, signal.SIGKILL)
        except KernelError:
            pass

    def _child_output(self, kind: str, pending: Pending) -> None:
        """The error pipe closes at exec (empty) or carries a report; the
        ready pipe carries 'R' once init listens, or closes if it died."""
        fd = pending.error_read if kind == "error" else pending.ready_read
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if kind == "error":
            if data:
                pending.error_data += data
                return
            pending.error_closed = True
            self.selector.unregister(fd)
            if pending.error_data or pending.ready_closed:
                self._finish(pending, self._child_error(pending))
            return
        self.selector.unregister(fd)
        pending.ready_closed = True
        if data.startswith(b"R"):
            self._finish(pending, None)
        elif pending.error_closed:
            self._finish(pending, self._child_error(pending))
        # else: the child died before exec; its report is still on its way.

    def _child_error(self, pending: Pending) -> dict[str, Any]:
        if not pending.error_data:
            return {
                "step": "start init",
                "errno": errno.ECHILD,
                "target": pending.socket_path,
                "message": "init exited before it was ready",
            }
        try:
            report: dict[str, Any] = json.loads(bytes(pending.error_data))
        except ValueError:
            report = {"step": "unknown", "errno": errno.EIO, "target": "", "message": pending.error_data.decode(errors="replace")}
        return report

    def _finish(self, pending: Pending, error: dict[str, Any] | None) -> None:
        self.pending.pop(pending.pid, None)
        for fd in (pending.error_read, pending.ready_read):
            try:
                self.selector.unregister(fd)
            except (KeyError, ValueError):
                pass
            os.close(fd)
        if error is None:
            try:
                start_time = process_start_time(pending.pid)
            except OSError:
                error = {
                    "step": "start init",
                    "errno": errno.ECHILD,
                    "target": pending.socket_path,
                    "message": "init exited right after start",
                }
        if error is not None:
            self._kill(pending.pidfd)
            os.close(pending.pidfd)
            try:
                os.unlink(pending.socket_path)
            except OSError:
                pass
            self._send(pending.connection, {"request_id": pending.request_id, "ok": False, "error": error})
            return
        os.close(pending.pidfd)
        self._send(
            pending.connection, {"request_id": pending.request_id, "ok": True, "pid": pending.pid, "start_time": start_time}
        )

    def _expire(self) -> None:
        now = time.monotonic()
        for pending in [p for p in self.pending.values() if p.deadline <= now]:
            self._finish(
                pending,
                {
                    "step": "wait for init",
                    "errno": errno.ETIMEDOUT,
                    "target": pending.socket_path,
                    "message": "init did not become ready",
                },
            )

    def _reap(self) -> None:
        try:
            while os.read(self.signal_read, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            # Tell every engine connected: that is how it learns a sandbox died.
            for connection in list(self.connections):
                self._send(connection, {"event": "exited", "pid": pid, "status": status})


def main() -> int:
    try:
        settings = Settings(dict(os.environ))
        # Children inherit our hard limit and cannot raise it in their user
        # namespace; use all of it (some hosts drop CAP_SYS_RESOURCE, so we
        # cannot go beyond it either).
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        spawner = Spawner(settings)
        spawner.listen()
        # Everything imported so far lives as long as we do: keep the
        # collector (and so every child's copy-on-write faults) off it.
        gc.collect()
        gc.freeze()
        print(f"spawner {os.getpid()} version {spawner.version} listening on {settings.socket_path}", flush=True)
        spawner.serve_forever()
    except Exception:  # noqa: BLE001 - a daemon's last word goes to its log
        import traceback

        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
