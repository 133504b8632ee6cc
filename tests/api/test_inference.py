"""The inference gateway with the official ``openai`` client: a dedicated endpoint serving a tiny local model,
an upstream that is another forkyard server, structured outputs, tools, limits and failures.

The model is the tiny random one the test suite writes (``tests/support/tiny_model.py``): what it says is
noise, but every token is sampled by llama.cpp's decoder in a model server the engine runs on the host.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.support.grading import add_upstream, judge_schema, remove_upstream, set_inference

pytestmark = pytest.mark.root


def client_for(stack: Any, key: str, **options: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/api/v1/inference", api_key=key, max_retries=0, **options)


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "judgement", "strict": True, "schema": schema}}


def test_the_official_client_calls_a_dedicated_endpoint_streaming_and_not(stack, judge, team_b):
    client = client_for(stack, stack.teams[0].key)
    models = [model.id for model in client.models.list()]
    assert judge["name"] in models
    # Another team does not see team A's endpoint, and cannot call it.
    other = client_for(stack, team_b.key)
    assert judge["name"] not in [model.id for model in other.models.list()]
    with pytest.raises(openai.NotFoundError) as refused:
        other.chat.completions.create(model=judge["name"], messages=[{"role": "user", "content": "hi"}])
    assert refused.value.code == "model_not_found"

    answer = client.chat.completions.create(model=judge["name"], messages=[{"role": "user", "content": "Say something."}], max_tokens=12)
    assert answer.model == judge["name"] and answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage is not None and 0 < answer.usage.completion_tokens <= 12 and answer.usage.prompt_tokens > 5
    # max_completion_tokens (what newer judge libraries send) is the same limit.
    newer = client.chat.completions.create(
        model=judge["name"], messages=[{"role": "user", "content": "Again."}], max_completion_tokens=3, temperature=1.0
    )
    assert newer.usage is not None and newer.usage.completion_tokens <= 3

    chunks = list(
        client.chat.completions.create(
            model=judge["name"],
            messages=[{"role": "user", "content": "Stream it."}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices]
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage is not None, "the last chunk is the usage chunk"
    assert 0 < usage.usage.completion_tokens <= 8
    # A random model's tokens may be bytes of characters it never finishes: the text may be short, the
    # count of sampled tokens is exact; the stream ends with its finish reason.
    assert len(pieces) >= 2 and [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] in ("stop", "length")
    without = list(client.chat.completions.create(model=judge["name"], messages=[{"role": "user", "content": "x"}], max_tokens=4, stream=True))
    assert all(chunk.choices for chunk in without), "no usage chunk unless asked"


def test_a_strict_json_schema_answer_always_validates(stack, judge):
    client = client_for(stack, stack.teams[0].key)
    schema = judge_schema()
    validated = 0
    for round_number in range(12):
        stream = round_number % 3 == 0
        kwargs: dict[str, Any] = {"model": judge["name"], "messages": [{"role": "user", "content": f"Grade #{round_number}"}]}
        # Room to finish even a rare long answer: the grammar allows whitespace runs, and a character may take
        # four byte tokens or an escape's six; an answer cut by max_tokens is (rightly) no success.
        kwargs.update(max_tokens=256, response_format=strict(schema), temperature=1.5)
        if stream:
            text = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(**kwargs, stream=True) if chunk.choices)
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content or ""
        jsonschema.validate(json.loads(text), schema)  # never an invalid answer returned as a success
        validated += 1
    assert validated == 12


def test_a_forced_tool_call_has_arguments_of_its_schema(stack, judge):
    client = client_for(stack, stack.teams[0].key)
    parameters = {"type": "object", "properties": {"passed": {"type": "boolean"}}, "required": ["passed"], "additionalProperties": False}
    answer = client.chat.completions.create(
        model=judge["name"],
        messages=[{"role": "user", "content": "Did it pass?"}],
        max_tokens=40,
        tools=[{"type": "function", "function": {"name": "verdict", "parameters": parameters, "strict": True}}],
        tool_choice={"type": "function", "function": {"name": "verdict"}},
    )
    call = answer.choices[0].message.tool_calls[0]
    assert call.function.name == "verdict" and answer.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), parameters)
    # Streamed: the call comes as deltas (a name, then pieces of its arguments) that add up to the same.
    names, pieces, finished = [], [], []
    for chunk in client.chat.completions.create(
        model=judge["name"],
        messages=[{"role": "user", "content": "Did it pass?"}],
        max_tokens=40,
        tools=[{"type": "function", "function": {"name": "verdict", "parameters": parameters, "strict": True}}],
        tool_choice={"type": "function", "function": {"name": "verdict"}},
        stream=True,
    ):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                assert delta.index == 0 and delta.function is not None
                names.append(delta.function.name or "")
                pieces.append(delta.function.arguments or "")
            if choice.finish_reason:
                finished.append(choice.finish_reason)
    assert "".join(names) == "verdict" and finished == ["tool_calls"]
    jsonschema.validate(json.loads("".join(pieces)), parameters)


def test_unknown_fields_and_wrong_types_are_openai_shaped_400s(stack, judge):
    client = client_for(stack, stack.teams[0].key)
    with pytest.raises(openai.BadRequestError) as unknown:
        client.chat.completions.create(model=judge["name"], messages=[{"role": "user", "content": "x"}], extra_body={"temprature": 1})
    assert unknown.value.code == "invalid_request" and unknown.value.param == "temprature"
    assert unknown.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as wrong:
        client.chat.completions.create(model=judge["name"], messages=[{"role": "user", "content": "x"}], max_tokens=True)  # type: ignore[arg-type]
    assert wrong.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as schema:
        client.chat.completions.create(
            model=judge["name"], messages=[{"role": "user", "content": "x"}], response_format=strict({"type": "no-such-type"})
        )
    assert schema.value.code == "invalid_schema"
    with pytest.raises(openai.AuthenticationError):
        client_for(stack, "fy_000000000000_wrong").models.list()


def test_an_upstream_that_is_another_forkyard(stack, judge, team_b):
    """Team B has no endpoint; the operator's upstream is another forkyard server (a second web process,
    answering through its views) with team A's key, serving team A's endpoint under another name."""
    second = stack.start_view_only_web()
    name = f"remote-{uuid.uuid4().hex[:6]}"
    add_upstream(
        stack, name, f"{second}/api/v1/inference", stack.teams[0].key, [name], model_names={name: judge["name"]}, keeps_prompts=False
    )
    try:
        client = client_for(stack, team_b.key)
        deadline = time.monotonic() + 10  # the gateway remembers a team's routes for 2 s
        while name not in [model.id for model in client.models.list()]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        answer = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "via forkyard"}], max_tokens=6)
        assert answer.model == name, "the team sees its own name, not the upstream's"
        assert answer.usage is not None and 0 < answer.usage.completion_tokens <= 6
        chunks = list(
            client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "s"}], max_tokens=5, stream=True, stream_options={"include_usage": True}
            )
        )
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 5
        schema = judge_schema()
        text = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "g"}], max_tokens=64, response_format=strict(schema))
        jsonschema.validate(json.loads(text.choices[0].message.content or ""), schema)
    finally:
        remove_upstream(stack, name)


class FakeProvider:
    """A provider outside our control, on loopback: it fails as providers do (500, a hang, a dropped
    connection, a completion that ignores the schema), chosen by the first part of its base URL."""

    def __init__(self) -> None:
        import http.server
        import threading

        provider = self
        self.requests = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                provider.requests += 1
                asked = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                mode = self.path.split("/")[1]
                if mode == "hang":
                    time.sleep(5)
                    return
                if mode == "drop":
                    self.connection.close()
                    return
                if mode == "error500":
                    self._answer(500, {"error": {"message": "provider exploded"}})
                    return
                if mode == "cut" and asked.get("stream"):
                    self._stream("ok", cut=True)
                    return
                content = '{"score": "high"}' if mode == "garbage" else "ok"
                if asked.get("stream"):
                    self._stream(content)
                    return
                self._answer(
                    200,
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "created": 0,
                        "model": "m",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
                    },
                )

            def _stream(self, content: str, cut: bool = False) -> None:
                """A streamed answer; ``cut``: the first event, then the connection closed (no [DONE])."""
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m"}
                for event in (
                    {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": content}, "finish_reason": None}]},
                    {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                    {**chunk, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}},
                ):
                    self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                    if cut:
                        self.wfile.flush()
                        time.sleep(0.2)  # the first event on its way before the break
                        break
                else:
                    self.wfile.write(b"data: [DONE]\n\n")
                self.close_connection = True

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, mode: str) -> str:
        return f"http://127.0.0.1:{self.port}/{mode}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def provider():
    fake = FakeProvider()
    yield fake
    fake.close()


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_for_model(client: openai.OpenAI, name: str, present: bool = True) -> None:
    deadline = time.monotonic() + 10  # the gateway remembers a team's routes for 2 s
    while (name in [model.id for model in client.models.list()]) != present:
        assert time.monotonic() < deadline, f"{name} never {'appeared' if present else 'went'}"
        time.sleep(0.2)


def test_an_upstream_that_fails_or_hangs_is_a_clear_502_or_504(stack, provider):
    tag = uuid.uuid4().hex[:6]
    cases = {
        "error500": (502, "upstream_error"),
        "hang": (504, "upstream_timeout"),
        "drop": (502, "upstream_error"),
        "unreachable": (502, "upstream_unreachable"),
        "garbage": (502, "invalid_structured_output"),
    }
    names = []
    for mode in cases:
        name = f"fail-{mode}-{tag}"
        url = f"http://127.0.0.1:{_free_port()}/v1" if mode == "unreachable" else provider.url(mode)
        add_upstream(stack, name, url, "provider-secret", [name], timeout_s=1, keeps_prompts=False)
        names.append(name)
    try:
        client = client_for(stack, stack.teams[0].key)
        _wait_for_model(client, names[-1])
        for (mode, (status, code)), name in zip(cases.items(), names, strict=True):
            extra: dict[str, Any] = {"response_format": strict(judge_schema())} if mode == "garbage" else {}
            started = time.monotonic()
            with pytest.raises(openai.APIStatusError) as failed:
                client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}], **extra)
            assert (failed.value.status_code, failed.value.code) == (status, code), (mode, failed.value.body)
            assert time.monotonic() - started < 30, "a hung upstream is cut off at its timeout, not waited for"
            streamed = httpx.post(
                f"{stack.url}/api/v1/inference/chat/completions",
                headers={"Authorization": f"Bearer {stack.teams[0].key}"},
                json={"model": name, "messages": [{"role": "user", "content": "x"}], "stream": True, **extra},
                timeout=60,
            )
            assert (streamed.status_code, streamed.json()["error"]["code"]) == (status, code), (mode, streamed.text)
        assert "provider-secret" not in json.dumps(failed.value.body), "an upstream's secret is never shown"
    finally:
        for name in names:
            remove_upstream(stack, name)


def test_an_upstream_that_breaks_off_mid_stream_ends_the_stream_with_an_error(stack, provider):
    """What came before the break is passed on; then an error event (the official client raises it), never
    a stream that just stops and looks finished."""
    name = f"cut-{uuid.uuid4().hex[:6]}"
    add_upstream(stack, name, provider.url("cut"), "provider-secret", [name], timeout_s=5, keeps_prompts=False)
    try:
        client = client_for(stack, stack.teams[0].key)
        _wait_for_model(client, name)
        received: list[str] = []
        with pytest.raises(openai.APIError) as broken:
            for chunk in client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}], stream=True):
                received.extend(choice.delta.content or "" for choice in chunk.choices)
        assert "".join(received) == "ok"
        assert broken.value.code == "upstream_error" and "before [DONE]" in broken.value.message
        assert "provider-secret" not in json.dumps(broken.value.body)
    finally:
        remove_upstream(stack, name)


@contextlib.contextmanager
def _keeping_and_safe(stack: Any, provider: Any) -> Iterator[tuple[str, str]]:
    """Two upstreams of the same provider: one that keeps prompts, one that keeps nothing."""
    tag = uuid.uuid4().hex[:6]
    keeping, safe = f"keeps-{tag}", f"safe-{tag}"
    add_upstream(stack, keeping, provider.url("ok"), "s", [keeping], keeps_prompts=True)
    add_upstream(stack, safe, provider.url("ok"), "s", [safe], keeps_prompts=False)
    try:
        yield keeping, safe
    finally:
        remove_upstream(stack, keeping)
        remove_upstream(stack, safe)


def _routed_only_to_the_safe_one(client: openai.OpenAI, provider: Any, keeping: str, safe: str) -> None:
    """The client's caller requires zero retention: the keeping upstream is neither listed nor sent anything."""
    _wait_for_model(client, safe)
    assert keeping not in [model.id for model in client.models.list()]
    before = provider.requests
    with pytest.raises(openai.PermissionDeniedError) as refused:
        client.chat.completions.create(model=keeping, messages=[{"role": "user", "content": "secret"}])
    assert refused.value.code == "zero_retention_unavailable"
    assert provider.requests == before, "fail closed: nothing was sent to a provider that keeps prompts"
    assert client.chat.completions.create(model=safe, messages=[{"role": "user", "content": "fine"}]).choices[0].message.content == "ok"


def _reaches(client: openai.OpenAI, model: str) -> None:
    _wait_for_model(client, model)
    assert client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}]).choices[0].message.content == "ok"


def test_zero_retention_routes_only_to_providers_that_keep_nothing(stack, provider, team_b):
    with _keeping_and_safe(stack, provider) as (keeping, safe):
        set_inference(stack, team_b.team_id, zero_retention=True)
        try:
            _routed_only_to_the_safe_one(client_for(stack, team_b.key), provider, keeping, safe)
            _reaches(client_for(stack, stack.teams[0].key), keeping)  # a team that does not require it may use either
        finally:
            set_inference(stack, team_b.team_id, zero_retention=False)


def test_a_key_that_requires_zero_retention_fails_closed_while_its_teams_other_keys_do_not(stack, provider):
    """KeyInference: one key of a team that does not require zero retention requires it for itself."""
    team = stack.new_team("Key retention")
    with _keeping_and_safe(stack, provider) as (keeping, safe):
        strict_key = stack.shell(
            "from console.keys import api_key_create; from console.models import Team; from grading.models import KeyInference; "
            f"made = api_key_create(team=Team.objects.get(pk={team.team_id!r}), name='strict'); "
            "KeyInference.objects.create(key=made.key, zero_retention=True); print(made.secret)"
        ).strip().splitlines()[-1]
        _routed_only_to_the_safe_one(client_for(stack, strict_key), provider, keeping, safe)
        _reaches(client_for(stack, team.key), keeping)


def test_requests_and_tokens_over_the_teams_limits_are_429_with_retry_after(stack, provider):
    team = stack.new_team("Inference limits")
    name = f"limited-{uuid.uuid4().hex[:6]}"
    add_upstream(stack, name, provider.url("ok"), "s", [name], keeps_prompts=False)
    try:
        set_inference(stack, team.team_id, requests_per_minute=3, tokens_per_minute=1_000_000)
        client = client_for(stack, team.key)
        _wait_for_model(client, name)
        time.sleep(2.5)  # the new limits, past the gateway's memory of the team
        answered, refused = 0, None
        for _ in range(5):
            try:
                client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}])
                answered += 1
            except openai.RateLimitError as error:
                refused = error
                break
        assert refused is not None and answered <= 3, answered
        assert refused.code == "inference_rate_limited"
        assert 1 <= int(refused.response.headers["retry-after"]) <= 60
        # Tokens: each answer spends 5 (the provider's usage); over 6 a minute, the next is refused.
        tokens_team = stack.new_team("Token limits")
        set_inference(stack, tokens_team.team_id, requests_per_minute=1000, tokens_per_minute=6)
        tokens_client = client_for(stack, tokens_team.key)
        tokens_client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}])
        tokens_client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.RateLimitError) as over:
            tokens_client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}])
        assert over.value.code == "token_rate_limited" and int(over.value.response.headers["retry-after"]) >= 1
        # The tokens that were answered are metered, by model, into the team's usage.
        deadline = time.monotonic() + 10  # calls are recorded just after they answered, a fraction of a second later
        while True:
            usage = httpx.get(f"{stack.url}/api/v1/usage", headers={"Authorization": f"Bearer {tokens_team.key}"}).json()
            line = next((line for line in usage["tokens"] if line["model"] == name), {"input_tokens": 0, "output_tokens": 0})
            if line["input_tokens"] >= 6 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert (line["input_tokens"], line["output_tokens"]) == (6, 4) and float(line["amount"]) > 0
        assert float(usage["total"]) >= float(line["amount"])
    finally:
        remove_upstream(stack, name)


def test_a_call_that_could_pass_a_budget_is_refused_before_it_is_sent(stack, provider):
    """Budgets apply to inference: the most a call could cost (here its max_tokens at $0.10 an output token)
    against what the team's budget has spent; its metered tokens are what the budget and the statement count."""
    team = stack.new_team("Inference budget")
    name = f"priced-{uuid.uuid4().hex[:6]}"
    add_upstream(stack, name, provider.url("ok"), "s", [name], keeps_prompts=False)
    stack.shell(
        "from decimal import Decimal; from billing.models import Price; "
        f"Price.objects.create(kind='input_tokens', model={name!r}, amount=Decimal(0)); "
        f"Price.objects.create(kind='output_tokens', model={name!r}, amount=Decimal(100000))"
    )
    try:
        with stack.client(team) as api:
            made = api.post("/api/v1/budgets", json={"monthly_limit": "1.00", "over_limit": "pause"})
            assert made.status_code == 201, made.text
            client = client_for(stack, team.key)
            _wait_for_model(client, name)
            before = provider.requests
            with pytest.raises(openai.APIStatusError) as refused:
                client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}], max_tokens=20)
            assert (refused.value.status_code, refused.value.code) == (402, "team_budget_exceeded"), refused.value.body
            assert refused.value.body["details"]["cost"] == "2.00000000"  # 20 tokens at $0.10
            assert provider.requests == before, "refused before anything was sent upstream"
            # Up to $0.40 a call; the provider answers 2 output tokens ($0.20): calls go on until the next could pass.
            answered = 0
            for _ in range(10):
                try:
                    client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}], max_tokens=4)
                except openai.APIStatusError as error:
                    assert (error.status_code, error.code) == (402, "team_budget_exceeded"), error.body
                    break
                answered += 1
            else:
                pytest.fail("ten calls of up to $0.40 each never met a $1.00 budget")
            assert 1 <= answered <= 4 and provider.requests == before + answered
            spent = f"{answered * 0.2:.8f}"
            deadline = time.monotonic() + 10  # calls are recorded a fraction of a second after they answered
            while api.get(f"/api/v1/budgets/{made.json()['id']}").json()["spent"] != spent:
                assert time.monotonic() < deadline, api.get(f"/api/v1/budgets/{made.json()['id']}").text
                time.sleep(0.2)
            month = time.strftime("%Y-%m", time.gmtime())
            statement = api.get("/api/v1/usage", params={"month": month}).json()["statement"]
            [line] = [line for line in statement["lines"] if line["kind"] == "output_tokens" and line["item"] == name]
            assert (line["amount"], line["quantity"], line["count"]) == (spent, f"{answered * 2}.000000", answered)
            assert statement["total"] == spent and statement["budgets"][0]["spent"] == spent
    finally:
        remove_upstream(stack, name)
        stack.shell(f"from billing.models import Price; Price.objects.filter(model={name!r}).delete()")


def test_an_inference_only_key_calls_the_gateway_and_nothing_else(stack, provider):
    """The fast path is checked by the same table as every operation: a key scoped to inference calls the
    gateway (both transports of an answer) and grades, and is refused the rest, a grade's sandbox material too."""
    name = f"scoped-{uuid.uuid4().hex[:6]}"
    add_upstream(stack, name, provider.url("ok"), "s", [name], keeps_prompts=False)
    with stack.client() as api:
        made = api.post("/api/v1/keys", json={"name": f"judge-{name}", "role": "member", "scopes": ["inference"]})
        assert made.status_code == 201, made.text
    try:
        client = client_for(stack, made.json()["secret"])
        _wait_for_model(client, name)
        assert client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}]).choices[0].message.content == "ok"
        streamed = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}], stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == "ok"
        grade = {
            "model": name,
            "rubric": [{"role": "user", "content": "Grade {answer}"}],
            "schema": {"type": "object", "properties": {"score": {"type": "number"}}, "required": ["score"]},
            "items": [{"values": {"answer": "four"}}],
        }
        with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {made.json()['secret']}"}, timeout=120) as key:
            graded = key.post("/api/v1/grades", json=grade)
            assert graded.status_code == 200, graded.text
            assert graded.json()["results"][0]["error"]["code"] == "invalid_structured_output", "judged, not refused"
            from_a_sandbox = {**grade, "items": [{"values": {"answer": {"sandbox": "sb_0000000000000000", "file": "/etc/hostname"}}}]}
            for method, path, body in (
                ("POST", "/api/v1/grades", from_a_sandbox),
                ("GET", "/api/v1/sandboxes", None),
                ("POST", "/api/v1/sandboxes/sb_0000000000000000/exec", {"cmd": "true"}),
                ("POST", "/api/v1/sandboxes/sb_0000000000000000/grade", {"cmd": "true", "timeout_s": 5}),
                ("GET", "/api/v1/endpoints", None),
                ("POST", "/api/v1/endpoints", {"model": "tiny-random"}),
                ("GET", "/api/v1/usage", None),
            ):
                answer = key.request(method, path, json=body)
                assert (answer.status_code, answer.json()["error"]["code"]) == (403, "out_of_scope"), (method, path, answer.text)
    finally:
        remove_upstream(stack, name)
        with stack.client() as api:
            api.delete(f"/api/v1/keys/{made.json()['id']}", params={"delete": "true"})
