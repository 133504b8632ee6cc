"""Bad input on each endpoint gets a 4xx with a stable code and the field named, never a 500."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def running(stack):
    with stack.client() as api:
        sandbox = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600}).json()
        yield sandbox["id"]
        api.delete(f"/api/v1/sandboxes/{sandbox['id']}")


CREATE_CASES = [
    ({"template": "base", "size": "enormous"}, 400, "invalid_size", "size"),
    ({"template": "base", "size": "tiny", "cpu": 1}, 400, "invalid_size", "size"),
    ({"template": "base", "cpu": 1}, 400, "invalid_size", "memory_mib"),
    ({"template": "base", "cpu": -1, "memory_mib": 64}, 400, "invalid_request", "cpu"),
    ({"template": "base", "memory_mib": 1, "cpu": 1}, 400, "invalid_request", "memory_mib"),
    ({"template": "nope"}, 404, "template_not_found", "template"),
    ({"snapshot": "snap_nope"}, 404, "snapshot_not_found", "snapshot"),
    ({}, 400, "invalid_request", "template"),
    ({"template": "base", "snapshot": "snap_x"}, 400, "invalid_request", "template"),
    ({"template": "base", "ttl_s": 0}, 400, "invalid_request", "ttl_s"),
    ({"template": "base", "ttl_s": "soon"}, 400, "invalid_request", "ttl_s"),
    ({"template": "base", "ttl_s": 10**9}, 400, "invalid_request", "ttl_s"),
    ({"template": "base", "labels": {"bad key!": "x"}}, 400, "invalid_request", "labels"),
    ({"template": "base", "labels": ["a"]}, 400, "invalid_request", "labels"),
    ({"template": "base", "env": {"A=B": "x"}}, 400, "invalid_request", "env"),
    ({"template": "base", "env": {"A": 5}}, 400, "invalid_request", "env.A"),
    ({"template": "base", "network_policy": "net_nope"}, 404, "network_policy_not_found", "network_policy"),
    ({"template": ["base"]}, 400, "invalid_request", "template"),
]


@pytest.mark.parametrize("body,status,code,field", CREATE_CASES)
def test_bad_sandbox_create(api, body, status, code, field):
    response = api.post("/api/v1/sandboxes", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"]
    assert error.get("field") == field


def test_bodies_that_are_not_json(api):
    for content in (b"{not json", b"[1,2]", b"", b"\xff\xfe"):
        response = api.post("/api/v1/sandboxes", content=content, headers={"Content-Type": "application/json"})
        assert response.status_code == 400, (content, response.text)
        assert response.json()["error"]["code"] == "invalid_request"


EXEC_CASES = [
    ({"cmd": 42}, "cmd"),
    ({"cmd": []}, "cmd"),
    ({"cmd": ["echo", 3]}, "cmd"),
    ({"cmd": ""}, "cmd"),
    ({"cmd": ["a\u0000b"]}, "cmd"),
    ({"cmd": "true", "cwd": "relative/path"}, "cwd"),
    ({"cmd": "true", "timeout_s": 0}, "timeout_s"),
    ({"cmd": "true", "timeout_s": 10**9}, "timeout_s"),
    ({"cmd": "true", "env": {"": "x"}}, "env"),
    ({"cmd": "true", "stdin_b64": "***"}, "stdin_b64"),
    ({"cmd": "true", "output": "hex"}, "output"),
    ({"cmd": "true", "max_output_bytes": -1}, "max_output_bytes"),
]


@pytest.mark.parametrize("body,field", EXEC_CASES)
def test_bad_exec(api, running, body, field):
    response = api.post(f"/api/v1/sandboxes/{running}/exec", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"].get("field") == field, response.text


@pytest.mark.parametrize(
    "method,url,params,status,code",
    [
        ("GET", "files", {"path": "/no/such"}, 404, "file_not_found"),
        ("GET", "files", {"path": "/etc"}, 409, "not_a_file"),
        ("GET", "files", {"path": "a\u0000b"}, 400, "invalid_path"),
        ("GET", "files", {}, 400, "invalid_request"),
        ("GET", "files/list", {"path": "/etc/passwd"}, 409, "not_a_directory"),
        ("GET", "files/list", {"path": "/proc/self"}, 400, "invalid_path"),
        ("DELETE", "files", {"path": "/"}, 400, "invalid_path"),
        ("GET", "archive", {"path": "/nowhere"}, 404, "file_not_found"),
        ("PUT", "archive", {"path": "/x"}, 400, "invalid_path"),
    ],
)
def test_bad_file_requests(api, running, method, url, params, status, code):
    response = api.request(
        method, f"/api/v1/sandboxes/{running}/{url}", params=params, content=b"not a tar" if method == "PUT" else None
    )
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code


def test_bad_listing_and_usage_queries(api):
    assert api.get("/api/v1/sandboxes", params={"state": "flying"}).json()["error"]["field"] == "state"
    assert api.get("/api/v1/sandboxes", params={"limit": 0}).status_code == 400
    assert api.get("/api/v1/usage", params={"group_by": "colour"}).json()["error"]["field"] == "group_by"
    assert api.get("/api/v1/usage", params={"start": "2030-01-02T00:00:00Z", "end": "2030-01-01T00:00:00Z"}).status_code == 400
    assert api.get("/api/v1/usage", params={"start": "yesterday"}).status_code == 400
    for cursor in ("junk", "2026-01-01|", "x|y", "2026-01-01T00:00:00|abc"):  # the last one lacks a timezone
        response = api.get("/api/v1/sandboxes", params={"cursor": cursor})
        assert response.status_code == 400 and response.json()["error"]["field"] == "cursor", (cursor, response.text)
    assert api.get("/api/v1/sandboxes", params={"label": "=x"}).json()["error"]["field"] == "label"


def test_bad_launch_member_queries(api):
    launch = api.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": 1, "ttl_s": 60}).json()
    members = f"/api/v1/launches/{launch['id']}/sandboxes"
    for params, field in (({"cursor": "junk"}, "cursor"), ({"cursor": "-1"}, "cursor"), ({"state": "flying"}, "state")):
        response = api.get(members, params=params)
        assert response.status_code == 400 and response.json()["error"]["field"] == field, (params, response.text)
    api.delete(f"/api/v1/launches/{launch['id']}")


def test_a_label_key_is_taken_literally(api):
    """A key is a JSON key, never a lookup: ``suite__regex=.*`` matches nothing, not everything."""
    labelled = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 60, "labels": {"n": "1"}}).json()
    try:
        assert api.get("/api/v1/sandboxes", params={"label": "n__regex=.*"}).json()["sandboxes"] == []
        assert api.get("/api/v1/sandboxes", params={"label": "n__gt=0"}).json()["sandboxes"] == []
        found = api.get("/api/v1/sandboxes", params={"label": "n=1"}).json()["sandboxes"]
        assert [row["id"] for row in found] == [labelled["id"]], "a string value that looks like a number still matches"
        assert [row["id"] for row in api.get("/api/v1/sandboxes", params={"label": "n"}).json()["sandboxes"]] == [labelled["id"]]
    finally:
        api.delete(f"/api/v1/sandboxes/{labelled['id']}")


def test_bad_network_policies(api):
    for body, field in [
        ({"name": ""}, "name"),
        ({"name": "p", "egress": [{"cidr": "not-a-net"}]}, "egress.0.cidr"),
        ({"name": "p", "egress": [{"cidr": "10.0.0.0/8", "host": "a.b"}]}, "egress.0"),
        ({"name": "p", "egress": [{"host": "bad host"}]}, "egress.0.host"),
        ({"name": "p", "egress": [{"cidr": "10.0.0.0/8", "ports": [70000]}]}, "egress.0.ports"),
        ({"name": "p", "egress": [{"cidr": "10.0.0.0/8", "protocol": "icmp"}]}, "egress.0.protocol"),
    ]:
        response = api.post("/api/v1/network-policies", json=body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["field"] == field, (body, response.text)
    first = api.post("/api/v1/network-policies", json={"name": "dup"})
    assert first.status_code == 201
    again = api.post("/api/v1/network-policies", json={"name": "dup"})
    assert again.status_code == 409 and again.json()["error"]["code"] == "name_taken"


def test_unknown_routes_and_methods(api):
    assert api.get("/api/v1/nothing-here").status_code == 404
    assert api.patch("/api/v1/sandboxes").status_code == 405
