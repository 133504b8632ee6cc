"""Request and response shapes of grading's API: OpenAI's chat completions, endpoints, grades, rewards.

Every request schema is strict: a field it does not name is refused, and so
is a value of another type (``true`` for a number, ``"1"`` for a float): the
OpenAI client sends JSON of the right types, and a judge library's misspelt
option must be an error, not ignored. The gateway and the views validate raw
JSON with these (``model_validate_json``), so the OpenAPI document says
exactly what is accepted.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from ninja import Schema
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sandboxes.engine.data_path import MAX_ARGS, MAX_COMMAND, refuse

NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,99}$"
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"
PLACEHOLDER_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
MAX_ITEMS = 1000
MAX_TEXT = 4 * 1024 * 1024


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


# --- OpenAI's chat completions ------------------------------------------------------------


class TextPart(Strict):
    type: Literal["text"]
    text: str = Field(..., max_length=MAX_TEXT)


class ImageUrl(Strict):
    url: str = Field(..., max_length=MAX_TEXT)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(Strict):
    name: str = Field(..., max_length=64)
    arguments: str = Field(..., max_length=MAX_TEXT)


class ToolCall(Strict):
    id: str = Field(..., max_length=200)
    type: Literal["function"]
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = Field(None, max_length=MAX_TEXT)
    name: str | None = Field(None, max_length=64)
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)
    tool_call_id: str | None = Field(None, max_length=200)
    refusal: str | None = Field(None, max_length=MAX_TEXT)


class FunctionDefinition(Strict):
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=4096)
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of its arguments")
    strict: bool | None = Field(None, description="its arguments must validate against parameters (checked, never assumed)")


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str = Field(..., pattern=FUNCTION_NAME)


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(Strict):
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=4096)
    json_schema: dict[str, Any] = Field(..., alias="schema", description="the JSON schema every answer must validate against")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise refuse("ResponseFormat", "json_schema", "json_schema is given with type json_schema, and only then", None)
        return self


class StreamOptions(Strict):
    include_usage: bool | None = None


class ChatCompletionRequest(Strict):
    """OpenAI's chat completion request, as the official client sends it."""

    model: str = Field(..., min_length=1, max_length=200)
    messages: list[Message] = Field(..., min_length=1, max_length=4096)
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000, description="the newer name of max_tokens")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1, le=16)
    stop: str | list[str] | None = Field(None, max_length=4)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    logit_bias: dict[str, int] | None = None
    user: str | None = Field(None, max_length=256)
    metadata: dict[str, str] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    store: bool | None = Field(None, description="refused when true: content is kept only under the team's retention")


class CompletionMessage(Schema):
    role: str
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    refusal: str | None = None


class Choice(Schema):
    index: int
    message: CompletionMessage
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class CompletionUsage(Schema):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(Schema):
    id: str
    object: str
    created: int
    model: str
    choices: list[Choice]
    usage: CompletionUsage | None = None


class ModelEntry(Schema):
    id: str
    object: str
    created: int
    owned_by: str


class ModelList(Schema):
    object: str
    data: list[ModelEntry]


# --- dedicated endpoints --------------------------------------------------------------------


class EndpointCreate(Strict):
    model: str = Field(..., min_length=1, max_length=100, description="an open model the operator offers (GET /endpoints/models)")
    name: str | None = Field(None, pattern=NAME, description="the model id its calls name (default: the model's)")


class EndpointError(Schema):
    code: str
    message: str


class EndpointOut(Schema):
    id: str
    name: str = Field(..., description="the model id to call it by, through /api/v1/inference")
    model: str
    server: str
    state: str
    host: str | None
    restarts: int
    error: EndpointError | None
    created_at: datetime
    started_at: datetime | None
    ready_at: datetime | None
    ended_at: datetime | None


class EndpointList(Schema):
    endpoints: list[EndpointOut]
    next_cursor: str | None


class ServedModelOut(Schema):
    name: str
    server: str
    context_length: int
    description: str


class ServedModelList(Schema):
    models: list[ServedModelOut]


# --- grades ------------------------------------------------------------------------------


class FileMaterial(Strict):
    """A file of one of the team's sandboxes, read by the server."""

    sandbox: str = Field(..., max_length=64)
    file: str = Field(..., min_length=1, max_length=4096)
    max_bytes: int = Field(256 * 1024, ge=1, le=4 * 1024 * 1024)


class CommandMaterial(Strict):
    """A command's output in one of the team's sandboxes, run by the server."""

    sandbox: str = Field(..., max_length=64)
    command: str | list[str] = Field(..., description="a string for /bin/sh, or an argv list")
    output: Literal["stdout", "stderr", "both"] = "stdout"
    timeout_s: float = Field(60, gt=0, le=3600)

    @model_validator(mode="after")
    def _a_command(self) -> CommandMaterial:
        items = [self.command] if isinstance(self.command, str) else self.command
        if not items or not items[0].strip() or len(items) > MAX_ARGS or any("\x00" in item for item in items):
            raise refuse("CommandMaterial", "command", "a non-empty command without NUL characters", None)
        if sum(len(item) for item in items) > MAX_COMMAND * 16:
            raise refuse("CommandMaterial", "command", "the command is too long", None)
        return self


Material = Annotated[str, Field(max_length=MAX_TEXT)] | FileMaterial | CommandMaterial


class GradeItem(Strict):
    id: str | None = Field(None, max_length=200, description="the caller's own name for it, given back")
    values: dict[str, Material] = Field(
        default_factory=dict, description="what each {placeholder} of the rubric becomes: text, a sandbox's file or a command's output"
    )

    @model_validator(mode="after")
    def _names(self) -> GradeItem:
        for name in self.values:
            if not PLACEHOLDER_NAME.match(name):
                raise refuse("GradeItem", "values", f"{name[:80]!r} is not a placeholder name (letters, digits, _)", None)
        return self


class RubricMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str = Field(..., max_length=MAX_TEXT, description="text with {placeholders}; {{ and }} are braces")


class GradeCreate(Strict):
    model: str = Field(..., min_length=1, max_length=200)
    rubric: list[RubricMessage] = Field(..., min_length=1, max_length=64)
    answer_schema: dict[str, Any] = Field(..., alias="schema", description="the JSON schema of the judge's answer")
    score_field: str = Field("score", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,99}$", description="the schema's number that is the score")
    items: list[GradeItem] = Field(..., min_length=1, max_length=MAX_ITEMS)
    max_tokens: int | None = Field(None, ge=1, le=100_000)
    temperature: float | None = Field(None, ge=0, le=2)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    concurrency: int = Field(32, ge=1, le=256, description="items in flight at once")


class GradeUsage(Schema):
    input_tokens: int
    output_tokens: int


class ItemError(Schema):
    code: str
    message: str


class GradedItem(Schema):
    index: int
    id: str | None
    score: float | None
    fields: dict[str, Any] | None = Field(None, description="the judge's whole answer (its schema's fields)")
    usage: GradeUsage
    latency_ms: float
    error: ItemError | None


class GradeOut(Schema):
    id: str
    model: str
    score_field: str
    items: int
    succeeded: int
    failed: int
    mean_score: float | None
    usage: GradeUsage
    latency_ms: float
    retained: bool = Field(..., description="its content is kept (the team's retention): GET returns its items")
    created_at: datetime


class GradeResult(GradeOut):
    results: list[GradedItem]


class GradeDetail(GradeOut):
    results: list[dict[str, Any]] | None = Field(None, description="each item's messages, answer and score: only under retention")


class GradeList(Schema):
    grades: list[GradeOut]
    next_cursor: str | None


# --- test-based rewards --------------------------------------------------------------------


class SandboxGradeIn(Strict):
    cmd: str | list[str] = Field(..., description="the check: a string for /bin/sh, or an argv list")
    reward_file: str | None = Field(
        None, min_length=1, max_length=4096, description='where the check writes {"reward": <number>, ...}; without it the exit code'
    )
    timeout_s: float = Field(600, gt=0, le=24 * 3600)

    @model_validator(mode="after")
    def _a_command(self) -> SandboxGradeIn:
        items = [self.cmd] if isinstance(self.cmd, str) else self.cmd
        if not items or not items[0].strip() or len(items) > MAX_ARGS or any("\x00" in item for item in items):
            raise refuse("SandboxGradeIn", "cmd", "a non-empty command without NUL characters", None)
        if self.reward_file is not None and "\x00" in self.reward_file:
            raise refuse("SandboxGradeIn", "reward_file", "no NUL characters", None)
        return self


class RewardOut(Schema):
    reward: float
    source: Literal["file", "exit_code"]
    exit_code: int
    duration_ms: float
    details: dict[str, Any] = Field(..., description="the reward file's other fields, as they are")
    stdout: str
    stderr: str
