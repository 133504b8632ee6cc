"""The public API's data path: what a command or a small file request and its answer look like.

A trainer's loop is mostly ``POST /api/v1/sandboxes/{id}/exec`` and small
files. Two servers answer them: the control plane (its views and its hot
path, ``sandboxes.api``) and each host's own gateway (``gateway.py``, in the
engine's process, which the SDK uses once it holds a data token for the
sandbox). Both answer the same request with the same body and the same
refusal, because both take these shapes and checks from here; this module
needs no Django, since the engine runs without it.

What is here, in the order a request meets it:

* ``bad_text``: a JSON document's strings must be valid Unicode (a lone
  surrogate is refused at the edge, naming the field);
* ``Input`` and ``ExecIn``: a body with a field it does not name is an error,
  and so is ``true`` for a number; ``timeout`` and ``workdir`` are accepted
  for ``timeout_s`` and ``cwd``, never both spellings at once;
* ``invalid_body``: a validation failure as the API's 400 says it;
* ``exec_args``: the engine's exec for a request; ``exec_answer``: the
  API's answer (``ExecOut``) to the engine's result;
* ``public_refusal``: an engine's error as the API answers it, naming the
  sandbox by its public id, never by the engine's own id for it.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from .errors import EngineError, NoCapacity, Unavailable

MAX_COMMAND = 4096
MAX_ARGS = 4096  # argv items a command may have (the sandbox's init takes no more)
# Other names for an exec's fields that peers' SDKs use, accepted as documented aliases.
EXEC_ALIASES = {"timeout": "timeout_s", "workdir": "cwd"}


def bad_text(value: Any, where: str = "") -> str | None:
    """Where in a decoded JSON document a string is not valid Unicode ("" for the document itself); None if nowhere.

    JSON may spell a lone surrogate (``"\\ud800"``) that no UTF-8 text can
    hold: accepted, it broke every page that later showed it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    items: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if bad_text(key, where) is not None:
                return where  # the key itself: name the object that holds it
            items.append((str(key), item))
    elif isinstance(value, list):
        items = [(str(index), item) for index, item in enumerate(value)]
    for name, item in items:
        found = bad_text(item, f"{where}.{name}" if where else name)
        if found is not None:
            return found
    return None


def check_cmd(value: str | list[str]) -> str | list[str]:
    items = [value] if isinstance(value, str) else value
    if not items or not items[0].strip():
        raise ValueError("a non-empty command: a string for /bin/sh, or a list whose first item names a program")
    if len(items) > MAX_ARGS:
        raise ValueError(f"at most {MAX_ARGS} items")
    if any("\x00" in item for item in items):
        raise ValueError("no NUL characters")
    return value


def check_cwd(value: str | None) -> str | None:
    if value is not None and "\x00" in value:
        raise ValueError("no NUL characters")
    return value


def check_env(env: dict[str, str]) -> dict[str, str]:
    if len(env) > 256:
        raise ValueError("at most 256 variables")
    for key, value in env.items():
        if not key or "=" in key or "\0" in key or "\0" in value or len(key) > 255 or len(value) > 32768:
            raise ValueError(f"invalid variable {key[:64]!r}")
    return env


def _takes_a_number_not_a_bool(annotation: Any) -> bool:
    """Whether a field of this type takes an int or a float but not a bool (through unions and ``Annotated``)."""
    kinds: set[Any] = set()
    pending = [annotation]
    while pending:
        kind = pending.pop()
        arguments = get_args(kind)
        if arguments and get_origin(kind) is not Literal:
            pending.extend(arguments)
        else:
            kinds.add(kind)
    return bool(kinds & {int, float}) and not kinds & {bool, Any, object}


class Input(BaseModel):
    """A request body: a field it does not name is an error (``extra_forbidden``), never silently ignored;
    ``true`` or ``false`` for a number is an error too, never 1 or 0 (pydantic's lax mode would take it:
    a ``ttl_s`` of ``true`` was a sandbox gone in a second, a ``user`` of ``true`` uid 1)."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and _takes_a_number_not_a_bool(field.annotation):
                raise ValueError("a number, not true or false")
        return value


def refuse(model: str, field: str, message: str, value: Any) -> ValidationError:
    """A validation error about ``field``, from a check that sees the whole body (a model validator),
    so that the API's answer names the field, as it does for a check of the field itself."""
    error = PydanticCustomError("invalid_body", message)
    return ValidationError.from_exception_data(model, [InitErrorDetails(type=error, loc=(field,), input=value)])


def one_spelling(model: str, data: Any, aliases: dict[str, str]) -> None:
    """A field given under both its name and its alias is refused, not settled by a silent preference."""
    if not isinstance(data, dict):
        return
    for alias, name in aliases.items():
        if alias in data and name in data:
            raise refuse(model, alias, f"{alias} is another name for {name}: give one of them", data)


class CommandIn(Input):
    """A command's ``cmd``, ``cwd`` and ``env``, checked the same way wherever one is started (exec,
    background processes): the fields are each subclass's own."""

    @field_validator("env", check_fields=False)
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return check_env(value)

    @field_validator("cmd", check_fields=False)
    @classmethod
    def _cmd(cls, value: str | list[str]) -> str | list[str]:
        return check_cmd(value)

    @field_validator("cwd", check_fields=False)
    @classmethod
    def _cwd(cls, value: str | None) -> str | None:
        return check_cwd(value)


# A user of the sandbox's own /etc/passwd, by name or uid (exec and background processes).
SandboxUser = Annotated[str, Field(min_length=1, max_length=32)] | Annotated[int, Field(ge=0, le=65535)] | None


class ExecIn(CommandIn):
    cmd: str | list[str] = Field(..., description="a string runs under /bin/sh -c; a list is argv")
    idempotency_key: str | None = Field(
        None,
        max_length=255,
        description="a second exec with the same key runs nothing: it gets the first one's result "
        "(its output only while it still runs: output is never kept once delivered)",
    )
    cwd: str | None = Field(
        None, max_length=4096, validation_alias=AliasChoices("cwd", "workdir"), description="also accepted as `workdir`"
    )
    env: dict[str, str] = Field(default_factory=dict)
    stdin: str | None = Field(None, description="text given on standard input")
    stdin_b64: str | None = Field(None, description="bytes given on standard input, base64")
    timeout_s: float = Field(
        60,
        gt=0,
        le=24 * 3600,
        validation_alias=AliasChoices("timeout_s", "timeout"),
        description="seconds before it is killed (a result with `timed_out`); also accepted as `timeout`",
    )
    max_output_bytes: int = Field(1 << 20, ge=0, le=64 << 20)
    user: SandboxUser = Field(
        None,
        description="run as this user of the sandbox's own /etc/passwd: a name or a uid "
        "(a name it does not hold is `400 user_not_found`); if not given, its template's default user "
        "(root when the template names none)",
    )
    output: Literal["text", "base64"] = Field("text", description="text: UTF-8 (invalid bytes replaced); base64: exact bytes")

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        one_spelling(cls.__name__, data, EXEC_ALIASES)
        return data


class ExecOut(BaseModel):
    exit_code: int
    stdout: str
    stderr: str
    encoding: str
    duration_ms: float
    timed_out: bool
    signal: int | None
    oom_killed: bool
    stdout_truncated: bool
    stderr_truncated: bool
    replayed: bool = Field(False, description="the result of an earlier exec with the same idempotency_key: nothing ran again")


class FileWritten(BaseModel):
    path: str
    bytes: int


class FileReadQuery(Input):
    """``GET .../files``'s query, as the API's view takes it."""

    path: str


class FileWriteQuery(Input):
    """``PUT .../files``'s query, as the API's view takes it (``mode`` a decimal number: 420 is 0o644)."""

    path: str
    mode: int = Field(0o644, ge=0, le=0o7777)
    make_parents: bool = True


def exec_args(payload: ExecIn) -> dict[str, Any]:
    """The engine's exec for a request: the same fields, the idempotency key as the engine's ``key``."""
    args = payload.model_dump(exclude={"output", "idempotency_key"}, exclude_none=True)
    if payload.idempotency_key:
        args["key"] = payload.idempotency_key
    return args


def decode_output(data: bytes, encoding: str) -> str:
    return base64.b64encode(data).decode() if encoding == "base64" else data.decode("utf-8", "replace")


def exec_answer(result: dict[str, Any], payload: ExecIn) -> dict[str, Any]:
    """The API's answer (``ExecOut``) to an engine's exec result."""
    stdout = base64.b64decode(result.pop("stdout_b64", ""))
    stderr = base64.b64decode(result.pop("stderr_b64", ""))
    return {
        **{name: result.get(name) for name in ExecOut.model_fields if name in result},
        "stdout": decode_output(stdout, payload.output),
        "stderr": decode_output(stderr, payload.output),
        "encoding": payload.output,
    }


# --- refusals ---------------------------------------------------------------------------------

TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
SOURCES = ("body", "query", "path", "header", "cookie")


def _structural(part: object) -> bool:
    """Parts of a pydantic error location that are not the caller's field names:
    which member of a union was tried."""
    text = str(part)
    return text in TYPE_TAGS or "[" in text or text.startswith("function-")


def field_of(location: Sequence[object]) -> str | None:
    """``services.0.ready.http.path`` from ``("body", "payload", "services", 0, ...)``: where the
    value came from (body, query...) leads the location when the API's router validated it; a field
    may itself be named ``path``."""
    parts = [str(part) for part in location]
    if parts and parts[0] in SOURCES:
        source = parts.pop(0)
        if source == "body" and parts[:1] == ["payload"]:
            parts.pop(0)  # the name of the view's body argument
    return ".".join(part for part in parts if not _structural(part)) or None


@dataclasses.dataclass(frozen=True)
class Refusal:
    """An error as the public API answers it: ``{"error": {code, message, field, details}}`` and a status."""

    status: int
    code: str
    message: str
    field: str | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    retry_after_s: int | None = None

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.field is not None:
            error["field"] = self.field
        if self.details:
            error["details"] = self.details
        return {"error": error}


def invalid_body(errors: Sequence[Mapping[str, Any]], source: tuple[str, ...] = ()) -> Refusal:
    """A body (or query) that does not validate, as the API's 400 names it: the first error's field and
    message. The API's router gives each error's location with its source first (``("body", "payload",
    ...)``, ``("query", ...)``); a model checked on its own gives it as ``source``."""
    errors = [{**error, "loc": (*source, *error.get("loc", ()))} for error in errors]
    first = errors[0] if errors else {}
    where = field_of(list(first.get("loc", [])))
    message = first.get("msg", "invalid input")
    return Refusal(
        400,
        "invalid_request",
        f"{where}: {message}" if where else message,
        field=where,
        details={"errors": [{"field": field_of(list(e.get("loc", []))), "message": e.get("msg")} for e in errors[:20]]},
    )


def unknown_parameter(method: str, path: str, unknown: Sequence[str], known: Sequence[str]) -> Refusal:
    """``400 unknown_parameter``: a query parameter the operation does not take, named."""
    listed = ", ".join(sorted(known)) or "none"
    return Refusal(
        400,
        "unknown_parameter",
        f"{unknown[0]!r} is not a parameter of {method} {path}: it takes {listed}",
        field=unknown[0] or None,
        details={"unknown": list(unknown[:20]), "known": sorted(known)},
    )


PUBLIC_DETAILS = ("path", "size", "limit", "state", "type")


def public_refusal(error: EngineError, engine_id: str | None = None, public_id: str | None = None) -> Refusal:
    """What an engine's error means to a caller of the public API.

    Its message names the sandbox as the caller knows it (``public_id``), never
    by the engine's own id for it; only details that mean something to the
    caller are kept."""
    message = error.message
    if engine_id and public_id:
        message = message.replace(engine_id, public_id)
    if isinstance(error, Unavailable):
        return Refusal(503, "host_unavailable", "the sandbox's host is not answering; try again shortly", retry_after_s=5)
    if isinstance(error, NoCapacity):
        return Refusal(503, "no_capacity", message, retry_after_s=5)
    status = error.status if error.status in (400, 404, 409, 413, 429) else 500
    where = error.details.get("field") or (error.details.get("path") and "path")
    details = {key: value for key, value in error.details.items() if key in PUBLIC_DETAILS}
    return Refusal(status, error.code, message, field=where, details=details)


# The caller's side of a call, for both doors (the API's hot path and the host's gateway), ASGI-shaped.
Receive = Callable[[], Awaitable[Mapping[str, Any]]]


class CallerGone(Exception):
    """The caller left before its answer."""


async def until_disconnect(receive: Receive, work: Coroutine[Any, Any, Any]) -> Any:
    """``work``'s result; cancelled, and ``CallerGone`` raised, if the caller disconnects first (an exec's
    command ends with its caller)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001  # its end no longer matters to anyone
        pass
    raise CallerGone()
