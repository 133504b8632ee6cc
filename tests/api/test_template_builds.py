"""Template builds through the real HTTP API: steps of each kind run in real sandboxes, their snapshots
reused by a rebuild, a failed step's error and output, scoping to the team, deleting.

The base is the busybox ``base`` template: these steps need no network. Package installs (``apt``,
``pip``) under a policy are tests/api/test_template_packages.py's.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import httpx
import pytest

from tests.api.test_schema import check, document  # noqa: F401 - a fixture

pytestmark = pytest.mark.root

WEB = {"name": "web", "command": "httpd -f -p 8080 -h /srv", "ready": {"tcp": 8080}}


def spec(name: str, *steps: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"name": name, "base": "base", "size": "tiny", "steps": list(steps), **extra}


def build(api: httpx.Client, body: dict[str, Any], timeout_s: float = 180) -> dict[str, Any]:
    """POST the spec, follow its logs stream to the end; the build as it ended, and the stream's lines."""
    answer = api.post("/api/v1/templates", json=body)
    assert answer.status_code == 202, answer.text
    assert answer.json()["state"] in ("queued", "building", "ready")
    lines = []
    with api.stream("GET", f"/api/v1/templates/{body['name']}/build/logs", timeout=timeout_s) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if line:
                lines.append(json.loads(line))
    assert lines and lines[-1]["type"] == "end", lines[-3:]
    ended: dict[str, Any] = lines[-1]["build"]
    assert ended["id"] == answer.json()["id"]
    got = api.get(f"/api/v1/templates/{body['name']}/build")
    assert got.json() == ended
    return {**ended, "lines": lines}


def run(api: httpx.Client, sandbox_id: str, cmd: str) -> dict[str, Any]:
    response = api.post(f"/api/v1/sandboxes/{sandbox_id}/exec", json={"cmd": cmd})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


@pytest.fixture(scope="module")
def app(stack) -> dict[str, Any]:
    """A template built with a step of every kind that needs no network, and services."""
    name = f"app-{uuid.uuid4().hex[:6]}"
    body = spec(
        name,
        {"run": "mkdir -p /srv && echo one > /srv/a && echo built-step-one"},
        {"file": {"path": "/srv/index.html", "content": "served from a built template\n"}},
        {"file": {"path": "/srv/bin/tool", "content_b64": "IyEvYmluL3NoCmVjaG8gdG9vbAo=", "mode": 0o755}},
        {"env": {"GREETING": "hello"}},
        {"workdir": "/srv"},
        {"run": "echo $GREETING > c && pwd > d"},
        services=[WEB],
        description="every kind of step",
    )
    with stack.client() as api:
        built = build(api, body)
    return {"name": name, "spec": body, "build": built}


def test_a_build_runs_every_step_and_its_sandboxes_have_what_the_steps_made(api, app):
    built = app["build"]
    assert built["state"] == "ready" and built["error"] is None and built["cached"] is False
    kinds = [step["kind"] for step in built["steps"]]
    assert kinds == ["run", "file", "file", "env", "workdir", "run", "finish"]
    assert {step["state"] for step in built["steps"]} == {"done"}
    assert all(step["snapshot"] for step in built["steps"]) and len({s["snapshot"] for s in built["steps"]}) == 7
    text = "".join(line["text"] for line in built["lines"] if line["type"] == "log")
    assert "== step 1/7: run mkdir -p /srv" in text and "built-step-one" in text, text[:2000]
    template = api.get(f"/api/v1/templates/{app['name']}")
    assert template.json()["state"] == "ready" and template.json()["public"] is False
    assert template.json()["snapshot"] == built["steps"][-1]["snapshot"] and template.json()["build"] == built["id"]
    assert template.json()["description"] == "every kind of step" and template.json()["hosts"]

    made = api.post("/api/v1/sandboxes", json={"template": app["name"], "size": "tiny", "ttl_s": 300})
    assert made.status_code == 201, made.text
    sandbox = made.json()["id"]
    try:
        result = run(api, sandbox, "cat /srv/a c d; echo $GREETING; pwd; /srv/bin/tool; wget -qO- http://127.0.0.1:8080/")
        assert result["stdout"] == "one\nhello\n/srv\nhello\n/srv\ntool\nserved from a built template\n", result
        # The build's own sandboxes are gone: one a step, each destroyed.
        builders = api.get("/api/v1/sandboxes", params={"label": f"forkyard.build={built['id']}"}).json()["sandboxes"]
        assert [builder["state"] for builder in builders] == ["destroyed"] * 7
        # Deleting it is refused while a sandbox of it lives.
        refused = api.delete(f"/api/v1/templates/{app['name']}")
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "template_in_use", refused.text
        assert refused.json()["error"]["details"]["forks_alive"] == 1
        # Its last snapshot cannot be deleted from under it either.
        held = api.delete(f"/api/v1/snapshots/{template.json()['snapshot']}")
        assert held.status_code == 409 and held.json()["error"]["details"]["templates"] == 1, held.text
    finally:
        api.delete(f"/api/v1/sandboxes/{sandbox}")


def test_a_rebuild_of_the_same_spec_runs_nothing_and_a_changed_step_reuses_the_ones_before_it(api, app):
    started = time.monotonic()
    again = build(api, app["spec"])
    rebuilt_s = time.monotonic() - started
    assert again["state"] == "ready" and again["cached"] is True, again
    assert [step["state"] for step in again["steps"]] == ["cached"] * 7
    assert [step["snapshot"] for step in again["steps"]] == [step["snapshot"] for step in app["build"]["steps"]]
    print(f"cached rebuild of a 7-step spec: {rebuilt_s:.2f} s through the API")

    changed = dict(app["spec"], name=f"{app['name']}-b")
    changed["steps"] = [*app["spec"]["steps"][:3], {"run": "echo changed > /srv/e"}]
    other = build(api, changed)
    assert [step["state"] for step in other["steps"]] == ["cached", "cached", "cached", "done", "done"]
    assert [step["snapshot"] for step in other["steps"][:3]] == [step["snapshot"] for step in app["build"]["steps"][:3]]
    made = api.post("/api/v1/sandboxes", json={"template": changed["name"], "size": "tiny", "ttl_s": 300}).json()
    try:
        assert run(api, made["id"], "cat /srv/a /srv/e; test -e /srv/c || echo no-c")["stdout"] == "one\nchanged\nno-c\n"
    finally:
        api.delete(f"/api/v1/sandboxes/{made['id']}")
    assert api.delete(f"/api/v1/templates/{changed['name']}").status_code == 200
    assert api.get(f"/api/v1/templates/{changed['name']}").status_code == 404


def test_a_failed_step_names_itself_keeps_its_output_and_leaves_nothing_to_start_from(api):
    name = f"broken-{uuid.uuid4().hex[:6]}"
    failed = build(
        api,
        spec(
            name,
            {"run": "echo fine"},
            {"run": "echo doomed-output; echo to-stderr >&2; printf 'a\\000b\\n'; exit 3"},
            {"run": "true"},
        ),
    )
    assert failed["state"] == "failed" and failed["failed_step"] == 1, failed
    assert failed["error"]["code"] == "step_failed" and "step 2 (run echo doomed-output" in failed["error"]["message"]
    assert "exited with 3" in failed["error"]["message"]
    assert "doomed-output" in failed["error_output"] and "to-stderr" in failed["error_output"]
    # A NUL from the sandbox (which PostgreSQL's text cannot hold) is kept as U+FFFD, not a crashed build.
    assert "a\ufffdb" in failed["error_output"]
    assert [step["state"] for step in failed["steps"]] == ["done", "failed", "pending"]
    assert api.get(f"/api/v1/templates/{name}").json()["state"] == "failed"
    refused = api.post("/api/v1/sandboxes", json={"template": name, "size": "tiny", "ttl_s": 60})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "template_not_ready", refused.text
    builders = api.get("/api/v1/sandboxes", params={"label": f"forkyard.build={failed['id']}"}).json()["sandboxes"]
    assert [builder["state"] for builder in builders] == ["destroyed"] * 2
    assert api.delete(f"/api/v1/templates/{name}").status_code == 200


def test_templates_are_the_teams_own(stack, team_b, app):
    with stack.client(team_b) as intruder:
        for response in (
            intruder.get(f"/api/v1/templates/{app['name']}"),
            intruder.get(f"/api/v1/templates/{app['name']}/build"),
            intruder.get(f"/api/v1/templates/{app['name']}/build/logs"),
            intruder.delete(f"/api/v1/templates/{app['name']}"),
            intruder.post("/api/v1/sandboxes", json={"template": app["name"], "size": "tiny"}),
            intruder.post("/api/v1/templates", json=spec("mine", {"run": "true"}, base=app["name"])),
        ):
            assert response.status_code == 404 and response.json()["error"]["code"] == "template_not_found", response.text
        names = [template["name"] for template in intruder.get("/api/v1/templates").json()["templates"]]
        assert app["name"] not in names and "base" in names


@pytest.mark.parametrize(
    ("body", "status", "code", "field"),
    [
        ({"name": "x", "base": "base", "steps": [], "colour": "red"}, 400, "invalid_request", "colour"),
        ({"name": "x", "base": "base", "steps": [{"run": "true", "apt": ["git"]}]}, 400, "invalid_request", "steps.0.run"),
        ({"name": "x", "base": "base", "steps": [{}]}, 400, "invalid_request", "steps.0.run"),
        ({"name": "x", "base": "base", "steps": [{"apt": ["git; rm -rf /"]}]}, 400, "invalid_request", "steps.0.apt.0"),
        (
            {"name": "x", "base": "base", "steps": [{"run": "true", "index_url": "http://a/"}]},
            400,
            "invalid_request",
            "steps.0.index_url",
        ),
        ({"name": "x", "base": "base", "steps": [{"file": {"path": "/a"}}]}, 400, "invalid_request", "steps.0.file.content"),
        ({"name": "Bad Name", "base": "base"}, 400, "invalid_request", "name"),
        ({"name": "x", "base": "no-such-template"}, 404, "template_not_found", "base"),
        ({"name": "x", "base": "snapshot:snap_nope"}, 404, "snapshot_not_found", "base"),
        ({"name": "x", "base": "base", "network_policy": "net_nope"}, 404, "network_policy_not_found", "network_policy"),
        ({"name": "base", "base": "base"}, 409, "template_name_taken", "name"),
    ],
)
def test_a_bad_spec_is_refused_with_its_field_and_nothing_is_made(api, body, status, code, field):
    before = len(api.get("/api/v1/templates").json()["templates"])
    response = api.post("/api/v1/templates", json=body)
    assert response.status_code == status and response.json()["error"]["code"] == code, response.text
    assert response.json()["error"].get("field") == field, response.json()
    assert len(api.get("/api/v1/templates").json()["templates"]) == before


def test_a_public_template_is_not_the_teams_to_delete(api):
    response = api.delete("/api/v1/templates/base")
    assert response.status_code == 409 and response.json()["error"]["code"] == "template_public"
    assert api.get("/api/v1/templates/base").json()["state"] == "ready"


def test_answers_match_the_published_document(api, app, document):  # noqa: F811 - the fixture
    name = app["name"]
    check(document, "GET", "/api/v1/templates", api.get("/api/v1/templates"))
    check(document, "GET", "/api/v1/templates/{name}", api.get(f"/api/v1/templates/{name}"))
    check(document, "GET", "/api/v1/templates/{name}/build", api.get(f"/api/v1/templates/{name}/build"))
    check(document, "GET", "/api/v1/templates/{name}", api.get("/api/v1/templates/nope"))
    check(document, "POST", "/api/v1/templates", api.post("/api/v1/templates", json=app["spec"]))
    check(document, "DELETE", "/api/v1/templates/{name}", api.delete("/api/v1/templates/base"))
