"""Tenant isolation on every endpoint: team B never sees or touches team A's objects.

The endpoints come from the server's own OpenAPI document, so a new endpoint
is covered the day it is added.
"""

from __future__ import annotations

import re

import httpx
import pytest

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def objects_of_a(stack):
    """One of each of team A's objects."""
    with stack.client() as api:
        sandbox = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600}).json()
        launch = api.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": 2, "ttl_s": 600}).json()
        policy = api.post(
            "/api/v1/network-policies", json={"name": "a-only", "egress": [{"cidr": "10.0.0.0/8", "ports": [443]}]}
        ).json()
        key = api.post("/api/v1/keys", json={"name": "a-second"}).json()
        for made in (sandbox, launch, policy, key):
            assert "id" in made, made
        objects = {
            "sandbox_id": sandbox["id"],
            "launch_id": launch["id"],
            "policy_id": policy["id"],
            "key_id": key["id"],
            "snapshot_id": "snap_doesnotmatter",
            "name": "base",
        }
        yield objects
        api.delete(f"/api/v1/launches/{launch['id']}")
        api.delete(f"/api/v1/sandboxes/{sandbox['id']}")


def operations(stack):
    document = httpx.get(f"{stack.url}/api/v1/openapi.json").json()
    for path, methods in document["paths"].items():
        for method in methods:
            yield method.upper(), path


def test_every_endpoint_with_an_id_answers_404_to_another_team(stack, team_b, objects_of_a):
    checked = 0
    with stack.client(team_b) as intruder:
        for method, path in operations(stack):
            names = re.findall(r"{(\w+)}", path)
            if not names or names == ["name"]:
                continue  # collection endpoints (below) and global templates
            url = path
            for name in names:
                url = url.replace("{" + name + "}", objects_of_a[name])
            body = {"cmd": "true"} if url.endswith("/exec") or url.endswith("/exec/stream") else {"name": "x", "egress": []}
            response = intruder.request(
                method, url, params={"path": "/etc/hostname"}, json=body if method in ("POST", "PUT") else None
            )
            if url.startswith("/api/v1/snapshots") or url.endswith("/snapshot"):
                assert response.status_code == 404, f"{method} {url}: {response.status_code}"
                continue
            assert response.status_code == 404, f"{method} {url}: {response.status_code} {response.text[:200]}"
            assert response.json()["error"]["code"].endswith("_not_found"), f"{method} {url}"
            checked += 1
    assert checked >= 15, "the OpenAPI document lost its endpoints?"


def test_lists_never_show_another_teams_objects(stack, team_b, objects_of_a):
    with stack.client(team_b) as intruder:
        seen = " ".join(
            intruder.get(url).text
            for url in (
                "/api/v1/sandboxes",
                "/api/v1/launches",
                "/api/v1/network-policies",
                "/api/v1/keys",
                "/api/v1/snapshots",
                "/api/v1/usage?group_by=key",
            )
        )
    for value in objects_of_a.values():
        if value != "base":
            assert value not in seen


def test_a_revoked_or_wrong_key_gets_401(stack, api):
    made = api.post("/api/v1/keys", json={"name": "short-lived"}).json()
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {made['secret']}"}) as client:
        assert client.get("/api/v1/me").status_code == 200
        api.delete(f"/api/v1/keys/{made['id']}")
        refused = client.get("/api/v1/me")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
    for header in ("Bearer fy_000000000000_nope", "Bearer nonsense", "Basic Zm9vOmJhcg==", ""):
        response = httpx.get(f"{stack.url}/api/v1/sandboxes", headers={"Authorization": header} if header else {})
        assert response.status_code == 401, header


def test_member_keys_cannot_manage_keys(stack, api):
    member = api.post("/api/v1/keys", json={"name": "member", "role": "member"}).json()
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {member['secret']}"}) as client:
        refused = client.post("/api/v1/keys", json={"name": "escalate", "role": "admin"})
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
        assert client.get("/api/v1/sandboxes").status_code == 200
