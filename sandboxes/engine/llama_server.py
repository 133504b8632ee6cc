"""A dedicated endpoint's model server on a CPU host: llama.cpp (llama-cpp-python) behind OpenAI's chat API.

The engine runs it (``model_servers.py``) as a host process, as an
unprivileged user, one model each::

    python -m sandboxes.engine.llama_server --model M.gguf --name NAME --host H --port P

with ``FORKYARD_MODEL_SERVER_TOKEN`` in its environment: every request must
carry it (``Authorization: Bearer``); only the inference gateway has it.

It serves ``GET /health``, ``GET /v1/models`` and ``POST
/v1/chat/completions`` (non-streaming, and streaming as server-sent events
ending with a usage chunk when ``stream_options.include_usage`` is set).
Tokens come one at a time from llama.cpp's decoder (``Llama.generate``), so
usage counts are exact. ``response_format`` ``json_schema`` and
``json_object``, and a tool call the caller requires (``tool_choice``), are
decoded under a grammar made from the schema (llama.cpp's GBNF), so what the
model writes has the schema's structure by construction. One request decodes
at a time (one model, one context); others wait their turn.

Started as root by the engine (``--user nobody``), it loads its model and
everything it will import, then gives up root for that user (no groups) before
it listens: a prompt is never handled with privileges.

It never writes a prompt or an output anywhere: no access log, llama.cpp
quiet, errors logged by kind only. Its dependencies are an optional extra of
the server (``forkyard-server[llama]``); the engine itself does not import it.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import pwd
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jinja2.sandbox
import llama_cpp
import uvicorn
from llama_cpp import Llama
from llama_cpp.llama_grammar import LlamaGrammar, json_schema_to_gbnf

Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[Mapping[str, Any]], Awaitable[None]]
FALLBACK_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MAX_BODY = 16 * 1024 * 1024


class Refusal(Exception):
    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass
class Generation:
    """One request's decoding, as the decoder thread reports it."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "stop"
    text: list[str] = field(default_factory=list)


def _text_of(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")
    raise Refusal(400, "invalid_request", "a message's content is text or a list of text parts", "messages")


class Model:
    """The model, its chat template, and decoding one request at a time."""

    def __init__(self, path: str, name: str, context: int, threads: int) -> None:
        self.name = name
        self.llama = Llama(
            model_path=path,
            n_ctx=context,
            n_threads=threads or None,
            n_threads_batch=threads or None,
            verbose=False,
            seed=secrets.randbelow(2**31),
        )
        metadata = self.llama.metadata
        environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.template = environment.from_string(metadata.get("tokenizer.chat_template") or FALLBACK_TEMPLATE)
        self.eos = self.llama.token_eos()
        self.vocab = self.llama._model.vocab  # noqa: SLF001 - llama.cpp's vocabulary, for its end-of-generation check
        vocabulary = self.llama.tokenizer()
        self.bos_text = vocabulary.decode([self.llama.token_bos()]) if self.llama.token_bos() >= 0 else ""
        self.eos_text = vocabulary.decode([self.eos]) if self.eos >= 0 else ""
        self.lock = threading.Lock()
        self.created = int(time.time())

    def prompt(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> list[int]:
        plain = [
            {**message, "content": _text_of(message.get("content"))} for message in messages if isinstance(message, dict)
        ]
        text = self.template.render(
            messages=plain,
            tools=tools,
            add_generation_prompt=True,
            bos_token=self.bos_text,
            eos_token=self.eos_text,
            raise_exception=_raise,
        )
        return list(self.llama.tokenize(text.encode(), add_bos=not text.startswith(self.bos_text or "\0"), special=True))

    def decode(
        self, tokens: list[int], options: dict[str, Any], grammar: str | None, emit: Callable[[str], None]
    ) -> Generation:
        """Decode after ``tokens``, handing each piece of text to ``emit`` as it is made (in this thread)."""
        generation = Generation(prompt_tokens=len(tokens))
        limit = options["max_tokens"]
        stops: list[str] = options["stop"]
        characters = Characters()
        written = ""
        with self.lock:
            # A seed given is honoured; otherwise each request samples afresh (not the server's start seed again).
            seed = options.get("seed")
            self.llama.set_seed(int(seed) % 2**31 if seed is not None else secrets.randbelow(2**31))
            sampler = {
                "temp": options["temperature"],
                "top_p": options["top_p"],
                "frequency_penalty": options["frequency_penalty"],
                "presence_penalty": options["presence_penalty"],
                "grammar": LlamaGrammar.from_string(grammar, verbose=False) if grammar else None,
            }
            generation.finish_reason = "length"
            for token in self.llama.generate(tokens, **sampler):
                if token == self.eos or llama_cpp.llama_vocab_is_eog(self.vocab, token):  # any end-of-generation token
                    generation.finish_reason = "stop"
                    break
                generation.completion_tokens += 1
                piece = characters.feed(self.llama.detokenize([token], prev_tokens=None, special=False))
                if piece:
                    written += piece
                    hit = next((stop for stop in stops if stop in written), None)
                    if hit is not None:
                        cut = written.index(hit)
                        piece = piece[: max(0, len(piece) - (len(written) - cut))]
                        if piece:
                            generation.text.append(piece)
                            emit(piece)
                        generation.finish_reason = "stop"
                        break
                    generation.text.append(piece)
                    emit(piece)
                if generation.completion_tokens >= limit:
                    break
        return generation


# How many bytes a UTF-8 sequence has, by its first byte's high four bits, as llama.cpp's grammar reads it.
_SEQUENCE_LENGTH = (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)


class Characters:
    """A decoder's bytes as text, one character for each character llama.cpp's grammar counted.

    Byte tokens can spell sequences the grammar takes as one character each
    but that are not UTF-8 (an overlong form, an encoded surrogate, a lead
    byte above U+10FFFF): each becomes one U+FFFD, so an answer the grammar
    finished is still whole JSON within the schema's lengths. A sequence
    not yet complete waits for its other bytes."""

    def __init__(self) -> None:
        self.pending = b""

    def feed(self, data: bytes) -> str:
        self.pending += data
        text: list[str] = []
        while self.pending:
            size = _SEQUENCE_LENGTH[self.pending[0] >> 4]
            sequence = self.pending[:size]
            if any(byte >> 6 != 0b10 for byte in sequence[1:]):
                sequence = sequence[:1]  # a lead byte cut short: the bytes after it are read afresh
            elif len(sequence) < size:
                break
            self.pending = self.pending[len(sequence) :]
            text.append(sequence.decode(errors="replace")[:1])
        return "".join(text)


def _raise(message: str) -> None:
    raise Refusal(400, "invalid_request", f"the model's chat template refused the messages: {message}", "messages")


def _json_grammar(schema: dict[str, Any]) -> str:
    """llama.cpp's grammar for a JSON schema. The Python port's string characters let control characters
    through, which JSON forbids inside strings (llama.cpp's own converter excludes them): excluded here too."""
    grammar = str(json_schema_to_gbnf(json.dumps(schema)))
    return grammar.replace('char ::= [^"\\\\] |', 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |')


def _grammar_of(request: dict[str, Any]) -> tuple[str | None, str | None]:
    """(the GBNF grammar its output must follow, and the name of the tool it must call), from the request."""
    response_format = request.get("response_format") or {}
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema") or {}
        return _json_grammar(schema), None
    if kind == "json_object":
        return _json_grammar({"type": "object"}), None
    tools = [tool for tool in request.get("tools") or [] if isinstance(tool, dict) and tool.get("type") == "function"]
    choice = request.get("tool_choice")
    if tools and isinstance(choice, dict):
        wanted = (choice.get("function") or {}).get("name")
        tool = next((tool for tool in tools if tool["function"].get("name") == wanted), None)
        if tool is None:
            raise Refusal(400, "invalid_request", f"tool_choice names {wanted!r}, which is not in tools", "tool_choice")
        return _json_grammar(tool["function"].get("parameters") or {"type": "object"}), str(wanted)
    if tools and choice == "required":
        if len(tools) == 1:
            function = tools[0]["function"]
            return _json_grammar(function.get("parameters") or {"type": "object"}), str(function["name"])
        raise Refusal(400, "invalid_request", "tool_choice 'required' with several tools: name one", "tool_choice")
    return None, None


def _options(request: dict[str, Any], context: int, prompt_tokens: int) -> dict[str, Any]:
    if (request.get("n") or 1) != 1:
        raise Refusal(400, "invalid_request", "this server makes one choice per request (n: 1)", "n")
    room = context - prompt_tokens
    if room <= 0:
        raise Refusal(400, "context_length_exceeded", f"the messages take {prompt_tokens} tokens of {context}", "messages")
    wanted = request.get("max_completion_tokens") or request.get("max_tokens") or min(256, room)
    stop = request.get("stop") or []
    return {
        "max_tokens": max(1, min(int(wanted), room)),
        "temperature": float(request["temperature"]) if request.get("temperature") is not None else 0.8,
        "top_p": float(request["top_p"]) if request.get("top_p") is not None else 0.95,
        "frequency_penalty": float(request.get("frequency_penalty") or 0.0),
        "presence_penalty": float(request.get("presence_penalty") or 0.0),
        "seed": request.get("seed"),
        "stop": [stop] if isinstance(stop, str) else [str(item) for item in stop],
    }


class Server:
    """The HTTP side: an ASGI application, one model."""

    def __init__(self, model: Model, token: str) -> None:
        self.model = model
        self.token = token.encode()

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            if not self._authorized(scope):
                raise Refusal(401, "unauthorized", "a valid token is required")
            path, method = scope["path"].rstrip("/"), scope["method"]
            if path == "/health" and method == "GET":
                await _json(send, 200, {"status": "ok", "model": self.model.name})
            elif path == "/v1/models" and method == "GET":
                await _json(send, 200, self._models())
            elif path == "/v1/chat/completions" and method == "POST":
                await self._chat(json.loads(await _body(receive) or b"{}"), send)
            else:
                raise Refusal(404, "not_found", f"no route {method} {path}")
        except Refusal as refusal:
            await _json(send, refusal.status, refusal.body())
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            print(f"bad request: {type(error).__name__}", file=sys.stderr, flush=True)
            await _json(send, 400, Refusal(400, "invalid_request", "the request is not a chat completion").body())

    def _authorized(self, scope: dict[str, Any]) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, given = bytes(value).partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.token)
        return False

    def _models(self) -> dict[str, Any]:
        entry = {"id": self.model.name, "object": "model", "created": self.model.created, "owned_by": "forkyard"}
        return {"object": "list", "data": [entry]}

    async def _chat(self, request: dict[str, Any], send: Send) -> None:
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            raise Refusal(400, "invalid_request", "messages must be a non-empty list", "messages")
        grammar, tool_name = _grammar_of(request)
        tokens = self.model.prompt(messages, request.get("tools"))
        options = _options(request, self.model.llama.n_ctx(), len(tokens))
        completion_id = f"chatcmpl-{secrets.token_hex(12)}"
        created = int(time.time())
        if request.get("stream"):
            include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
            await self._stream(send, tokens, options, grammar, tool_name, completion_id, created, include_usage)
            return
        generation = await asyncio.to_thread(self.model.decode, tokens, options, grammar, lambda piece: None)
        text = "".join(generation.text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = generation.finish_reason
        if tool_name is not None:
            message = {"role": "assistant", "content": None, "tool_calls": [_tool_call(tool_name, text)]}
            finish = "tool_calls" if finish == "stop" else finish
        await _json(
            send,
            200,
            {
                "id": completion_id,
                "object": "chat.completion",
                "created": created,
                "model": self.model.name,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
                "usage": _usage(generation),
            },
        )

    async def _stream(
        self,
        send: Send,
        tokens: list[int],
        options: dict[str, Any],
        grammar: str | None,
        tool_name: str | None,
        completion_id: str,
        created: int,
        include_usage: bool,
    ) -> None:
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[str | None] = asyncio.Queue()

        def emit(piece: str) -> None:
            loop.call_soon_threadsafe(pieces.put_nowait, piece)

        def run() -> Generation:
            try:
                return self.model.decode(tokens, options, grammar, emit)
            finally:
                loop.call_soon_threadsafe(pieces.put_nowait, None)

        decoding = asyncio.ensure_future(asyncio.to_thread(run))
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model.name,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            }

        call_id = f"call_{secrets.token_hex(8)}"
        first: dict[str, Any] = {"role": "assistant", "content": "" if tool_name is None else None}
        if tool_name is not None:
            first["tool_calls"] = [
                {"index": 0, "id": call_id, "type": "function", "function": {"name": tool_name, "arguments": ""}}
            ]
        await _event(send, chunk(first))
        async for piece in _drain(pieces):
            if tool_name is None:
                delta: dict[str, Any] = {"content": piece}
            else:
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
            await _event(send, chunk(delta))
        generation = await decoding
        finish = generation.finish_reason
        if tool_name is not None and finish == "stop":
            finish = "tool_calls"
        await _event(send, chunk({}, finish))
        if include_usage:
            usage = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": self.model.name}
            await _event(send, {**usage, "choices": [], "usage": _usage(generation)})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _drain(pieces: asyncio.Queue[str | None]) -> AsyncIterator[str]:
    while True:
        piece = await pieces.get()
        if piece is None:
            return
        yield piece


def _tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{secrets.token_hex(8)}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _usage(generation: Generation) -> dict[str, int]:
    return {
        "prompt_tokens": generation.prompt_tokens,
        "completion_tokens": generation.completion_tokens,
        "total_tokens": generation.prompt_tokens + generation.completion_tokens,
    }


async def _body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Refusal(400, "invalid_request", "the client left")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            raise Refusal(413, "too_large", f"the body is over {MAX_BODY} bytes")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def _json(send: Send, status: int, body: dict[str, Any]) -> None:
    content = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": content})


async def _event(send: Send, data: dict[str, Any]) -> None:
    await send({"type": "http.response.body", "body": b"data: " + json.dumps(data).encode() + b"\n\n", "more_body": True})


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llama_server", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--user", default="", help="drop to this user once the model is loaded (started as root)")
    parser.add_argument("--server-id", default="", help="the engine's id for this server (it finds it again by it)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    arguments = _arguments(argv)
    token = os.environ.get("FORKYARD_MODEL_SERVER_TOKEN", "")
    if len(token) < 16:
        raise SystemExit("FORKYARD_MODEL_SERVER_TOKEN (16+ characters) is required")
    model = Model(arguments.model, arguments.name, arguments.context, arguments.threads)
    config = uvicorn.Config(
        Server(model, token),
        host=arguments.host,
        port=arguments.port,
        access_log=False,
        log_level="warning",
        lifespan="off",
        loop="asyncio",
        http="httptools",
    )
    config.load()  # imports what serving needs, while the interpreter's files can still be read
    config.get_loop_factory()
    server = uvicorn.Server(config)
    if arguments.user:
        drop_privileges(arguments.user)
    print(f"serving {arguments.name} on {arguments.host}:{arguments.port}", flush=True)
    server.run()


def drop_privileges(user: str) -> None:
    """Become ``user`` for good (no supplementary groups): what a prompt reaches runs unprivileged."""
    entry = pwd.getpwnam(user)
    os.setgroups([])
    os.setgid(entry.pw_gid)
    os.setuid(entry.pw_uid)
    if os.getuid() != entry.pw_uid or os.geteuid() != entry.pw_uid:
        raise SystemExit(f"could not become {user}")


if __name__ == "__main__":
    main()
