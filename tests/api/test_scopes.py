"""Key scopes on every endpoint: a key limited to some resources (sandboxes and launches only,
read-only, inference only), or to labels, is refused outside them, before anything happens.

The endpoints come from the server's own OpenAPI document, so a new endpoint is covered the day it
is added. What each endpoint reads or writes is said here, by its path, independently of the
server's permission table (console/permissions.py): the test fails if the table lets a key do
what its scopes do not name, or refuses what they do. Refusals come before the body is read or any
object is looked up, so absent ids and empty bodies do for the refused calls; a call let through
answers anything but ``403 out_of_scope``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.api.test_isolation import document_operations

pytestmark = pytest.mark.root

WRITES = {"POST", "PUT", "PATCH", "DELETE"}


def resource_of(method: str, path: str) -> str | None:
    """What an operation touches, by its path (None: every key may call it, as GET /me)."""
    tail = path.removeprefix("/api/v1/")
    if tail == "me":
        return None
    if tail.endswith("/snapshot") or tail.startswith("snapshots"):
        return "snapshots"
    first = tail.split("/", 1)[0]
    return {
        "sandboxes": "sandboxes",
        "exec": "sandboxes",
        "leases": "sandboxes",
        "launches": "launches",
        "templates": "templates",
        "network-policies": "network_policies",
        "usage": "usage",
        "budgets": "budgets" if method in WRITES else "usage",
        "keys": "keys",
        "audit": "audit",
        "inference": "inference",
        "grades": "inference",
        "endpoints": "endpoints",
        "endpoint-models": "endpoints",
    }.get(first, first)


def allowed(scopes: list[str], method: str, path: str) -> bool:
    resource = resource_of(method, path)
    if resource is None or not scopes:
        return True
    writes = method in WRITES or path.endswith("/exec") or path == "/api/v1/exec"
    return "*" in scopes or resource in scopes or (not writes and ("*:read" in scopes or f"{resource}:read" in scopes))


def fill(path: str) -> str:
    """Path parameters filled with ids nobody holds: refusals come before any look-up."""
    return (
        path.replace("{sandbox_id}", "sb_0000000000000000")
        .replace("{launch_id}", "launch_0000000000000000")
        .replace("{snapshot_id}", "snap_0000000000000000")
        .replace("{policy_id}", "net_0000000000000000")
        .replace("{key_id}", "key_0000000000000000")
        .replace("{lease_id}", "ls_0000000000000000")
        .replace("{budget_id}", "budget_0000000000000000")
        .replace("{endpoint_id}", "ep_0000000000000000")
        .replace("{grade_id}", "gr_0000000000000000")
        .replace("{name}", "no-such-template")
        .replace("{pid}", "4194999")
        .replace("{port}", "8080")
    )


SCOPED = {
    "sandboxes-and-launches": ["sandboxes", "launches", "templates:read"],
    "read-only": ["*:read"],
    "inference-only": ["inference"],
}


@pytest.fixture(scope="module")
def scoped_keys(stack: Any) -> dict[str, str]:
    """A member key of team A for each shape of scope, made through the API; revoked afterwards."""
    secrets, ids = {}, []
    with stack.client() as api:
        for name, scopes in SCOPED.items():
            made = api.post("/api/v1/keys", json={"name": f"scoped-{name}", "role": "admin", "scopes": scopes})
            assert made.status_code == 201, made.text
            assert made.json()["scopes"] == sorted(scopes)
            secrets[name] = made.json()["secret"]
            ids.append(made.json()["id"])
        yield secrets
        for key_id in ids:
            api.delete(f"/api/v1/keys/{key_id}", params={"delete": "true"})


def test_every_endpoint_refuses_a_key_outside_its_scope(stack: Any, scoped_keys: dict[str, str]) -> None:
    operations = [(method, path) for method, path, _ in document_operations(stack)]
    assert len(operations) >= 60, "the OpenAPI document lost its endpoints?"
    with stack.client() as api:
        sandboxes_before = len(api.get("/api/v1/sandboxes", params={"limit": 1000}).json()["sandboxes"])
    refused_somewhere = set()
    for name, scopes in SCOPED.items():
        with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {scoped_keys[name]}"}, timeout=60) as key:
            for method, path in operations:
                expected = allowed(scopes, method, path)
                if expected and method != "GET":
                    continue  # a write let through would act: what matters here is what is refused
                body: dict[str, Any] = {"json": {}} if method in ("POST", "PUT", "PATCH") else {}
                answer = key.request(method, fill(path), **body)
                where = f"{name}: {method} {path}"
                code = answer.json().get("error", {}).get("code") if answer.headers.get("content-type", "").startswith("application/json") else None
                if expected:
                    assert not (answer.status_code == 403 and code == "out_of_scope"), f"{where} refused within its scope: {answer.text[:300]}"
                else:
                    assert answer.status_code == 403, f"{where}: {answer.status_code} {answer.text[:300]}"
                    assert code == "out_of_scope", f"{where}: {answer.text[:300]}"
                    assert "needs_scope" in answer.json()["error"]["details"], answer.text
                    refused_somewhere.add((method, path))
    # Every operation but GET /me is outside some shape of scope, and was refused there.
    assert refused_somewhere == {operation for operation in operations if operation != ("GET", "/api/v1/me")}
    with stack.client() as api:
        assert len(api.get("/api/v1/sandboxes", params={"limit": 1000}).json()["sandboxes"]) == sandboxes_before, "a refused create made one"


def test_a_sandboxes_only_key_runs_sandboxes_and_nothing_else(stack: Any, scoped_keys: dict[str, str]) -> None:
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {scoped_keys['sandboxes-and-launches']}"}, timeout=120) as key:
        made = key.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 120})
        assert made.status_code == 201, made.text
        try:
            ran = key.post(f"/api/v1/sandboxes/{made.json()['id']}/exec", json={"cmd": "echo in scope"})
            assert ran.status_code == 200 and ran.json()["stdout"] == "in scope\n"
            assert key.get("/api/v1/templates").status_code == 200  # templates: read-only in this preset
            assert key.get("/api/v1/network-policies").json()["error"]["code"] == "out_of_scope"
            assert key.post(f"/api/v1/sandboxes/{made.json()['id']}/snapshot", json={"name": "x"}).status_code == 403
            me = key.get("/api/v1/me").json()
            assert me["scopes"] == sorted(SCOPED["sandboxes-and-launches"])
        finally:
            assert key.delete(f"/api/v1/sandboxes/{made.json()['id']}").status_code in (200, 202)


def test_the_terminal_websocket_refuses_a_key_outside_its_scope(stack: Any, scoped_keys: dict[str, str]) -> None:
    def first_frame(secret: str) -> tuple[dict[str, Any], int | None]:
        url = f"ws://127.0.0.1:{stack.ws_port}/api/v1/sandboxes/sb_0000000000000000/processes/1/pty"
        with connect(url, additional_headers={"Authorization": f"Bearer {secret}"}, open_timeout=30) as socket:
            frame = json.loads(socket.recv(timeout=30))
            try:
                socket.recv(timeout=30)
            except ConnectionClosed as closed:
                return frame, closed.rcvd.code if closed.rcvd else None
        return frame, None

    frame, code = first_frame(scoped_keys["read-only"])
    assert (frame["type"], frame["code"], code) == ("error", "out_of_scope", 4403)
    frame, code = first_frame(scoped_keys["sandboxes-and-launches"])
    assert (frame["code"], code) == ("sandbox_not_found", 4404), "within its scope, the socket goes on to look the sandbox up"


def test_a_scoped_key_cannot_make_a_wider_key(stack: Any, scoped_keys: dict[str, str]) -> None:
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {scoped_keys['read-only']}"}, timeout=30) as key:
        refused = key.post("/api/v1/keys", json={"name": "wider"})
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "out_of_scope"
    with stack.client() as api:
        bad = api.post("/api/v1/keys", json={"name": "typo", "scopes": ["sandbox"]})
        assert bad.status_code == 400 and bad.json()["error"]["field"] == "scopes"


def test_a_label_limited_key_sees_and_touches_only_its_labels(stack: Any) -> None:
    tag = uuid.uuid4().hex[:8]
    with stack.client() as api:
        made = api.post("/api/v1/keys", json={"name": f"labelled-{tag}", "role": "member", "label_limit": {"project": tag}})
        assert made.status_code == 201, made.text
        other = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 120}).json()["id"]
        try:
            with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {made.json()['secret']}"}, timeout=120) as key:
                mine = key.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 120})
                assert mine.status_code == 201, mine.text
                assert mine.json()["labels"] == {"project": tag}, "its creates get its labels"
                listed = {row["id"] for row in key.get("/api/v1/sandboxes", params={"limit": 1000}).json()["sandboxes"]}
                assert listed == {mine.json()["id"]}
                for answer in (
                    key.get(f"/api/v1/sandboxes/{other}"),
                    key.post(f"/api/v1/sandboxes/{other}/exec", json={"cmd": "true"}),
                    key.delete(f"/api/v1/sandboxes/{other}"),
                ):
                    assert (answer.status_code, answer.json()["error"]["code"]) == (404, "sandbox_not_found"), answer.text
                contrary = key.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "labels": {"project": "else"}})
                assert contrary.status_code == 403 and contrary.json()["error"]["field"] == "labels"
                assert key.get("/api/v1/sandboxes", params={"label": "project=else"}).status_code == 403
                assert key.delete(f"/api/v1/sandboxes/{mine.json()['id']}").status_code in (200, 202)
            assert api.get(f"/api/v1/sandboxes/{other}").json()["state"] == "running", "the other sandbox is untouched"
        finally:
            api.delete(f"/api/v1/sandboxes/{other}")
            api.delete(f"/api/v1/keys/{made.json()['id']}", params={"delete": "true"})
