"""The engine's local API: a Unix socket speaking :mod:`.protocol`.

Handlers only parse, call the engine and frame the answer; every error is an
:class:`EngineError` with a stable code, and anything unexpected is logged and
answered ``internal_error`` without taking the server down.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import os
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from . import protocol, templates
from .engine import VERSION, Engine
from .errors import EngineError, InvalidRequest, TooLarge
from .execution import ExecResult
from .protocol import DATA, END, JSON, ProtocolError, encode, encode_json, read_frame

log = logging.getLogger("forkyard.engine.server")
QUEUE_DEPTH = 8
HELLO_TIMEOUT_S = 5.0
# Connections waiting to be accepted: a launch's workers and a web server's
# pool connect in bursts of hundreds (the kernel caps it at somaxconn).
BACKLOG = 4096


class Body:
    """The ``D``* ``E`` frames that follow a request."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self.finished = False
        self.received = 0

    async def next_chunk(self) -> bytes | None:
        if self.finished:
            return None
        kind, payload = await read_frame(self.reader)
        if kind == END:
            self.finished = True
            return None
        if kind != DATA:
            raise ProtocolError("expected data frames after the request")
        self.received += len(payload)
        return payload

    async def drain(self) -> None:
        while await self.next_chunk() is not None:
            pass

    def blocking_chunks(self, loop: asyncio.AbstractEventLoop) -> Iterator[bytes]:
        """For a worker thread: pull chunks from the event loop, one at a time."""
        while True:
            chunk = asyncio.run_coroutine_threadsafe(self.next_chunk(), loop).result()
            if chunk is None:
                return
            if chunk:
                yield chunk


class _BodyFile:
    """A read-only file over a Body, for tarfile in a worker thread."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks = chunks
        self.pending = b""

    def read(self, size: int = -1) -> bytes:
        parts = []
        wanted = size if size >= 0 else 1 << 62
        while wanted > 0:
            if not self.pending:
                self.pending = next(self.chunks, b"")
                if not self.pending:
                    break
            piece, self.pending = self.pending[:wanted], self.pending[wanted:]
            parts.append(piece)
            wanted -= len(piece)
        return b"".join(parts)


Handler = Callable[["Call"], Awaitable[Any]]


class Call:
    def __init__(self, server: EngineServer, args: dict[str, Any], writer: asyncio.StreamWriter, body: Body | None) -> None:
        self.server = server
        self.engine = server.engine
        self.args = args
        self.writer = writer
        self.body = body

    def arg(self, name: str, kind: type | tuple[type, ...] = str, required: bool = True, default: Any = None) -> Any:
        value = self.args.get(name, default)
        if value is None:
            if required:
                raise InvalidRequest(f"{name} is required", field=name)
            return default
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            raise InvalidRequest(f"{name} has the wrong type", field=name)
        return value

    def event(self, message: dict[str, Any]) -> None:
        self.writer.write(encode_json(message))

    async def stream_from_thread(self, produce: Callable[[], Iterator[bytes]]) -> None:
        """Send ``D`` frames produced by a blocking generator in a thread.

        The first chunk (or the first error) decides between an ok header and
        an error answer; an error after that becomes the trailer.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(QUEUE_DEPTH)
        stop = threading.Event()

        def work() -> None:
            def put(item: tuple[str, Any]) -> None:
                asyncio.run_coroutine_threadsafe(queue.put(item), loop).result()

            try:
                for chunk in produce():
                    if stop.is_set():
                        return
                    put(("data", chunk))
                put(("end", None))
            except BaseException as error:  # noqa: BLE001 - reported to the caller
                put(("error", error))

        worker = loop.run_in_executor(None, work)
        kind, value = await queue.get()
        try:
            if kind == "error":
                raise value
            self.writer.write(encode_json({"ok": True, "result": {"stream": True}}))
            while kind == "data":
                self.writer.write(encode(DATA, value))
                await self.writer.drain()
                kind, value = await queue.get()
            self.writer.write(encode(END))
            if kind == "error":
                trailer = (
                    value.to_dict()
                    if isinstance(value, EngineError)
                    else {"code": "internal_error", "message": str(value), "details": {}}
                )
                self.writer.write(encode_json({"ok": False, "error": trailer}))
            else:
                self.writer.write(encode_json({"ok": True, "result": {}}))
        finally:
            stop.set()
            while not worker.done():
                try:
                    queue.get_nowait()
                except asyncio.QueueEmpty:
                    await asyncio.sleep(0.001)
        raise _AlreadyAnswered


class _AlreadyAnswered(Exception):
    pass


def _exec_result(result: ExecResult, include_output: bool) -> dict[str, Any]:
    summary = result.summary()
    if include_output:
        summary["stdout_b64"] = base64.b64encode(result.stdout).decode()
        summary["stderr_b64"] = base64.b64encode(result.stderr).decode()
    return summary


async def op_ping(call: Call) -> Any:
    return {"version": VERSION, "pid": os.getpid()}


async def op_info(call: Call) -> Any:
    return call.engine.info()


async def op_create(call: Call) -> Any:
    return await call.engine.create(call.args)


async def op_get(call: Call) -> Any:
    return call.engine.get(call.args.get("id"))


async def op_list(call: Call) -> Any:
    return {"sandboxes": call.engine.list(call.args.get("state"), call.args.get("label"))}


async def op_destroy(call: Call) -> Any:
    return await call.engine.destroy(call.args.get("id"))


async def op_pause(call: Call) -> Any:
    return await call.engine.pause(call.args.get("id"))


async def op_resume(call: Call) -> Any:
    return await call.engine.resume(call.args.get("id"))


async def op_stats(call: Call) -> Any:
    return call.engine.stats(call.args.get("id"))


async def op_pools(call: Call) -> Any:
    return {"pools": call.engine.pools.status()}


async def op_pools_set(call: Call) -> Any:
    return call.engine.pools.set_target(call.args.get("template"), call.args.get("size"), call.args.get("count"))


async def op_exec(call: Call) -> Any:
    if call.args.get("stream"):

        def forward(stream: str, data: bytes) -> None:
            call.event({"event": "output", "stream": stream, "data_b64": base64.b64encode(data).decode()})

        result = await call.engine.exec(call.args.get("id"), call.args, forward)
        return _exec_result(result, include_output=False)
    result = await call.engine.exec(call.args.get("id"), call.args)
    return _exec_result(result, include_output=True)


async def op_files_read(call: Call) -> Any:
    path = call.arg("path")
    tree = call.engine.open_tree(call.args.get("id"))
    limit = call.engine.config.max_file_bytes

    def produce() -> Iterator[bytes]:
        try:
            fd, size = tree.open_regular(path)
            try:
                if size > limit:
                    raise TooLarge(f"{path} is {size} bytes, over the {limit}-byte limit", path=path, size=size)
                remaining = size
                while remaining > 0 and (chunk := os.read(fd, min(protocol.CHUNK, remaining))):
                    remaining -= len(chunk)
                    yield chunk
            finally:
                os.close(fd)
        finally:
            os.close(tree.root_fd)

    await call.stream_from_thread(produce)


async def op_files_write(call: Call) -> Any:
    path = call.arg("path")
    mode = call.arg("mode", int, required=False, default=0o644)
    make_parents = bool(call.args.get("make_parents", False))
    assert call.body is not None
    loop = asyncio.get_running_loop()
    body = call.body
    limit = call.engine.config.max_file_bytes

    def write(tree: Any) -> Any:
        return {
            "path": path,
            "bytes": tree.write(path, lambda: body.blocking_chunks(loop), mode, limit=limit, make_parents=make_parents),
        }

    return await call.engine.with_tree(call.args.get("id"), write)


async def op_files_list(call: Call) -> Any:
    path = call.arg("path", required=False, default="/")
    return await call.engine.with_tree(call.args.get("id"), lambda tree: tree.list(path))


async def op_files_stat(call: Call) -> Any:
    path = call.arg("path")
    return await call.engine.with_tree(call.args.get("id"), lambda tree: tree.stat(path))


async def op_files_remove(call: Call) -> Any:
    path = call.arg("path")
    recursive = bool(call.args.get("recursive", False))
    removed = await call.engine.with_tree(call.args.get("id"), lambda tree: tree.remove(path, recursive=recursive))
    return {"path": path, "removed": removed}


async def op_files_mkdir(call: Call) -> Any:
    path = call.arg("path")
    await call.engine.with_tree(call.args.get("id"), lambda tree: tree.make_directories(path))
    return {"path": path}


async def op_files_download(call: Call) -> Any:
    path = call.arg("path", required=False, default="/")
    tree = call.engine.open_tree(call.args.get("id"))

    def produce() -> Iterator[bytes]:
        try:
            yield from tree.tar_chunks(path)
        finally:
            os.close(tree.root_fd)

    await call.stream_from_thread(produce)


async def op_files_upload(call: Call) -> Any:
    path = call.arg("path", required=False, default="/")
    assert call.body is not None
    loop = asyncio.get_running_loop()
    body = call.body
    return await call.engine.with_tree(
        call.args.get("id"),
        lambda tree: tree.extract(_BodyFile(body.blocking_chunks(loop)), path),  # type: ignore[arg-type]
    )


async def op_templates_list(call: Call) -> Any:
    return {"templates": [vars(record) for record in call.engine.templates.list()]}


async def op_templates_get(call: Call) -> Any:
    return vars(call.engine.templates.get(call.arg("name")))


async def op_templates_delete(call: Call) -> Any:
    call.engine.delete_template(call.args.get("name"))
    return {"deleted": call.args.get("name")}


async def op_templates_import(call: Call) -> Any:
    name = templates.validate_name(call.args.get("name"))
    source = call.arg("source")
    kind = call.arg("kind", required=False, default="auto")
    loop = asyncio.get_running_loop()

    def progress(event: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(call.event, {"event": "progress", **event})

    record = await asyncio.to_thread(
        call.engine.templates.import_template,
        name,
        source,
        kind,
        bool(call.args.get("replace")),
        call.args.get("env"),
        call.args.get("workdir"),
        progress,
    )
    return vars(record)


async def op_templates_build_base(call: Call) -> Any:
    name = templates.validate_name(call.args.get("name", "base"))
    staging = call.engine.config.state_dir / "staging" / name

    def build() -> Any:
        templates.build_base_rootfs(staging)
        try:
            return call.engine.templates.import_template(name, str(staging), "directory", bool(call.args.get("replace", True)))
        finally:
            import shutil

            shutil.rmtree(staging, ignore_errors=True)

    return vars(await asyncio.to_thread(build))


async def op_snapshots_create(call: Call) -> Any:
    loop = asyncio.get_running_loop()
    loop_thread = threading.get_ident()

    def progress(event: dict[str, Any]) -> None:
        message = {"event": "progress", **event}
        if threading.get_ident() == loop_thread:
            call.event(message)  # now: a scheduled write could follow the answer
        else:
            loop.call_soon_threadsafe(call.event, message)

    return vars(await call.engine.snapshots.take(call.args, progress))


async def op_snapshots_export(call: Call) -> Any:
    produce = call.engine.snapshots.export_stream(call.args.get("name"), call.args.get("have", []))
    await call.stream_from_thread(lambda: produce)


async def op_snapshots_import(call: Call) -> Any:
    assert call.body is not None
    loop = asyncio.get_running_loop()
    body = call.body
    stream = _BodyFile(body.blocking_chunks(loop))
    return vars(await asyncio.to_thread(call.engine.snapshots.import_stream, stream))  # type: ignore[arg-type]


OPS: dict[str, Handler] = {
    "ping": op_ping,
    "info": op_info,
    "create": op_create,
    "get": op_get,
    "list": op_list,
    "destroy": op_destroy,
    "pause": op_pause,
    "resume": op_resume,
    "stats": op_stats,
    "pools": op_pools,
    "pools.set": op_pools_set,
    "exec": op_exec,
    "files.read": op_files_read,
    "files.write": op_files_write,
    "files.list": op_files_list,
    "files.stat": op_files_stat,
    "files.remove": op_files_remove,
    "files.mkdir": op_files_mkdir,
    "files.download": op_files_download,
    "files.upload": op_files_upload,
    "templates.list": op_templates_list,
    "templates.get": op_templates_get,
    "templates.delete": op_templates_delete,
    "templates.import": op_templates_import,
    "templates.build_base": op_templates_build_base,
    "snapshots.create": op_snapshots_create,
    "snapshots.export": op_snapshots_export,
    "snapshots.import": op_snapshots_import,
}
BODY_OPS = {"files.write", "files.upload", "snapshots.import"}


class EngineServer:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.server: asyncio.AbstractServer | None = None
        self.tcp_server: asyncio.AbstractServer | None = None
        self.token = b""

    async def listen(self, path: Path | None = None) -> None:
        path = path or self.engine.config.socket_path
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        self.server = await asyncio.start_unix_server(self._connection, str(path), limit=protocol.MAX_FRAME + 16, backlog=BACKLOG)
        os.chmod(path, 0o600)

    async def listen_tcp(self, address: str, token: str) -> None:
        """Also answer on TCP, to callers that first present the token."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidRequest(f"listen address {address!r} is not host:port", field="listen")
        if len(token) < 16:
            raise InvalidRequest("a TCP listener needs a token of at least 16 characters", field="token")
        self.token = token.encode()
        self.tcp_server = await asyncio.start_server(
            self._tcp_connection, host.strip("[]"), int(port), limit=protocol.MAX_FRAME + 16, backlog=BACKLOG
        )

    async def _tcp_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The first frame must be ``hello`` with the token; then the same protocol as the socket."""
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            kind, payload = await asyncio.wait_for(read_frame(reader), HELLO_TIMEOUT_S)
            request = protocol.decode_json(payload) if kind == JSON else {}
            presented = str((request.get("args") or {}).get("token", "")).encode()
            if request.get("op") != "hello" or not hmac.compare_digest(presented, self.token):
                error = {"code": "unauthorized", "message": "present the engine's token first (op hello)", "details": {}}
                writer.write(encode_json({"ok": False, "error": error}))
                await writer.drain()
                writer.close()
                return
        except (TimeoutError, ProtocolError, ConnectionError, asyncio.IncompleteReadError, ValueError, AttributeError):
            writer.close()
            return
        writer.write(encode_json({"ok": True, "result": {"version": VERSION}}))
        await self._connection(reader, writer)

    async def close(self) -> None:
        for server in (self.server, self.tcp_server):
            if server is not None:
                server.close()
                await server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    kind, payload = await read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                if kind != JSON:
                    raise ProtocolError("a request starts with a JSON frame")
                request = protocol.decode_json(payload)
                op = request.get("op")
                args = request.get("args") or {}
                body = Body(reader) if op in BODY_OPS else None
                await self._answer(op, args, writer, body)
                if body is not None:
                    await body.drain()
                await writer.drain()
        except ProtocolError as error:
            writer.write(encode_json({"ok": False, "error": {"code": "protocol_error", "message": str(error), "details": {}}}))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            try:
                writer.close()
            except Exception:  # noqa: BLE001
                pass

    async def _answer(self, op: Any, args: Any, writer: asyncio.StreamWriter, body: Body | None) -> None:
        handler = OPS.get(op) if isinstance(op, str) else None
        try:
            if handler is None:
                raise InvalidRequest(f"unknown operation {str(op)[:50]!r}", field="op", ops=sorted(OPS))
            if not isinstance(args, dict):
                raise InvalidRequest("args must be an object", field="args")
            result = await handler(Call(self, args, writer, body))
            writer.write(encode_json({"ok": True, "result": result}))
        except _AlreadyAnswered:
            pass
        except EngineError as error:
            writer.write(encode_json({"ok": False, "error": error.to_dict()}))
        except (ProtocolError, ConnectionError, asyncio.IncompleteReadError):
            raise
        except Exception as error:  # noqa: BLE001 - the server must answer and live on
            log.exception("operation %s failed", op)
            writer.write(
                encode_json(
                    {
                        "ok": False,
                        "error": {"code": "internal_error", "message": f"{type(error).__name__}: {error}", "details": {"op": op}},
                    }
                )
            )
