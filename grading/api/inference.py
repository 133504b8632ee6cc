"""The OpenAI-compatible gateway's operations, as the OpenAPI document lists them.

``POST /inference/chat/completions`` and ``GET /inference/models``, with the
team's API key: the official ``openai`` client works with ``base_url`` set
to ``<forkyard>/api/v1/inference``. Requests are answered by the fast path
(``fast.py``) unless it is off (``FORKYARD_HOT_PATH=0``); these views then
answer them with the same replies (``replies.py``).
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from ninja import Router

from console.api_base import BUDGETED, ERRORS, UPSTREAM_ERRORS, key_of

from ..gateway import RETENTION_HEADER
from ..schemas import ChatCompletion, ChatCompletionRequest, ModelList
from . import replies
from .fast import caller_of

router = Router(tags=["inference"])


def _response(reply: replies.Reply) -> HttpResponse | StreamingHttpResponse:
    response: HttpResponse | StreamingHttpResponse
    if reply.events is None:
        response = JsonResponse(reply.body, status=reply.status)
    else:
        stream = reply.events

        async def events() -> Any:
            async for event in stream:
                yield event
            await replies.record(reply)

        response = StreamingHttpResponse(events(), status=reply.status, content_type="text/event-stream")
    for name, value in reply.headers.items():
        response[name] = value
    return response


@router.post(
    "/inference/chat/completions",
    response={200: ChatCompletion, **BUDGETED, **UPSTREAM_ERRORS},
    summary="A chat completion (OpenAI-compatible; stream: server-sent events)",
)
async def chat_completions(request: HttpRequest, payload: ChatCompletionRequest) -> HttpResponse | StreamingHttpResponse:
    """The model is one of `GET /inference/models`: a dedicated endpoint of the team's, or an operator's
    upstream. `response_format` `json_schema`: every answer validates against the schema, or the call is
    `502 invalid_structured_output`. `X-Forkyard-Retention: off` keeps this call's content even from a team
    that keeps content. A call that could take a budget of the team or key past its limit (or comes
    when one is spent) is `402` with the budget's code, before anything is sent. Over the team's
    requests or tokens per minute: `429` with `Retry-After`; an upstream down or too slow: `502`/`504`."""
    key = key_of(request)
    caller = caller_of(key.team_id, key.id, request.headers.get(RETENTION_HEADER, ""))
    try:
        reply = await replies.chat(caller, request.body)
    except Exception as error:  # noqa: BLE001 - answered as a clear 5xx, never a traceback
        reply = replies.failure(error)
    if reply.events is None:
        await replies.record(reply)
    return _response(reply)


@router.get("/inference/models", response={200: ModelList, **ERRORS}, summary="The models this key may call")
async def models(request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    key = key_of(request)
    return _response(await replies.models(caller_of(key.team_id, key.id, "")))
