"""The spawner: the engine's link to the zygote, and the parent of every sandbox's PID 1.

Why a separate process:

* It outlives the engine.  Started detached, it keeps reaping sandbox init
  processes while the engine is down (this machine's PID 1 reaps nothing), and
  the restarted engine simply reconnects to it.
* It owns the zygote (``native/zygote.c``), a small C process that clones
  every sandbox.  The sandboxes' inits are *our* children (the zygote clones
  with CLONE_PARENT), so we reap them and tell the engine of each exit.
  Cloning from this Python process instead used to copy its ~7 MiB heap on
  every create, and the exec of init then tore that copy down.

Create, in the order the code runs it (:meth:`Spawner.spawn`, then
native/zygote.c and native/confine.c):

1. spawner: bind the sandbox's control socket at a host path under the run
   directory (sandboxes cannot see that path); make its ready pipe.
2. spawner: send the zygote the sandbox's id, id range, cgroup(s) and root
   filesystem plan (:func:`.rootfs.plan`), with the socket and the pipe.
3. zygote: open the layers as detached mounts idmapped into the sandbox's
   range; as the sandbox's root uid (so its user namespace is owned by its
   range), ``clone()`` with new user, mount, pid, net, ipc and uts
   namespaces; the child is at once PID 1 of its pid namespace, and our child.
4. zygote: write the child's pid into its cgroup(s), then its uid and gid maps
   (root inside = ``uid_base`` outside, the sandbox's own range); answer
   with the pid; release it.
5. child: ``unshare(CLONE_NEWCGROUP)``, become root, hostname, the plan
   (attaching the layers the zygote opened as idmapped mounts, ending in
   ``pivot_root``), loopback, rlimits, capabilities, ``no_new_privs``,
   seccomp; then it is init, with no exec.
6. init: one byte on the ready pipe once it accepts exec requests.
7. spawner: answer the engine with the pid and its start time.

A failing step is reported, by the zygote in its answer or by the child on
the ready pipe, as ``{"step", "errno", "target", "message"}``; the spawner
kills the child if it is still there and answers the engine with that error.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import itertools
import json
import os
import resource
import selectors
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING

from . import rootfs, zygote
from .kernel import process_start_time

if TYPE_CHECKING:
    from typing import Any

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
READY_TIMEOUT_S = 15.0
MAX_MESSAGE = 1 << 20
MAX_REPORT = 8192


class SpawnSpec:
    """What the engine asks for; parsed from its JSON request."""

    __slots__ = ("sandbox_id", "uid_base", "uid_count", "layers_uid", "cgroup_procs", "rootfs", "socket_path", "nofile", "resolv")

    def __init__(self, raw: dict[str, Any]) -> None:
        self.sandbox_id = str(raw["sandbox_id"])
        self.uid_base = int(raw["uid_base"])  # the sandbox's own range: root inside
        self.uid_count = int(raw["uid_count"])
        self.layers_uid = int(raw.get("layers_uid", self.uid_base))  # the range that owns the layers
        self.cgroup_procs = tuple(str(path) for path in raw["cgroup_procs"])
        self.rootfs = rootfs.RootfsSpec(**{**raw["rootfs"], "lower": tuple(raw["rootfs"]["lower"])})
        self.socket_path = str(raw["socket_path"])
        self.nofile = int(raw.get("nofile", 65536))
        # Its /etc/resolv.conf, written into the layer that holds its /etc/hosts: "", none. Without that layer
        # nothing would write it, and the engine, counting on it, would not either: refused, not dropped.
        self.resolv = str(raw.get("resolv", ""))
        if self.resolv and not raw["rootfs"].get("hosts"):
            raise ValueError("resolv is written beside the hosts file: a spec without one cannot have it")


class Settings:
    """The spawner's own configuration, from the environment the engine gives it.

    The spawner imports little (it is started with ``python -S`` and without
    the engine's configuration module): it starts fast and stays small.
    """

    def __init__(self, environ: dict[str, str]) -> None:
        run_dir = environ["FORKYARD_ENGINE_RUN_DIR"]
        self.socket_path = os.path.join(run_dir, "spawner.sock")
        self.init_binary = environ["FORKYARD_ENGINE_INIT_BINARY"]
        self.seccomp_program = environ["FORKYARD_SPAWNER_SECCOMP"]
        self.version = environ["FORKYARD_SPAWNER_VERSION"]


def sealed_copy(path: str) -> int:
    """The native binary in a memfd that no one, root included, can modify."""
    with open(path, "rb") as handle:
        data = handle.read()
    fd = os.memfd_create("forkyard-init", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def kept_capability_mask() -> int:
    return sum(1 << number for number in KEPT_CAPABILITIES.values())


class Pending:
    """A sandbox between its request and its init's ready byte.

    Until it is handed over it holds its message and the two descriptors that
    go with it (the control socket, the ready pipe's write end).  Then two
    things must arrive, in either order: the zygote's answer (the pid, or an
    error) and the ready pipe's outcome ('R', or a report and EOF).
    """

    __slots__ = (
        "request_id",
        "connection",
        "token",
        "pid",
        "message",
        "listener",
        "ready_write",
        "ready_read",
        "deadline",
        "socket_path",
        "answered",
        "ready",
        "ready_closed",
        "report",
    )

    def __init__(
        self,
        request_id: Any,
        connection: socket.socket,
        token: int,
        message: bytes,
        listener: socket.socket,
        ready: tuple[int, int],
        socket_path: str,
    ) -> None:
        self.request_id = request_id
        self.connection = connection
        self.token = token
        self.pid = 0
        self.message: bytes | None = message
        self.listener: socket.socket | None = listener
        self.ready_read, self.ready_write = ready
        self.deadline = time.monotonic() + READY_TIMEOUT_S
        self.socket_path = socket_path
        self.answered = False
        self.ready = False
        self.ready_closed = False
        self.report = bytearray()

    def handed_over(self) -> None:
        """Only the sandbox keeps the socket and the pipe's write end: the
        pipe's EOF then means it died."""
        self.message = None
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        if self.ready_write >= 0:
            os.close(self.ready_write)
            self.ready_write = -1


class Spawner:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.version = settings.version
        self.binary_fd = sealed_copy(settings.init_binary)
        self.selector = selectors.DefaultSelector()
        self.inflight: dict[int, Pending] = {}  # by token
        self.tokens = itertools.count(1)
        self.children: set[int] = set()
        # Inits reaped before the zygote's answer named them (killed from
        # outside in that instant): the answer must not count them as alive.
        self.unclaimed: dict[int, int] = {}
        self.connections: set[socket.socket] = set()
        self.retiring = False
        self.listener: socket.socket | None = None
        self.signal_read, signal_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        os.set_blocking(signal_write, False)
        signal.set_wakeup_fd(signal_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector.register(self.signal_read, selectors.EVENT_READ, ("signal", None))
        # Requests the zygote's socket had no room for yet, oldest first.
        self.outbox: collections.deque[Pending] = collections.deque()
        self.zygote: zygote.Zygote | None = None
        self._start_zygote()

    def _start_zygote(self) -> None:
        self.zygote = zygote.Zygote.start(self.binary_fd, kept_capability_mask(), self.settings.seccomp_program)
        self.selector.register(self.zygote.socket, selectors.EVENT_READ, ("zygote", None))
        self._flush_outbox()

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
            if self.inflight:
                timeout = max(0.0, min(p.deadline for p in self.inflight.values()) - time.monotonic())
            for key, events in self.selector.select(timeout):
                kind, payload = key.data
                if kind == "accept":
                    self._accept()
                elif kind == "request":
                    self._request(payload)
                elif kind == "zygote":
                    if events & selectors.EVENT_WRITE:
                        self._flush_outbox()
                    if events & selectors.EVENT_READ:
                        self._zygote_replies()
                elif kind == "signal":
                    self._reap()
                elif kind == "ready":
                    self._ready_output(payload)
            self._expire()
            if self.retiring and not self.children and not self.inflight:
                self._stop_zygote()
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
            except (KeyError, TypeError, ValueError) as bad_spec:
                self._send(
                    connection,
                    {
                        "request_id": request_id,
                        "ok": False,
                        "error": {"step": "parse spec", "errno": errno.EINVAL, "target": "", "message": str(bad_spec)},
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
        if self.zygote is None:
            return {"step": "hand over to the zygote", "errno": errno.ECHILD, "target": "", "message": "no zygote"}
        token = next(self.tokens)
        try:
            message = zygote.encode_spawn(
                token,
                spec.sandbox_id,
                spec.uid_base,
                spec.uid_count,
                spec.layers_uid,
                spec.nofile,
                spec.cgroup_procs,
                rootfs.layer_paths(spec.rootfs),
                zygote.encoded_plan(spec.rootfs),
                spec.resolv,
            )
        except ValueError as error:
            return {"step": "parse spec", "errno": errno.EINVAL, "target": spec.sandbox_id, "message": str(error)}
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
        ready_read, ready_write = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(ready_read, False)
        pending = Pending(request_id, connection, token, message, listener, (ready_read, ready_write), spec.socket_path)
        self.inflight[token] = pending
        self.selector.register(ready_read, selectors.EVENT_READ, ("ready", pending))
        self.outbox.append(pending)
        self._flush_outbox()
        return None

    def _flush_outbox(self) -> None:
        """Hand queued requests to the zygote while its socket has room.

        The zygote takes one at a time; a burst of creates (a launch) can
        outrun it, and then waits here, in order, rather than failing.
        """
        link = self.zygote
        while self.outbox and link is not None and not link.closed:
            pending = self.outbox[0]
            assert pending.message is not None and pending.listener is not None
            try:
                link.spawn(pending.message, pending.listener.fileno(), pending.ready_write)
            except BlockingIOError:
                break
            except (BrokenPipeError, ConnectionResetError):
                link.closed = True  # it died: the request waits for the next zygote (see _zygote_exited)
                break
            except OSError as error:
                failure = {"step": "hand over to the zygote", "errno": error.errno, "target": "", "message": str(error)}
                self._finish(pending, failure)
                continue
            self.outbox.popleft()
            pending.handed_over()
        if link is not None and not link.closed:
            wanted = selectors.EVENT_READ | (selectors.EVENT_WRITE if self.outbox else 0)
            key = self.selector.get_map().get(link.socket)
            if key is not None and key.events != wanted:
                self.selector.modify(link.socket, wanted, ("zygote", None))

    def _zygote_replies(self) -> None:
        assert self.zygote is not None
        try:
            for reply in self.zygote.replies():
                self._zygote_reply(reply)
        except EOFError:
            # It died; _reap restarts it when it collects its exit status.
            self.zygote.closed = True
            self._unwatch_zygote()
        except ValueError as error:
            print(f"spawner: {error}", file=sys.stderr, flush=True)

    def _zygote_reply(self, reply: zygote.Reply) -> None:
        if reply.pid:
            if self.unclaimed.pop(reply.pid, None) is None:
                self.children.add(reply.pid)
        pending = self.inflight.get(reply.token)
        if pending is None:
            # We already gave up on this create (it timed out): no init may run for it.
            self._kill(reply.pid)
            return
        pending.pid = reply.pid
        pending.answered = True
        if reply.error is not None:
            self._finish(pending, reply.error)
        elif pending.ready:
            self._finish(pending, None)
        elif pending.ready_closed:
            self._finish(pending, self._child_error(pending))

    def _ready_output(self, pending: Pending) -> None:
        """'R' once init listens; or a report from the failing child, then EOF."""
        try:
            data = os.read(pending.ready_read, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data.startswith(b"R") and not pending.report:
            pending.ready = True
        elif data:
            if len(pending.report) < MAX_REPORT:
                pending.report += data[: MAX_REPORT - len(pending.report)]
            return
        else:
            pending.ready_closed = True
        self.selector.unregister(pending.ready_read)
        if pending.answered:
            self._finish(pending, None if pending.ready else self._child_error(pending))

    def _child_error(self, pending: Pending) -> dict[str, Any]:
        if pending.report:
            return zygote.decode_report(bytes(pending.report))
        return {
            "step": "start init",
            "errno": errno.ECHILD,
            "target": pending.socket_path,
            "message": "init exited before it was ready",
        }

    def _kill(self, pid: int) -> None:
        # Only our own child that we have not reaped: its pid cannot have
        # been reused, so the signal reaches the right process.
        if pid in self.children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _finish(self, pending: Pending, error: dict[str, Any] | None) -> None:
        self.inflight.pop(pending.token, None)
        if pending.message is not None:  # never handed over
            self.outbox.remove(pending)
            pending.handed_over()
        try:
            self.selector.unregister(pending.ready_read)
        except (KeyError, ValueError):
            pass
        os.close(pending.ready_read)
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
            self._kill(pending.pid)
            try:
                os.unlink(pending.socket_path)
            except OSError:
                pass
            self._send(pending.connection, {"request_id": pending.request_id, "ok": False, "error": error})
            return
        self._send(
            pending.connection, {"request_id": pending.request_id, "ok": True, "pid": pending.pid, "start_time": start_time}
        )

    def _expire(self) -> None:
        now = time.monotonic()
        for pending in [p for p in self.inflight.values() if p.deadline <= now]:
            self._finish(
                pending,
                {
                    "step": "wait for init" if pending.answered else "wait for the zygote",
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
            if self.zygote is not None and pid == self.zygote.pid:
                self._zygote_exited(status)
                continue
            if pid in self.children:
                self.children.discard(pid)
            else:
                self.unclaimed[pid] = status
            # Tell every engine connected: that is how it learns a sandbox died.
            for connection in list(self.connections):
                self._send(connection, {"event": "exited", "pid": pid, "status": status})

    def _zygote_exited(self, status: int) -> None:
        """Fail the creates it had not answered, and start another (unless retiring).

        A child it cloned but never released reads EOF on its sync socket and exits.
        """
        assert self.zygote is not None
        print(f"spawner: the zygote {self.zygote.pid} exited (status {status})", file=sys.stderr, flush=True)
        self._unwatch_zygote()
        self.zygote.close()
        self.zygote = None
        # What it was given but did not answer is lost; what is still queued
        # goes to the next zygote.
        for pending in [p for p in self.inflight.values() if p.message is None and not p.answered]:
            error = {"step": "hand over to the zygote", "errno": errno.ECHILD, "target": "", "message": "the zygote exited"}
            self._finish(pending, error)
        self.unclaimed.clear()
        if not self.retiring:
            self._start_zygote()

    def _unwatch_zygote(self) -> None:
        assert self.zygote is not None
        try:
            self.selector.unregister(self.zygote.socket)
        except KeyError:
            pass  # already

    def _stop_zygote(self) -> None:
        if self.zygote is None:
            return
        self._unwatch_zygote()
        self.zygote.close()  # it exits on EOF
        try:
            os.waitpid(self.zygote.pid, 0)
        except ChildProcessError:
            pass
        self.zygote = None


def main() -> int:
    try:
        settings = Settings(dict(os.environ))
        # The zygote and every sandbox inherit our hard limit and cannot raise
        # it in their user namespace; use all of it (some hosts drop CAP_SYS_RESOURCE, so we
        # cannot go beyond it either).
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        spawner = Spawner(settings)
        spawner.listen()
        print(f"spawner {os.getpid()} version {spawner.version} listening on {settings.socket_path}", flush=True)
        spawner.serve_forever()
    except Exception:  # noqa: BLE001 - a daemon's last word goes to its log
        import traceback

        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
