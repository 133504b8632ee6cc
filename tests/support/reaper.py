"""A subreaper for the test session: the parent of every engine the tests start.

In production the engine runs under a PID 1 or supervisor that reaps orphans
(systemd, tini).  This machine's PID 1 reaps nothing, so when a test kills the
engine *and* its spawner, their orphans would stay zombies forever and the
leak checks would blame the engine for the environment.  Engines started
through this process are its children; orphans of their subtree come back to
it (PR_SET_CHILD_SUBREAPER), and it reaps them all.

Protocol: one JSON object per line on a Unix socket.
    {"op": "spawn", "argv": [...], "env": {...}, "cwd": "...", "log": "..."} -> {"pid": N}
    {"op": "status", "pid": N} -> {"exited": bool, "status": int | null}
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

PR_SET_CHILD_SUBREAPER = 36


def serve(path: str) -> None:
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    statuses: dict[int, int | None] = {}
    read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(write_end)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(read_end, selectors.EVENT_READ, "signal")
    parent = os.getppid()
    while True:
        if os.getppid() != parent:
            return  # the test session is gone
        for key, _ in selector.select(1.0):
            if key.data == "accept":
                connection, _ = listener.accept()
                selector.register(connection, selectors.EVENT_READ, "client")
            elif key.data == "signal":
                try:
                    while os.read(read_end, 4096):
                        pass
                except BlockingIOError:
                    pass
            else:
                client = key.fileobj
                assert isinstance(client, socket.socket)
                line = client.recv(1 << 20)
                if not line:
                    selector.unregister(client)
                    client.close()
                    continue
                request = json.loads(line)
                if request["op"] == "spawn":
                    with open(request["log"], "ab") as log:
                        process = subprocess.Popen(
                            request["argv"],
                            env=request["env"],
                            cwd=request["cwd"],
                            stdin=subprocess.DEVNULL,
                            stdout=log,
                            stderr=log,
                        )
                    statuses[process.pid] = None
                    reply: dict[str, Any] = {"pid": process.pid}
                else:
                    pid = int(request["pid"])
                    reply = {"exited": statuses.get(pid) is not None, "status": statuses.get(pid)}
                client.sendall(json.dumps(reply).encode() + b"\n")
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in statuses:
                statuses[pid] = os.waitstatus_to_exitcode(status)


class Reaper:
    """The test session's handle on its reaper process (started on first use)."""

    _instance: Reaper | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        import tempfile

        self.path = os.path.join(tempfile.mkdtemp(prefix="fy-reaper-", dir="/tmp"), "reaper.sock")
        self.process = subprocess.Popen([sys.executable, __file__, self.path], stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self._listening():
            if time.monotonic() > deadline:
                raise RuntimeError("the test reaper did not start")
            time.sleep(0.01)

    def _listening(self) -> bool:
        # The socket's path exists from bind(), a moment before listen(): connect to know.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(self.path)
            except OSError:
                return False
        return True

    @classmethod
    def get(cls) -> Reaper:
        with cls._lock:
            if cls._instance is None or cls._instance.process.poll() is not None:
                cls._instance = cls()
            return cls._instance

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect(self.path)
            connection.sendall(json.dumps(request).encode())
            data = b""
            while not data.endswith(b"\n"):
                chunk = connection.recv(65536)
                if not chunk:
                    break
                data += chunk
        return dict(json.loads(data))

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, log: str) -> int:
        return int(self._ask({"op": "spawn", "argv": argv, "env": env, "cwd": cwd, "log": log})["pid"])

    def status(self, pid: int) -> int | None:
        reply = self._ask({"op": "status", "pid": pid})
        return reply["status"] if reply["exited"] else None

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


if __name__ == "__main__":
    serve(sys.argv[1])
