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
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from . import ports, protocol, template_store
from .engine import VERSION, Engine
from .errors import EngineError, InvalidImage, InvalidRequest, TemplateImportFailed, TooLarge
from .execution import ExecResult
from .gateway import SMALL_BODY, Gateway
from .protocol import DATA, END, HEADER, JSON, OUTPUT_TAGS, ProtocolError, encode, encode_json, read_frame

log = logging.getLogger("forkyard.engine.server")
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
        if not self.writer.transport.is_closing():
            self.writer.write(encode_json(message))

    def data(self, payload: bytes) -> None:
        if not self.writer.transport.is_closing():
            self.writer.write(encode(DATA, payload))

    def congested(self) -> bool:
        """The caller is not reading as fast as we write (execution.Flow)."""
        transport = self.writer.transport
        return transport.get_write_buffer_size() >= transport.get_write_buffer_limits()[1]

    async def drained(self) -> None:
        await self.writer.drain()  # ConnectionResetError once the caller is gone

    async def stream_from_thread(self, produce: Callable[[], Iterator[bytes]]) -> None:
        """Send ``D`` frames produced by a blocking generator, one step at a time
        in a worker thread.

        No thread ever waits for the caller: each step takes a thread only
        while it makes its chunk, so a caller that stops reading holds no
        thread (the engine's threads do all its file work; a few stalled
        downloads once took them all, and every download after them waited
        forever).  The first chunk (or the first error) decides between an ok
        header and an error answer; after it, any failure (the producer's, or
        ours) ends the stream: ``E``, then the error as the trailer, which
        the clients raise.  Only a caller that went away gets no trailer.
        """
        steps = _Steps(produce)
        try:
            chunk = await steps.next()
        except BaseException:
            steps.close()
            raise
        self.writer.write(encode_json({"ok": True, "result": {"stream": True}}))
        failure: BaseException | None = None
        try:
            while chunk is not None:
                if chunk:
                    self.writer.write(encode(DATA, chunk))
                    await self.writer.drain()
                chunk = await steps.next()
        except ConnectionError:
            raise  # the caller is gone: nobody to tell
        except Exception as error:  # noqa: BLE001 - it becomes the trailer
            failure = error
        finally:
            steps.close()
        self.writer.write(encode(END))
        self.writer.write(_trailer(failure))
        raise _AlreadyAnswered


class _Steps:
    """A blocking generator advanced one item at a time in the loop's worker threads."""

    def __init__(self, produce: Callable[[], Iterator[bytes]]) -> None:
        self.produce = produce
        self.chunks: Iterator[bytes] | None = None
        self.closed = False
        # Held by the step that runs: a step abandoned by a cancelled caller
        # still runs in its thread, and the generator must not be closed under it.
        self.lock = threading.Lock()

    def _step(self) -> bytes | None:
        with self.lock:
            if self.closed:
                return None
            if self.chunks is None:
                self.chunks = iter(self.produce())
            return next(self.chunks, None)

    async def next(self) -> bytes | None:
        return await asyncio.get_running_loop().run_in_executor(None, self._step)

    def _finish(self) -> None:
        with self.lock:
            self.closed = True
            close = getattr(self.chunks, "close", None)
            if close is not None:
                close()  # its finally blocks close its fds

    def close(self) -> None:
        """Close the generator once no step runs (now, or in a thread after the running one)."""
        if self.lock.acquire(blocking=False):
            self.lock.release()
            self._finish()
        else:
            asyncio.get_running_loop().run_in_executor(None, self._finish)


def _trailer(failure: BaseException | None) -> bytes:
    """The frame after ``E``: ok, or what cut the stream short."""
    if failure is None:
        return encode_json({"ok": True, "result": {}})
    if isinstance(failure, EngineError):
        try:
            return encode_json({"ok": False, "error": failure.to_dict()})
        except (TypeError, ValueError):
            pass  # details that do not serialize: the message alone
    message = failure.message if isinstance(failure, EngineError) else f"{type(failure).__name__}: {failure}"
    code = failure.code if isinstance(failure, EngineError) else "internal_error"
    return encode_json({"ok": False, "error": {"code": code, "message": message, "details": {}}})


class _AlreadyAnswered(Exception):
    pass


def _exec_result(result: ExecResult) -> dict[str, Any]:
    """The answer to an exec: its summary (its output went ahead, as it was read)."""
    return result.summary()


async def op_ping(call: Call) -> Any:
    return {"version": VERSION, "pid": os.getpid()}


async def op_info(call: Call) -> Any:
    info = call.engine.info()
    if call.server.gateway is not None:
        info["gateway"] = call.server.gateway.info()
    return info


async def op_gateway_info(call: Call) -> Any:
    """Where this host's gateway answers, and the key its data tokens are signed with (for the control plane,
    which mints them: over this authenticated connection only, never in ``info``)."""
    gateway = call.server.gateway
    if gateway is None:
        return {"url": "", "secret_b64": ""}
    return {"url": gateway.url, "secret_b64": base64.b64encode(gateway.secret).decode()}


async def op_gateway_revoke(call: Call) -> Any:
    """Refuse every data token of these API keys from now on (a key was revoked)."""
    keys = call.arg("keys", list)
    if not all(isinstance(key, str) and 0 < len(key) <= 64 for key in keys) or len(keys) > 1000:
        raise InvalidRequest("keys must be a list of at most 1,000 key ids", field="keys")
    gateway = call.server.gateway
    return {"revoked": 0 if gateway is None else gateway.revoke(keys, time.time())}


async def op_create(call: Call) -> Any:
    return await call.engine.create(call.args)


async def op_get(call: Call) -> Any:
    return call.engine.get(call.args.get("id"))


async def op_list(call: Call) -> Any:
    return {"sandboxes": call.engine.list(call.args.get("state"), call.args.get("label"))}


async def op_destroy(call: Call) -> Any:
    return await call.engine.destroy(call.args.get("id"))


async def op_destroy_many(call: Call) -> Any:
    return {"sandboxes": await call.engine.destroy_many(call.args.get("ids"))}


async def op_pause(call: Call) -> Any:
    return await call.engine.pause(call.args.get("id"))


async def op_resume(call: Call) -> Any:
    return await call.engine.resume(call.args.get("id"))


async def op_stats(call: Call) -> Any:
    return call.engine.stats(call.args.get("id"))


async def op_update(call: Call) -> Any:
    return call.engine.update(call.args.get("id"), call.args)


async def op_network_set(call: Call) -> Any:
    return await call.engine.set_network(call.args.get("id"), call.args)


async def op_network_set_many(call: Call) -> Any:
    return {"sandboxes": await call.engine.set_networks(call.args.get("items"))}


async def op_pools(call: Call) -> Any:
    return {"pools": call.engine.pools.status()}


async def op_pools_set(call: Call) -> Any:
    return call.engine.pools.set_target(call.args.get("template"), call.args.get("size"), call.args.get("count"))


async def op_exec(call: Call) -> Any:
    """Output goes to the caller as it is read, paced by how fast the caller
    reads (the engine never holds a command's whole output): as ``output``
    events when streaming, else as data frames before the answer, each
    ``1`` (stdout) or ``2`` (stderr) then the bytes (the clients put them
    back together as ``stdout_b64`` and ``stderr_b64``)."""
    if call.args.get("stream"):

        def forward(stream: str, data: bytes) -> None:
            call.event({"event": "output", "stream": stream, "data_b64": base64.b64encode(data).decode()})

    else:

        def forward(stream: str, data: bytes) -> None:
            call.data(OUTPUT_TAGS[stream] + data)

    result = await call.engine.exec(call.args.get("id"), call.args, forward, call)
    return _exec_result(result)


async def op_processes_start(call: Call) -> Any:
    return await call.engine.start_process(call.args.get("id"), call.args)


async def op_processes_list(call: Call) -> Any:
    return {"processes": call.engine.list_processes(call.args.get("id"))}


async def op_processes_get(call: Call) -> Any:
    return call.engine.process_output(call.args)


async def op_processes_signal(call: Call) -> Any:
    return call.engine.signal_process(call.args)


async def op_processes_wait(call: Call) -> Any:
    return await call.engine.wait_process(call.args)


async def op_processes_input(call: Call) -> Any:
    return await call.engine.process_input(call.args)


async def op_processes_resize(call: Call) -> Any:
    return call.engine.resize_process(call.args)


async def op_processes_attach(call: Call) -> Any:
    """A process's output as it comes, as ``output`` events (``stream``, ``data_b64``, ``offset``, and
    ``missed_bytes`` when the tail no longer held what the offset asked for), paced by the caller; the
    answer, once it has exited and everything was sent, is its summary.  Ending it (the caller's
    connection closing) leaves the process running."""
    process = call.engine.find_process(call.args)
    offsets = {name: call.arg(f"{name}_offset", int, required=False, default=0) for name in ("stdout", "stderr")}
    while True:
        sent = False
        for name, tail in (("stdout", process.stdout), ("stderr", process.stderr)):
            data, begin, missed = tail.since(offsets[name])
            if data or missed:
                event: dict[str, Any] = {"event": "output", "stream": name, "data_b64": base64.b64encode(data).decode()}
                event["offset"] = begin
                if missed:
                    event["missed_bytes"] = missed
                call.event(event)
                offsets[name] = begin + len(data)
                sent = True
        if sent:
            await call.drained()  # paced by the caller; then look again before waiting for more
            continue
        if not process.running:
            return process.summary()
        await process.changed()


async def op_files_read(call: Call) -> Any:
    path = call.arg("path")
    tree = call.engine.open_tree(call.args.get("id"))

    def produce() -> Iterator[bytes]:
        fd, size = call.engine.open_file(tree, path)
        try:
            remaining = size
            while remaining > 0 and (chunk := os.read(fd, min(protocol.CHUNK, remaining))):
                remaining -= len(chunk)
                yield chunk
        finally:
            os.close(fd)

    await call.stream_from_thread(produce)


async def op_files_write(call: Call) -> Any:
    path = call.arg("path")
    mode = call.arg("mode", int, required=False, default=0o644)
    make_parents = bool(call.args.get("make_parents", False))
    assert call.body is not None
    loop = asyncio.get_running_loop()
    body = call.body
    # The first SMALL_BODY bytes are read here, on the loop: a small file (most are) is then written whole,
    # and the writer's thread waits on the loop for a chunk only when there is more (as the gateway does).
    head: list[bytes] = []
    size = 0
    while size <= SMALL_BODY:
        chunk = await body.next_chunk()
        if chunk is None:
            return await call.engine.write_file(call.args.get("id"), path, b"".join(head), mode, make_parents)
        head.append(chunk)
        size += len(chunk)

    def chunks() -> Iterator[bytes]:
        yield from head
        yield from body.blocking_chunks(loop)

    return await call.engine.write_file(call.args.get("id"), path, chunks, mode, make_parents)


async def op_files_list(call: Call) -> Any:
    path = call.arg("path", required=False, default="/")
    return await call.engine.with_tree(call.args.get("id"), lambda tree: tree.list(path))


async def op_files_stat(call: Call) -> Any:
    path = call.arg("path")
    return await call.engine.with_tree(call.args.get("id"), lambda tree: tree.stat(path))


async def op_files_remove(call: Call) -> Any:
    path = call.arg("path")
    recursive = bool(call.args.get("recursive", False))
    removed = await call.engine.with_writer(call.args.get("id"), lambda tree: tree.remove(path, recursive=recursive))
    return {"path": path, "removed": removed}


async def op_files_mkdir(call: Call) -> Any:
    path = call.arg("path")
    await call.engine.with_writer(call.args.get("id"), lambda tree: tree.make_directories(path))
    return {"path": path}


async def op_files_rename(call: Call) -> Any:
    path, target = call.arg("path"), call.arg("target")
    replace = call.arg("replace", bool, required=False, default=False)
    await call.engine.with_writer(call.args.get("id"), lambda tree: tree.rename(path, target, replace))
    return {"path": path, "target": target}


WATCH_POLL_S = 1.0  # how often a quiet watch checks that its sandbox still runs


async def op_files_watch(call: Call) -> Any:
    """A directory's changes as ``watch`` events (watches.py): first ``ready``
    once the watch is in place, then each change, until the caller hangs up
    (a caller-bound op), ``timeout_s`` passes, the directory goes, or the
    sandbox stops.  The answer says which (``reason``).  Events wait in the
    watch's bounded queue while the caller is slow to read."""
    path = call.arg("path", required=False, default="/")
    timeout_s = call.arg("timeout_s", (int, float), required=False)
    if timeout_s is not None and not 0 < timeout_s <= 24 * 3600:
        raise InvalidRequest("timeout_s must be over 0 and at most a day", field="timeout_s")
    sandbox_id = call.arg("id")
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    watch = await call.engine.watch(sandbox_id, path)
    try:
        call.event({"event": "watch", "type": "ready", "path": path})
        while True:
            for message in watch.take():
                call.event({"event": "watch", **message})
            if call.congested():
                await call.drained()
            if watch.ended is not None and not watch.queue and not watch.dropped:
                reason = f"directory_{watch.ended}"
                break
            if not call.engine.still_running(sandbox_id):
                reason = "sandbox_ended"
                break
            remaining = WATCH_POLL_S if deadline is None else min(WATCH_POLL_S, deadline - loop.time())
            if remaining <= 0:
                reason = "timeout"
                break
            try:
                await asyncio.wait_for(watch.ready.wait(), remaining)
            except TimeoutError:
                pass
    finally:
        watch.close()
    return {"path": path, "reason": reason}


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
    return await call.engine.with_writer(
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
    name = template_store.validate_name(call.args.get("name"))
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
        call.args.get("user"),
    )
    return vars(record)


async def op_templates_upload(call: Call) -> Any:
    """An image archive as the call's body (an OCI archive, a ``docker save``/``podman save`` one, or a root
    filesystem's tarball), imported as a snapshot of no parent named ``name`` (the control plane's snapshot
    id). Held in ``<state>/staging`` (root's only) while it is unpacked, at most ``max_image_mib``
    (``too_large`` past it), and removed after, whatever happened."""
    name = template_store.validate_name(call.args.get("name"))
    kind = call.arg("kind", required=False, default="auto")
    if kind not in ("auto", "oci", "tar"):
        raise InvalidRequest("kind is auto, oci or tar", field="kind")
    assert call.body is not None
    loop = asyncio.get_running_loop()
    body = call.body
    limit = call.engine.config.max_image_mib * 1024 * 1024
    staging = call.engine.config.state_dir / "staging"
    path = staging / f"upload-{name}-{os.urandom(4).hex()}"

    def receive() -> int:
        staging.mkdir(mode=0o700, exist_ok=True)
        written = 0
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "wb") as out:
            for chunk in body.blocking_chunks(loop):
                written += len(chunk)
                if written > limit:
                    raise TooLarge(f"an image archive is at most {call.engine.config.max_image_mib} MiB here")
                out.write(chunk)
        return written

    def progress(event: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(call.event, {"event": "progress", **event})

    try:
        received = await asyncio.to_thread(receive)
        call.event({"event": "progress", "phase": "received", "bytes": received})
        record = await asyncio.to_thread(
            call.engine.templates.import_template,
            name,
            str(path),
            kind,
            False,
            None,
            None,
            progress,
            call.args.get("user"),
            True,
        )
    except (TemplateImportFailed, InvalidRequest) as error:
        if error.details.get("field") not in (None, "body"):
            raise  # a bad argument (user): the caller's field, as it named it
        # What the archive lacks, said of the upload rather than of this host's staging file.
        raise InvalidImage(error.message.replace(str(path), "the upload"), field="body") from None
    finally:
        path.unlink(missing_ok=True)
    return vars(record)


async def op_templates_build_base(call: Call) -> Any:
    name = template_store.validate_name(call.args.get("name", "base"))
    staging = call.engine.config.state_dir / "staging" / name

    def build() -> Any:
        template_store.build_base_rootfs(staging)
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


async def op_ports_wait(call: Call) -> Any:
    """Until something in the sandbox accepts on ``port`` (or ``timeout_s`` passes): ``{port, listening, waited_s}``."""
    return await call.engine.wait_port(call.args.get("id"), call.args.get("port"), call.args.get("timeout_s", 30))


async def op_desktop_screenshot(call: Call) -> Any:
    """The sandbox's screen as an image (desktop.py): its bytes as ``image_b64``."""
    shot = await call.engine.desktop.screenshot(call.args.get("id"), call.args)
    return {**{name: value for name, value in shot.items() if name != "image"}, "image_b64": base64.b64encode(shot["image"]).decode()}


async def op_desktop_info(call: Call) -> Any:
    return await call.engine.desktop.info(call.args.get("id"))


async def op_desktop_act(call: Call) -> Any:
    return await call.engine.desktop.act(call.args.get("id"), call.args.get("actions"))


async def op_model_servers_ensure(call: Call) -> Any:
    """A dedicated endpoint's model server running on this host (model_servers.py); a replay returns it."""
    return await call.engine.model_servers.ensure(call.args)


async def op_model_servers_remove(call: Call) -> Any:
    return await call.engine.model_servers.remove(call.arg("id"))


async def op_model_servers_list(call: Call) -> Any:
    return {"servers": call.engine.model_servers.listed()}


async def tunnel_ports_connect(
    server: EngineServer, args: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """``ports.connect`` (ports.py): answer, then the connection is a byte relay to the sandbox's port."""
    try:
        connected = await server.engine.connect_port(args.get("id"), args.get("port"))
    except EngineError as error:
        writer.write(encode_json({"ok": False, "error": error.to_dict()}))
        await writer.drain()
        return
    writer.write(encode_json({"ok": True, "result": {"relay": True, "port": args.get("port")}}))
    await ports.relay(reader, writer, connected)


OPS: dict[str, Handler] = {
    "ping": op_ping,
    "info": op_info,
    "create": op_create,
    "get": op_get,
    "list": op_list,
    "destroy": op_destroy,
    "destroy_many": op_destroy_many,
    "pause": op_pause,
    "resume": op_resume,
    "stats": op_stats,
    "update": op_update,
    "network.set": op_network_set,
    "network.set_many": op_network_set_many,
    "pools": op_pools,
    "gateway.info": op_gateway_info,
    "gateway.revoke": op_gateway_revoke,
    "pools.set": op_pools_set,
    "exec": op_exec,
    "processes.start": op_processes_start,
    "processes.list": op_processes_list,
    "processes.get": op_processes_get,
    "processes.signal": op_processes_signal,
    "processes.wait": op_processes_wait,
    "processes.input": op_processes_input,
    "processes.resize": op_processes_resize,
    "processes.attach": op_processes_attach,
    "files.read": op_files_read,
    "files.write": op_files_write,
    "files.list": op_files_list,
    "files.stat": op_files_stat,
    "files.remove": op_files_remove,
    "files.mkdir": op_files_mkdir,
    "files.rename": op_files_rename,
    "files.watch": op_files_watch,
    "files.download": op_files_download,
    "files.upload": op_files_upload,
    "templates.list": op_templates_list,
    "templates.get": op_templates_get,
    "templates.delete": op_templates_delete,
    "templates.import": op_templates_import,
    "templates.upload": op_templates_upload,
    "templates.build_base": op_templates_build_base,
    "snapshots.create": op_snapshots_create,
    "snapshots.export": op_snapshots_export,
    "snapshots.import": op_snapshots_import,
    "ports.wait": op_ports_wait,
    "desktop.screenshot": op_desktop_screenshot,
    "desktop.info": op_desktop_info,
    "desktop.act": op_desktop_act,
    "model_servers.ensure": op_model_servers_ensure,
    "model_servers.remove": op_model_servers_remove,
    "model_servers.list": op_model_servers_list,
}
# Operations that take the connection over: after their answer it carries raw bytes, then closes.
TUNNEL_OPS = {"ports.connect": tunnel_ports_connect}
BODY_OPS = {"files.write", "files.upload", "snapshots.import", "templates.upload"}
# Work that has no point once its caller is gone: it ends when the connection does.
# (A wait or an attach ends; the process it watches runs on.)
CALLER_BOUND_OPS = {"exec", "files.watch", "processes.wait", "processes.attach", "ports.wait"}


class EngineServer:
    def __init__(self, engine: Engine, gateway: Gateway | None = None) -> None:
        self.engine = engine
        self.gateway = gateway
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
        header: bytes | None = None  # the next request's, if read while watching the last one's caller
        try:
            while True:
                try:
                    kind, payload = await read_frame(reader, header)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                header = None
                if kind != JSON:
                    raise ProtocolError("a request starts with a JSON frame")
                request = protocol.decode_json(payload)
                op = request.get("op")
                args = request.get("args") or {}
                if isinstance(op, str) and op in TUNNEL_OPS and isinstance(args, dict):
                    await TUNNEL_OPS[op](self, args, reader, writer)
                    return
                if op in CALLER_BOUND_OPS:
                    header = await self._answer_while_caller_stays(op, args, writer, reader)
                    await writer.drain()
                    continue
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

    async def _answer_while_caller_stays(
        self, op: str, args: Any, writer: asyncio.StreamWriter, reader: asyncio.StreamReader
    ) -> bytes | None:
        """Answer, but end the work if the caller closes its connection first
        (an exec's command is killed: execution.py).  While it runs, the
        connection is watched for its end; should the caller send its next
        request meanwhile, that request's header is returned to be read next
        (readexactly takes all of a header or nothing, so cancelling the watch
        loses no byte)."""
        answer = asyncio.ensure_future(self._answer(op, args, writer, None))
        watch = asyncio.ensure_future(reader.readexactly(HEADER.size))
        try:
            await asyncio.wait((answer, watch), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            answer.cancel()
            watch.cancel()
            raise
        if not watch.done():
            watch.cancel()
            try:
                await watch
            except asyncio.CancelledError:
                pass
            await answer
            return None
        try:
            header = watch.result()
        except (asyncio.IncompleteReadError, ConnectionError) as gone:
            answer.cancel()
            try:
                await answer
            except (asyncio.CancelledError, ConnectionError):
                pass
            raise ConnectionResetError("the caller went away") from gone
        await answer  # the caller sent its next request early: it waits its turn
        return header

    async def _answer(self, op: Any, args: Any, writer: asyncio.StreamWriter, body: Body | None) -> None:
        handler = OPS.get(op) if isinstance(op, str) else None
        try:
            if handler is None:
                raise InvalidRequest(f"unknown operation {str(op)[:50]!r}", field="op", ops=sorted([*OPS, *TUNNEL_OPS]))
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
