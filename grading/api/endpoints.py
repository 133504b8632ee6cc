"""``/endpoints``: dedicated open-model endpoints, a model server of the team's own on a host."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja import Router
from ninja.params.functions import Query

from console.api_base import BUDGETED, ERRORS, key_of
from console.db import db

from .. import selectors, services
from ..models import Endpoint, ServedModel
from ..schemas import EndpointCreate, EndpointList, EndpointOut, ServedModelList

router = Router(tags=["endpoints"])


def endpoint_out(endpoint: Endpoint) -> dict[str, Any]:
    return {
        "id": endpoint.id,
        "name": endpoint.name,
        "model": endpoint.model_id,
        "server": endpoint.model.server,
        "state": endpoint.state,
        "host": endpoint.host.name if endpoint.host is not None else None,
        "restarts": endpoint.restarts,
        "error": {"code": endpoint.error_code, "message": endpoint.error_message} if endpoint.error_code else None,
        "created_at": endpoint.created_at,
        "started_at": endpoint.started_at,
        "ready_at": endpoint.ready_at,
        "ended_at": endpoint.ended_at,
    }


def _model_out(model: ServedModel) -> dict[str, Any]:
    return {"name": model.name, "server": model.server, "context_length": model.context_length, "description": model.description}


def _create(team: Any, key: Any, payload: EndpointCreate) -> dict[str, Any]:
    model = selectors.served_model(payload.model)
    endpoint = services.endpoint_create(team=team, api_key=key, model=model, name=payload.name)
    return endpoint_out(selectors.endpoint_for(team, endpoint.id))


def _delete(team: Any, endpoint_id: str) -> dict[str, Any]:
    endpoint = services.endpoint_delete(endpoint=selectors.endpoint_for(team, endpoint_id))
    return endpoint_out(selectors.endpoint_for(team, endpoint.id))


def _page(team: Any, cursor: str | None, limit: int) -> dict[str, Any]:
    page = selectors.endpoints_page(team, cursor=cursor, limit=limit)
    return {"endpoints": [endpoint_out(row) for row in page.rows], "next_cursor": page.next_cursor}


@router.post("/endpoints", response={201: EndpointOut, **BUDGETED}, summary="Deploy a dedicated endpoint")
async def create_endpoint(request: HttpRequest, payload: EndpointCreate) -> tuple[int, dict[str, Any]]:
    """An open model of the operator's catalogue (`GET /endpoint-models`) served for the team alone by a
    model server on one host (llama.cpp on CPU hosts, vLLM on GPU hosts), placed and supervised by its
    host's engine: restarted if it dies, billed per second while it holds its host. It is `queued`, then
    `starting`, then `ready`: from then its `name` is a model of the team's `GET /inference/models`,
    and its answers under `response_format` `json_schema` are decoded under a grammar of the schema.
    While a budget of the team or of this key is spent, it is refused (`402`, the code naming the budget)."""
    key = key_of(request)
    return 201, await db(_create)(key.team, key, payload)


@router.get("/endpoints", response={200: EndpointList, **ERRORS}, summary="List dedicated endpoints")
async def list_endpoints(request: HttpRequest, limit: int = Query(100, ge=1, le=1000), cursor: str | None = None) -> dict[str, Any]:
    """Newest first; pass `next_cursor` as `cursor` for the next page."""
    return await db(_page)(key_of(request).team, cursor, limit)


@router.get("/endpoint-models", response={200: ServedModelList, **ERRORS}, summary="The open models an endpoint may serve")
async def list_served_models(request: HttpRequest) -> dict[str, Any]:
    key_of(request)
    return {"models": [_model_out(model) for model in await db(selectors.served_models)()]}


@router.get("/endpoints/{endpoint_id}", response={200: EndpointOut, **ERRORS}, summary="Get a dedicated endpoint")
async def get_endpoint(request: HttpRequest, endpoint_id: str) -> dict[str, Any]:
    return endpoint_out(await db(selectors.endpoint_for)(key_of(request).team, endpoint_id))


@router.delete("/endpoints/{endpoint_id}", response={200: EndpointOut, **ERRORS}, summary="Delete a dedicated endpoint")
async def delete_endpoint(request: HttpRequest, endpoint_id: str) -> dict[str, Any]:
    """Its model server is stopped and its billing ends (`stopping`, then `deleted`). Idempotent."""
    key = key_of(request)
    return await db(_delete)(key.team, endpoint_id)
