"""Services a snapshot brings back to life in every fork.

This kernel cannot checkpoint process memory (CRIU fails on it), so a
snapshot holds files, not processes.  What the environment needs running (a
database, a web server the task talks to) is recorded with the snapshot as a
service: a start command and a readiness check.  Every sandbox made from the
snapshot starts its services and is handed over only once each one answers
(each but those marked ``"wait": false``: started with the others, their
readiness the caller's to wait for, as a desktop's browser is).
A memory image could later replace the restart; the record keeps room for it
(``kind`` stays "restart" until then).

A service runs detached under the sandbox's init, with the sandbox's
confinement like any exec, its output appended to
``/var/log/forkyard/<name>.log`` inside the sandbox.  Readiness is checked
from the host without trusting tools in the template:

* ``{"tcp": port}``: a TCP connection to 127.0.0.1:port succeeds;
* ``{"http": {"port": p, "path": "/health"}}``: a GET answers below 500;
* ``{"exec": "command"}``: the command exits 0 in the sandbox.

TCP and HTTP checks connect from a socket made inside the sandbox's network
namespace (the engine's thread enters it for one ``socket()`` call and comes
back), so they reach the sandbox's loopback and nothing else.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .errors import InvalidRequest, ServiceNotReady
from .kernel import CLONE_NEWNET, Kernel

NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
MAX_SERVICES = 8
DEFAULT_TIMEOUT_S = 30.0
MAX_TIMEOUT_S = 300.0
LOG_DIR = "/var/log/forkyard"


def validate(raw: Any) -> list[dict[str, Any]]:
    """The services of a snapshot, normalised; InvalidRequest names the bad field."""
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_SERVICES:
        raise InvalidRequest(f"services must be a list of at most {MAX_SERVICES}", field="services")
    services: list[dict[str, Any]] = []
    for index, item in enumerate(raw):
        where = f"services.{index}"
        if not isinstance(item, dict):
            raise InvalidRequest("a service is an object with name, command and ready", field=where)
        unknown = set(item) - {"name", "command", "ready", "timeout_s", "kind", "wait"}
        if unknown:
            raise InvalidRequest(f"unknown service fields: {', '.join(sorted(unknown))}", field=where)
        name = item.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidRequest("a service name is 1-32 of a-z, 0-9, '-' and '_'", field=f"{where}.name")
        if any(service["name"] == name for service in services):
            raise InvalidRequest(f"two services are named {name!r}", field=f"{where}.name")
        command = item.get("command")
        if not isinstance(command, str) or not command.strip() or "\0" in command or len(command) > 4096:
            raise InvalidRequest("command is a shell command of at most 4096 characters", field=f"{where}.command")
        timeout = item.get("timeout_s", DEFAULT_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT_S:
            raise InvalidRequest(f"timeout_s is a number of seconds up to {MAX_TIMEOUT_S:g}", field=f"{where}.timeout_s")
        wait = item.get("wait", True)
        if not isinstance(wait, bool):
            raise InvalidRequest("wait is true or false", field=f"{where}.wait")
        service = {"name": name, "command": command, "ready": _ready(item.get("ready"), f"{where}.ready"), "timeout_s": float(timeout)}
        if not wait:
            service["wait"] = False  # kept only when off: a record without it is waited for, as before it existed
        services.append(service)
    return services


def waited(service: dict[str, Any]) -> bool:
    """Is a fork handed over only once this service answers?"""
    return bool(service.get("wait", True))


def _port(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise InvalidRequest("a port is an integer from 1 to 65535", field=field)
    return value


def _ready(raw: Any, field: str) -> dict[str, Any]:
    if not isinstance(raw, dict) or len(raw) != 1:
        raise InvalidRequest(
            'ready is one of {"tcp": port}, {"http": {"port": p, "path": "/"}}, {"exec": "command"}', field=field
        )
    ((kind, value),) = raw.items()
    if kind == "tcp":
        return {"tcp": _port(value, f"{field}.tcp")}
    if kind == "http":
        if not isinstance(value, dict):
            raise InvalidRequest('http readiness is {"port": p, "path": "/..."}', field=f"{field}.http")
        path = value.get("path", "/")
        if not isinstance(path, str) or not path.startswith("/") or len(path) > 1024 or any(c in path for c in "\r\n \0"):
            raise InvalidRequest("path is an absolute URL path without spaces", field=f"{field}.http.path")
        return {"http": {"port": _port(value.get("port"), f"{field}.http.port"), "path": path}}
    if kind == "exec":
        if not isinstance(value, str) or not value.strip() or "\0" in value or len(value) > 4096:
            raise InvalidRequest("exec readiness is a shell command", field=f"{field}.exec")
        return {"exec": value}
    raise InvalidRequest(f"unknown readiness check {kind!r}: use tcp, http or exec", field=field)


def start_argv(service: dict[str, Any]) -> list[str]:
    """A shell that starts the service detached and returns at once."""
    log = f"{LOG_DIR}/{service['name']}.log"
    script = f"mkdir -p {LOG_DIR} && ( {service['command']}\n) </dev/null >>{log} 2>&1 &"
    return ["/bin/sh", "-c", script]


def netns_socket(kernel: Kernel, proc_dir: str, pid: int) -> socket.socket:
    """A TCP socket in the network namespace of ``pid`` (made there; usable from anywhere)."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(f"{proc_dir}/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            kernel.setns(target, CLONE_NEWNET)
            try:
                made = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            finally:
                kernel.setns(home, CLONE_NEWNET)  # never leave this thread in the sandbox
        finally:
            os.close(target)
    finally:
        os.close(home)
    made.setblocking(False)
    return made


async def probe(service: dict[str, Any], open_socket: Callable[[], socket.socket], run: Callable[[str], Awaitable[int]]) -> bool:
    """One readiness check; True when the service answers."""
    check = service["ready"]
    if "exec" in check:
        return await run(check["exec"]) == 0
    port = check["tcp"] if "tcp" in check else check["http"]["port"]
    loop = asyncio.get_running_loop()
    connection = open_socket()
    try:
        await asyncio.wait_for(loop.sock_connect(connection, ("127.0.0.1", port)), 1.0)
        if "tcp" in check:
            return True
        request = f"GET {check['http']['path']} HTTP/1.0\r\nHost: 127.0.0.1\r\nUser-Agent: forkyard-readiness\r\n\r\n"
        await loop.sock_sendall(connection, request.encode())
        head = await asyncio.wait_for(loop.sock_recv(connection, 64), 2.0)
        parts = head.split(b" ", 2)
        return len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit() and int(parts[1]) < 500
    except (OSError, TimeoutError):
        return False
    finally:
        connection.close()


async def wait_ready(
    service: dict[str, Any], open_socket: Callable[[], socket.socket], run: Callable[[str], Awaitable[int]]
) -> float:
    """Poll until the service answers (seconds it took), or raise ServiceNotReady."""
    started = time.monotonic()
    deadline = started + service["timeout_s"]
    delay = 0.001  # most services answer within milliseconds of starting
    while True:
        if await probe(service, open_socket, run):
            return time.monotonic() - started
        if time.monotonic() + delay > deadline:
            raise ServiceNotReady(
                f"service {service['name']!r} did not answer within {service['timeout_s']:g} s"
                f" (its output is in {LOG_DIR}/{service['name']}.log)",
                service=service["name"],
            )
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)
