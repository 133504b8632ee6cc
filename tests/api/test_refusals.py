"""Refusals that say what is wrong: the status and code of each bad request, and nothing left behind by one."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def running(stack):
    with stack.client() as api:
        sandbox = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600}).json()
        yield sandbox["id"]
        api.delete(f"/api/v1/sandboxes/{sandbox['id']}")


@pytest.mark.parametrize(
    ("cmd", "why"),
    [
        ("echo a\x00b", "no NUL characters"),
        (["echo", "a\x00b"], "no NUL characters"),
        (["true"] * 4097, "at most 4096 items"),
        ([], "a non-empty command"),
        ("   ", "a non-empty command"),
    ],
    ids=["nul-in-string", "nul-in-argv", "too-many-items", "empty-list", "blank-string"],
)
def test_a_command_that_cannot_run_is_a_400_naming_cmd(api: httpx.Client, running: str, cmd: object, why: str) -> None:
    answer = api.post(f"/api/v1/sandboxes/{running}/exec", json={"cmd": cmd})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["field"] == "cmd" and why in answer.json()["error"]["message"]
    assert api.get(f"/api/v1/sandboxes/{running}").json()["state"] == "running", "the sandbox is untouched"


def test_a_file_mode_out_of_range_is_a_400(api: httpx.Client, running: str) -> None:
    for mode in (-1, 0o10000):
        answer = api.put(f"/api/v1/sandboxes/{running}/files", params={"path": "/tmp/m", "mode": mode}, content=b"x")
        assert answer.status_code == 400 and answer.json()["error"]["field"] == "mode", answer.text


def test_a_size_no_host_can_hold_is_a_422_that_records_nothing(api: httpx.Client) -> None:
    before = api.get("/api/v1/sandboxes", params={"limit": 1000}).json()["sandboxes"]
    answer = api.post("/api/v1/sandboxes", json={"template": "base", "cpu": 64, "memory_mib": 256})
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["code"] == "size_too_large" and error["field"] == "cpu"
    assert error["details"]["max_cpu"] >= 1 and error["details"]["max_memory_mib"] > 256
    assert "Retry-After" not in answer.headers, "asking again cannot help"
    after = api.get("/api/v1/sandboxes", params={"limit": 1000}).json()["sandboxes"]
    assert {row["id"] for row in after} == {row["id"] for row in before}, "no failed row left behind"
    launch = api.post("/api/v1/launches", json={"template": "base", "cpu": 1, "memory_mib": 10**6, "count": 2})
    assert launch.status_code == 422 and launch.json()["error"]["field"] == "memory_mib"


def test_only_admin_keys_manage_network_policies(stack, api: httpx.Client) -> None:
    """The console reserves policies to admins; so does the API, from the same table (console.permissions)."""
    member_key = api.post("/api/v1/keys", json={"name": "member-only", "role": "member"}).json()
    policy = api.post("/api/v1/network-policies", json={"name": "by-admin", "egress": []}).json()
    try:
        with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {member_key['secret']}"}) as member:
            for answer in (
                member.post("/api/v1/network-policies", json={"name": "by-member", "egress": [{"cidr": "0.0.0.0/0"}]}),
                member.put(
                    f"/api/v1/network-policies/{policy['id']}", json={"name": "widened", "egress": [{"cidr": "0.0.0.0/0"}]}
                ),
                member.delete(f"/api/v1/network-policies/{policy['id']}"),
                member.post("/api/v1/keys", json={"name": "escalate", "role": "admin"}),
            ):
                assert answer.status_code == 403, answer.text
                assert answer.json()["error"]["code"] == "forbidden" and answer.json()["error"]["details"]["needs"] == "admin"
            assert member.get("/api/v1/network-policies").status_code == 200, "members may read them"
        kept = api.get(f"/api/v1/network-policies/{policy['id']}").json()
        assert (kept["name"], kept["egress"]) == ("by-admin", []), "nothing the member asked was done"
    finally:
        api.delete(f"/api/v1/network-policies/{policy['id']}")
        api.delete(f"/api/v1/keys/{member_key['id']}")


def _operations(api: httpx.Client) -> list[tuple[str, str, dict]]:
    document = api.get("/api/v1/openapi.json").json()
    return [
        (method.upper(), path.replace("{", "").replace("}", ""), operation)
        for path, methods in document["paths"].items()
        for method, operation in methods.items()
    ]


def test_every_operation_refuses_a_query_parameter_it_does_not_take(api: httpx.Client) -> None:
    """Generated from the published document: a misspelt option is an error naming it, never ignored."""
    operations = _operations(api)
    assert len(operations) > 20
    for method, path, _ in operations:
        answer = api.request(method, path, params={"lable": "x"}, content=b"{}" if method in ("POST", "PUT", "PATCH") else None)
        assert answer.status_code == 400, f"{method} {path}: {answer.status_code} {answer.text[:200]}"
        error = answer.json()["error"]
        assert (error["code"], error["field"]) == ("unknown_parameter", "lable"), f"{method} {path}: {error}"


def test_every_json_body_refuses_a_field_it_does_not_name(api: httpx.Client, running: str) -> None:
    checked = 0
    for method, path, operation in _operations(api):
        schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        if schema is None:
            continue
        url = path.replace("sandbox_id", running)
        answer = api.request(method, url, json={"timeout_ms": 1, "work_dir": "/"})
        assert answer.status_code in (400, 404), f"{method} {path}: {answer.status_code} {answer.text[:200]}"
        if answer.status_code == 400:
            assert "timeout_ms" in answer.text or "work_dir" in answer.text, f"{method} {path}: {answer.text[:300]}"
        checked += 1
    assert checked >= 5
    exec_answer = api.post(f"/api/v1/sandboxes/{running}/exec", json={"cmd": "true", "timeout_ms": 1})
    assert exec_answer.status_code == 400 and exec_answer.json()["error"]["field"] == "timeout_ms", exec_answer.text
    # The documented aliases of the peers' names: accepted, and never both at once.
    alias = api.post(f"/api/v1/sandboxes/{running}/exec", json={"cmd": "sleep 5", "timeout": 0.2, "workdir": "/tmp"})
    assert alias.status_code == 200 and alias.json()["timed_out"] is True, alias.text
    both = api.post(f"/api/v1/sandboxes/{running}/exec", json={"cmd": "true", "timeout": 1, "timeout_s": 1})
    assert both.status_code == 400 and both.json()["error"]["field"] == "timeout", both.text


def _number_fields(schema: dict, components: dict) -> list[str]:
    """The top-level properties of a request body (resolved through $ref) that take a number, not a bool."""
    if "$ref" in schema:
        schema = components[schema["$ref"].rsplit("/", 1)[1]]
    names = []
    for name, prop in schema.get("properties", {}).items():
        kinds = {item.get("type") for item in [prop, *prop.get("anyOf", [])]}
        if kinds & {"integer", "number"} and "boolean" not in kinds:
            names.append(name)
    return names


def test_every_number_in_a_json_body_refuses_true(api: httpx.Client, running: str) -> None:
    """Generated from the published document: ``true`` is no number. Taken as 1 it was a ``ttl_s`` that
    destroyed the sandbox a second later, a lease's ``grace_s`` of one second, ``user`` uid 1, SIGHUP."""
    document = api.get("/api/v1/openapi.json").json()
    components = document["components"]["schemas"]
    checked = []
    for method, path, operation in _operations(api):
        schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        if schema is None:
            continue
        url = path.replace("sandbox_id", running).replace("/pid", "/1")
        for name in _number_fields(schema, components):
            answer = api.request(method, url, json={name: True})
            # A body missing what it needs may be refused for that first; never taken.
            assert answer.status_code in (400, 404), f"{method} {path} {name}=true: {answer.status_code} {answer.text[:300]}"
            checked.append(f"{method} {path} {name}")
    assert {"PATCH /api/v1/sandboxes/sandbox_id ttl_s", "POST /api/v1/leases grace_s"} <= set(checked), checked
    assert "POST /api/v1/sandboxes/sandbox_id/processes/pid/signal signal" in checked, checked
    process = api.post(f"/api/v1/sandboxes/{running}/processes", json={"cmd": "sleep 600"}).json()
    for url, body in (
        (f"/api/v1/sandboxes/{running}", {"ttl_s": True}),
        (f"/api/v1/sandboxes/{running}", {"idle_timeout_s": True}),
        ("/api/v1/leases", {"grace_s": True}),
        (f"/api/v1/sandboxes/{running}/processes/{process['pid']}/signal", {"signal": True}),
    ):
        answer = api.request("PATCH" if url.endswith(running) else "POST", url, json=body)
        assert answer.status_code == 400 and answer.json()["error"]["field"] == next(iter(body)), answer.text
    assert api.get(f"/api/v1/sandboxes/{running}/processes/{process['pid']}").json()["state"] == "running"
    api.post(f"/api/v1/sandboxes/{running}/processes/{process['pid']}/signal", json={"signal": "KILL"})
    nested = api.post(f"/api/v1/sandboxes/{running}/processes", json={"cmd": "true", "pty": {"rows": True}})
    assert nested.status_code == 400 and nested.json()["error"]["field"] == "pty.rows", nested.text
    for user in (True, False):
        refused = api.post(f"/api/v1/sandboxes/{running}/exec", json={"cmd": "id -u", "user": user})
        assert refused.status_code == 400 and refused.json()["error"]["field"] == "user", refused.text
    assert api.get(f"/api/v1/sandboxes/{running}").json()["state"] == "running"
