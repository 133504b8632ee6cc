"""Clients of the engine's API: the control plane's tasks, the tests, the CLI.

:class:`EngineClient` is blocking (one connection, one call at a time: give
each thread its own); :class:`AsyncEngineClient` is its asyncio twin.  Both
raise the engine's own error classes (:mod:`.errors`).

An address is the engine's Unix socket path, or ``tcp://host:port`` for an
engine on another machine (it listens there with ``FORKYARD_ENGINE_LISTEN``);
over TCP the client first presents the token (``token=``, or
``FORKYARD_ENGINE_TOKEN``).
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import os
import socket
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import Unavailable, from_dict
from .protocol import CHUNK, DATA, END, JSON, STREAM_OF_TAG, decode_json, encode, encode_json, read_frame, read_frame_sync

DEFAULT_SOCKET = Path(os.environ.get("FORKYARD_ENGINE_SOCKET", "/run/forkyard/engine.sock"))


def tcp_address(address: str) -> tuple[str, int] | None:
    """(host, port) of a ``tcp://host:port`` address; None for a socket path."""
    if not address.startswith("tcp://"):
        return None
    host, _, port = address[len("tcp://") :].rpartition(":")
    if not host or not port.isdigit():
        raise Unavailable(f"engine address {address!r} is not tcp://host:port", address=address)
    return host.strip("[]"), int(port)


def _hello(token: str | None) -> bytes:
    return encode_json({"op": "hello", "args": {"token": token or os.environ.get("FORKYARD_ENGINE_TOKEN", "")}})


def _check_hello(kind: bytes, payload: bytes, address: str) -> None:
    answer = decode_json(payload) if kind == JSON else {}
    if not answer.get("ok"):
        raise Unavailable(f"the engine at {address} refused the connection: {(answer.get('error') or {}).get('message')}")


@dataclass
class ExecOutput:
    exit_code: int
    stdout: bytes
    stderr: bytes
    duration_ms: float
    timed_out: bool
    signal: int | None = None
    oom_killed: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_result(cls, result: dict[str, Any], stdout: bytes | None = None, stderr: bytes | None = None) -> ExecOutput:
        return cls(
            exit_code=result["exit_code"],
            stdout=stdout if stdout is not None else base64.b64decode(result.get("stdout_b64", "")),
            stderr=stderr if stderr is not None else base64.b64decode(result.get("stderr_b64", "")),
            duration_ms=result["duration_ms"],
            timed_out=result["timed_out"],
            signal=result.get("signal"),
            oom_killed=result.get("oom_killed", False),
            stdout_truncated=result.get("stdout_truncated", False),
            stderr_truncated=result.get("stderr_truncated", False),
            extra={key: value for key, value in result.items() if key not in ("stdout_b64", "stderr_b64")},
        )


_NOT_YET = object()


class _OutputFrames:
    """A plain exec's output, as the engine sends it: data frames before the
    answer (protocol.OUTPUT_TAGS), put back together here."""

    def __init__(self) -> None:
        self.parts: dict[str, list[bytes]] = {"stdout": [], "stderr": []}

    def add(self, payload: bytes) -> None:
        stream = STREAM_OF_TAG.get(payload[0]) if payload else None
        if stream is not None:
            self.parts[stream].append(payload[1:])

    def output(self, stream: str) -> bytes:
        return b"".join(self.parts[stream])

    def into(self, result: Any) -> Any:
        """The answer as ``call("exec")`` always gave it: with ``stdout_b64`` and ``stderr_b64``."""
        if isinstance(result, dict) and "stdout_b64" not in result:
            result["stdout_b64"] = base64.b64encode(self.output("stdout")).decode()
            result["stderr_b64"] = base64.b64encode(self.output("stderr")).decode()
        return result


def _plain_exec(op: str, args: dict[str, Any]) -> bool:
    return op == "exec" and not args.get("stream")


def _interpret(kind: bytes, payload: bytes, on_event: Callable[[dict[str, Any]], None] | None) -> Any:
    """One reply frame: an event (passed on), the final answer, or an error raised."""
    if kind != JSON:
        return _NOT_YET
    message = decode_json(payload)
    if "event" in message:
        if on_event is not None:
            on_event(message)
        return _NOT_YET
    if not message.get("ok"):
        raise from_dict(message.get("error") or {})
    return message.get("result")


def _is_stream(result: Any) -> bool:
    return isinstance(result, dict) and bool(result.get("stream"))


def _chunks_of(data: bytes | Iterable[bytes]) -> Iterator[bytes]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data)
        for offset in range(0, len(view), CHUNK):
            yield bytes(view[offset : offset + CHUNK])
    else:
        yield from data


class EngineClient:
    def __init__(self, socket_path: str | Path | None = None, timeout_s: float | None = None, token: str | None = None) -> None:
        self.socket_path = str(socket_path or DEFAULT_SOCKET)
        self.timeout_s = timeout_s
        self.token = token
        self._connection: socket.socket | None = None
        self._mid_stream = False

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _socket(self) -> socket.socket:
        if self._mid_stream:
            # The last stream was not read to its end: its frames are still
            # coming on this connection, so start afresh.
            self.close()
            self._mid_stream = False
        if self._connection is None:
            tcp = tcp_address(self.socket_path)
            family = socket.AF_UNIX if tcp is None else socket.AF_INET6 if ":" in tcp[0] else socket.AF_INET
            connection = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            connection.settimeout(self.timeout_s)
            try:
                connection.connect(self.socket_path if tcp is None else tcp)
                if tcp is not None:
                    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    connection.sendall(_hello(self.token))
                    _check_hello(*read_frame_sync(connection), self.socket_path)
            except OSError as error:
                connection.close()
                raise Unavailable(
                    f"cannot reach the engine at {self.socket_path}: {error.strerror or error}", socket=self.socket_path
                ) from error
            except Unavailable:
                connection.close()
                raise
            self._connection = connection
        return self._connection

    def _send(self, op: str, args: dict[str, Any], body: bytes | Iterable[bytes] | None) -> socket.socket:
        connection = self._socket()
        try:
            connection.sendall(encode_json({"op": op, "args": args}))
            if body is not None:
                for chunk in _chunks_of(body):
                    connection.sendall(encode(DATA, chunk))
                connection.sendall(encode(END))
        except OSError as error:
            self.close()
            raise Unavailable(f"lost the engine connection: {error}") from error
        return connection

    def _frames(self, connection: socket.socket) -> Iterator[tuple[bytes, bytes]]:
        try:
            while True:
                yield read_frame_sync(connection)
        except (OSError, ConnectionError) as error:
            self.close()
            raise Unavailable(f"lost the engine connection: {error}") from error

    def stream(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        body: bytes | Iterable[bytes] | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        on_data: Callable[[bytes], None] | None = None,
    ) -> tuple[dict[str, Any], Iterator[bytes] | None]:
        """Send a request; return the result and, for streams, its chunks.
        ``on_data`` takes the data frames that come before the result (a
        plain exec's output)."""
        connection = self._send(op, args or {}, body)
        frames = self._frames(connection)
        for kind, payload in frames:
            if kind == DATA and on_data is not None:
                on_data(payload)
                continue
            result = _interpret(kind, payload, on_event)
            if result is _NOT_YET:
                continue
            if _is_stream(result):
                self._mid_stream = True
                return result, self._stream_chunks(frames)
            return result, None
        raise Unavailable("the engine closed the connection")

    def _stream_chunks(self, frames: Iterator[tuple[bytes, bytes]]) -> Iterator[bytes]:
        yield from self._stream_body(frames)
        self._mid_stream = False

    def _stream_body(self, frames: Iterator[tuple[bytes, bytes]]) -> Iterator[bytes]:
        for kind, payload in frames:
            if kind == DATA:
                yield payload
            elif kind == END:
                break
        for kind, payload in frames:
            if kind == JSON:
                trailer = decode_json(payload)
                if not trailer.get("ok"):
                    raise from_dict(trailer.get("error") or {})
                return

    def call(self, op: str, body: bytes | Iterable[bytes] | None = None, **args: Any) -> Any:
        if _plain_exec(op, args):
            output = _OutputFrames()
            result, _ = self.stream(op, args, body, on_data=output.add)
            return output.into(result)
        result, chunks = self.stream(op, args, body)
        if chunks is not None:
            return b"".join(chunks)
        return result

    # --- conveniences ---------------------------------------------------------------

    def ping(self) -> dict[str, Any]:
        return dict(self.call("ping"))

    def info(self) -> dict[str, Any]:
        return dict(self.call("info"))

    def create(self, **args: Any) -> dict[str, Any]:
        return dict(self.call("create", **args))

    def get(self, sandbox_id: str) -> dict[str, Any]:
        return dict(self.call("get", id=sandbox_id))

    def list(self, state: str | None = None, label: str | None = None) -> list[dict[str, Any]]:
        return list(self.call("list", state=state, label=label)["sandboxes"])

    def destroy(self, sandbox_id: str) -> dict[str, Any]:
        return dict(self.call("destroy", id=sandbox_id))

    def destroy_many(self, sandbox_ids: builtins.list[str]) -> builtins.list[dict[str, Any]]:
        """For each id, in order, its record once destroyed, or ``{"id", "error"}``."""
        return list(self.call("destroy_many", ids=sandbox_ids)["sandboxes"])

    def exec(self, sandbox_id: str, cmd: str | builtins.list[str], **options: Any) -> ExecOutput:
        if isinstance(options.get("stdin"), bytes):
            options["stdin_b64"] = base64.b64encode(options.pop("stdin")).decode()
        output = _OutputFrames()
        result, _ = self.stream("exec", {"id": sandbox_id, "cmd": cmd, **options}, on_data=output.add)
        if "stdout_b64" in result:  # an engine from before output came as frames
            return ExecOutput.from_result(result)
        return ExecOutput.from_result(result, output.output("stdout"), output.output("stderr"))

    def exec_stream(
        self, sandbox_id: str, cmd: str | builtins.list[str], on_output: Callable[[str, bytes], None], **options: Any
    ) -> ExecOutput:
        chunks: dict[str, list[bytes]] = {"stdout": [], "stderr": []}

        def event(message: dict[str, Any]) -> None:
            data = base64.b64decode(message["data_b64"])
            chunks[message["stream"]].append(data)
            on_output(message["stream"], data)

        result, _ = self.stream("exec", {"id": sandbox_id, "cmd": cmd, "stream": True, **options}, on_event=event)
        return ExecOutput.from_result(result, b"".join(chunks["stdout"]), b"".join(chunks["stderr"]))

    def read_file(self, sandbox_id: str, path: str) -> bytes:
        return bytes(self.call("files.read", id=sandbox_id, path=path))

    def write_file(
        self, sandbox_id: str, path: str, data: bytes | Iterable[bytes], mode: int = 0o644, make_parents: bool = False
    ) -> dict[str, Any]:
        return dict(self.call("files.write", body=data, id=sandbox_id, path=path, mode=mode, make_parents=make_parents))

    def list_files(self, sandbox_id: str, path: str = "/") -> dict[str, Any]:
        return dict(self.call("files.list", id=sandbox_id, path=path))

    def download(self, sandbox_id: str, path: str = "/") -> Iterator[bytes]:
        _, chunks = self.stream("files.download", {"id": sandbox_id, "path": path})
        assert chunks is not None
        return chunks

    def upload(self, sandbox_id: str, path: str, tar_stream: bytes | Iterable[bytes]) -> dict[str, Any]:
        return dict(self.call("files.upload", body=tar_stream, id=sandbox_id, path=path))

    def import_template(
        self,
        name: str,
        source: str,
        kind: str = "auto",
        replace: bool = False,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
        user: str | None = None,
    ) -> dict[str, Any]:
        args: dict[str, Any] = {"name": name, "source": source, "kind": kind, "replace": replace}
        if user is not None:
            args["user"] = user
        result, _ = self.stream("templates.import", args, on_event=on_progress)
        return dict(result)


class AsyncEngineClient:
    """One connection; concurrent callers take turns (open several for parallelism)."""

    def __init__(self, socket_path: str | Path | None = None, token: str | None = None) -> None:
        self.socket_path = str(socket_path or DEFAULT_SOCKET)
        self.token = token
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._streams is None:
            tcp = tcp_address(self.socket_path)
            try:
                if tcp is None:
                    streams = await asyncio.open_unix_connection(self.socket_path, limit=1 << 25)
                else:
                    streams = await asyncio.open_connection(*tcp, limit=1 << 25)
                    sock = streams[1].get_extra_info("socket")
                    if sock is not None:
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    streams[1].write(_hello(self.token))
                    await streams[1].drain()
                    try:
                        _check_hello(*await read_frame(streams[0]), self.socket_path)
                    except BaseException:
                        streams[1].close()
                        raise
            except (OSError, asyncio.IncompleteReadError) as error:
                raise Unavailable(
                    f"cannot reach the engine at {self.socket_path}: {getattr(error, 'strerror', None) or error}"
                ) from error
            self._streams = streams
        return self._streams

    async def call(
        self, op: str, body: bytes | None = None, on_event: Callable[[dict[str, Any]], None] | None = None, **args: Any
    ) -> Any:
        output = _OutputFrames() if _plain_exec(op, args) else None
        async with self._lock:
            reader, writer = await self._connect()
            try:
                writer.write(encode_json({"op": op, "args": args}))
                if body is not None:
                    for chunk in _chunks_of(body):
                        writer.write(encode(DATA, chunk))
                    writer.write(encode(END))
                await writer.drain()
                while True:
                    kind, payload = await read_frame(reader)
                    if kind == DATA and output is not None:
                        output.add(payload)
                        continue
                    result = _interpret(kind, payload, on_event)
                    if result is _NOT_YET:
                        continue
                    if _is_stream(result):
                        return await self._collect(reader)
                    return output.into(result) if output is not None else result
            except (OSError, asyncio.IncompleteReadError) as error:
                await self.close()
                raise Unavailable(f"lost the engine connection: {error}") from error

    async def _collect(self, reader: asyncio.StreamReader) -> bytes:
        parts = []
        async for chunk in self._chunks(reader):
            parts.append(chunk)
        return b"".join(parts)

    async def _chunks(self, reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
        while True:
            kind, payload = await read_frame(reader)
            if kind == DATA:
                yield payload
            elif kind == END:
                break
        kind, payload = await read_frame(reader)
        trailer = decode_json(payload)
        if not trailer.get("ok"):
            raise from_dict(trailer.get("error") or {})

    async def create(self, **args: Any) -> dict[str, Any]:
        return dict(await self.call("create", **args))

    async def destroy(self, sandbox_id: str) -> dict[str, Any]:
        return dict(await self.call("destroy", id=sandbox_id))

    async def destroy_many(self, sandbox_ids: builtins.list[str]) -> builtins.list[dict[str, Any]]:
        return list((await self.call("destroy_many", ids=sandbox_ids))["sandboxes"])

    async def exec(self, sandbox_id: str, cmd: str | builtins.list[str], **options: Any) -> ExecOutput:
        if isinstance(options.get("stdin"), bytes):
            options["stdin_b64"] = base64.b64encode(options.pop("stdin")).decode()
        return ExecOutput.from_result(await self.call("exec", id=sandbox_id, cmd=cmd, **options))

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return bytes(await self.call("files.read", id=sandbox_id, path=path))

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> dict[str, Any]:
        return dict(await self.call("files.write", body=data, id=sandbox_id, path=path, mode=mode))
