"""Responses validate against the OpenAPI document the server publishes."""

from __future__ import annotations

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def document(stack):
    return httpx.get(f"{stack.url}/api/v1/openapi.json").json()


def check(document: dict, method: str, path: str, response: httpx.Response) -> None:
    operation = document["paths"][path][method.lower()]
    declared = operation["responses"].get(str(response.status_code))
    assert declared is not None, f"{method} {path} answered {response.status_code}, which it does not declare"
    content = declared.get("content", {}).get("application/json")
    if content is None:
        return
    schema = {**content["schema"], "components": document["components"]}
    jsonschema.validate(response.json(), schema, cls=jsonschema.Draft202012Validator)


def test_responses_match_the_document(api, document):
    created = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "labels": {"schema": "yes"}})
    check(document, "POST", "/api/v1/sandboxes", created)
    sandbox = created.json()["id"]
    base = "/api/v1/sandboxes/{sandbox_id}"
    check(document, "GET", base, api.get(f"/api/v1/sandboxes/{sandbox}"))
    check(document, "GET", "/api/v1/sandboxes", api.get("/api/v1/sandboxes"))
    check(document, "POST", base + "/exec", api.post(f"/api/v1/sandboxes/{sandbox}/exec", json={"cmd": "echo ok"}))
    check(document, "PUT", base + "/files", api.put(f"/api/v1/sandboxes/{sandbox}/files", params={"path": "/a"}, content=b"x"))
    check(document, "GET", base + "/files/list", api.get(f"/api/v1/sandboxes/{sandbox}/files/list", params={"path": "/"}))
    check(document, "POST", base + "/pause", api.post(f"/api/v1/sandboxes/{sandbox}/pause"))
    check(document, "POST", base + "/resume", api.post(f"/api/v1/sandboxes/{sandbox}/resume"))
    check(document, "GET", "/api/v1/templates", api.get("/api/v1/templates"))
    check(document, "GET", "/api/v1/me", api.get("/api/v1/me"))
    check(document, "GET", "/api/v1/keys", api.get("/api/v1/keys"))
    check(document, "GET", base, api.get("/api/v1/sandboxes/sb_missing"))
    check(document, "POST", "/api/v1/sandboxes", api.post("/api/v1/sandboxes", json={"template": "base", "size": "huge"}))
    launch = api.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": 2})
    check(document, "POST", "/api/v1/launches", launch)
    check(document, "GET", "/api/v1/launches/{launch_id}", api.get(f"/api/v1/launches/{launch.json()['id']}"))
    check(document, "DELETE", "/api/v1/launches/{launch_id}", api.delete(f"/api/v1/launches/{launch.json()['id']}"))
    check(document, "DELETE", base, api.delete(f"/api/v1/sandboxes/{sandbox}"))
