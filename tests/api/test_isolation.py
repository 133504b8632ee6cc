"""Tenant isolation on every endpoint: team B never sees or touches team A's objects.

The endpoints come from the server's own OpenAPI document, so a new endpoint
is covered the day it is added (or fails here until this file says how team B
could misuse it). Team A holds a real object for every path parameter the
document names: a running sandbox and a paused one (each with a file), a
launch, a ready snapshot, a network policy, a second key, a lease, and a template of
its own. Team B, with an admin key, calls every endpoint on them with bodies
that would do damage if they were let through (overwrite the file, rename
the policy, pause the sandbox, revoke the key, delete the snapshot); every
call must be refused as if the object did not exist (the same status and code
as for an id nobody holds), and afterwards team A finds every object as it
was: state, name, rules, file content, the sandbox running (or paused) in the
engine itself, the key still authenticating.

The document lists 403 among every operation's answers (the shared error
table); team B's key is an admin's, so no call here is refused for its role,
and every one must answer 404 with the object's ``*_not_found`` code. Templates
are the one shared kind: a global template is every team's by design (checked
below); team A's own is made in the database (a build through the API is
tests/api/test_template_builds.py's), where the model and the selectors keep
them per team.
"""

from __future__ import annotations

import io
import itertools
import json
import re
import tarfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.api.test_image_import import _tar as _tar_of
from tests.support.stack import wait_for_launch

pytestmark = pytest.mark.root

FILE = "/data/a.txt"
CONTENT = b"team A's own file: team B must neither read nor change it\n"
# The code team B gets for each path parameter: the same as for an id that does not exist.
NOT_FOUND = {
    "sandbox_id": "sandbox_not_found",
    "launch_id": "launch_not_found",
    "snapshot_id": "snapshot_not_found",
    "policy_id": "network_policy_not_found",
    "key_id": "key_not_found",
    "name": "template_not_found",
    "lease_id": "lease_not_found",
    "pid": "process_not_found",
    "port": "port_not_found",
    "budget_id": "budget_not_found",
    "endpoint_id": "endpoint_not_found",
    "grade_id": "grade_not_found",
}
# What a query parameter that names an object refers to (the old `before=<id>` paging).
QUERY_OBJECTS = {"before": {"/api/v1/launches": "launch_id", "/api/v1/snapshots": "snapshot_id"}}


def _tar_overwriting_the_file() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        data = b"pwned by team B\n"
        member = tarfile.TarInfo(FILE.rsplit("/", 1)[1])
        member.size = len(data)
        archive.addfile(member, io.BytesIO(data))
    return buffer.getvalue()


# What team B sends to each endpoint that takes a body or a path: whatever would do
# damage to team A's object if the call were let through.
ATTEMPTS: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/api/v1/sandboxes/{sandbox_id}/exec"): {"json": {"cmd": f"echo pwned > {FILE}; cat /etc/hostname"}},
    ("POST", "/api/v1/sandboxes/{sandbox_id}/exec/stream"): {"json": {"cmd": f"echo pwned > {FILE}"}},
    ("GET", "/api/v1/sandboxes/{sandbox_id}/files"): {"params": {"path": FILE}},
    ("PUT", "/api/v1/sandboxes/{sandbox_id}/files"): {"params": {"path": FILE}, "content": b"pwned by team B\n"},
    ("DELETE", "/api/v1/sandboxes/{sandbox_id}/files"): {"params": {"path": "/data", "recursive": "true"}},
    ("GET", "/api/v1/sandboxes/{sandbox_id}/files/list"): {"params": {"path": "/data"}},
    ("GET", "/api/v1/sandboxes/{sandbox_id}/files/stat"): {"params": {"path": FILE}},
    ("POST", "/api/v1/sandboxes/{sandbox_id}/files/rename"): {"json": {"path": FILE, "target": "/data/stolen"}},
    ("POST", "/api/v1/sandboxes/{sandbox_id}/files/mkdir"): {"json": {"path": "/data/pwned"}},
    ("GET", "/api/v1/sandboxes/{sandbox_id}/files/watch"): {"params": {"path": "/data", "timeout_s": "5"}},
    ("GET", "/api/v1/sandboxes/{sandbox_id}/archive"): {"params": {"path": "/data"}},
    ("PUT", "/api/v1/sandboxes/{sandbox_id}/archive"): {"params": {"path": "/data"}, "content": _tar_overwriting_the_file()},
    ("POST", "/api/v1/sandboxes/{sandbox_id}/snapshot"): {"json": {"name": "stolen"}},
    ("DELETE", "/api/v1/sandboxes/{sandbox_id}"): {"params": {"wait": "true"}},
    ("PATCH", "/api/v1/sandboxes/{sandbox_id}"): {"json": {"labels": {"owner": "pwned"}}},
    ("PUT", "/api/v1/network-policies/{policy_id}"): {"json": {"name": "pwned", "egress": [{"cidr": "0.0.0.0/0"}]}},
    ("POST", "/api/v1/sandboxes/{sandbox_id}/processes"): {"json": {"cmd": f"echo pwned > {FILE}"}},
    ("POST", "/api/v1/sandboxes/{sandbox_id}/processes/{pid}/signal"): {"json": {"signal": "KILL", "group": True}},
    ("POST", "/api/v1/sandboxes/{sandbox_id}/processes/{pid}/wait"): {"json": {"timeout_s": 1}},
    ("POST", "/api/v1/sandboxes/{sandbox_id}/processes/{pid}/input"): {"json": {"data": f"echo pwned > {FILE}\n", "eof": True}},
    ("POST", "/api/v1/sandboxes/{sandbox_id}/processes/{pid}/resize"): {"json": {"rows": 1, "cols": 1}},
    ("POST", "/api/v1/sandboxes/{sandbox_id}/ports"): {"json": {"port": 8080, "auth": "public"}},
    ("POST", "/api/v1/sandboxes/{sandbox_id}/ports/{port}/wait"): {"json": {"timeout_s": 0}},
    ("POST", "/api/v1/sandboxes/{sandbox_id}/desktop/screenshot"): {"json": {"scale": 0.5}},
    ("POST", "/api/v1/sandboxes/{sandbox_id}/desktop/actions"): {"json": {"actions": [{"type": "move", "x": 1, "y": 1}]}},
    ("POST", "/api/v1/sandboxes/{sandbox_id}/desktop/view"): {"json": {"mode": "control"}},
    ("PATCH", "/api/v1/keys/{key_id}"): {"json": {"name": "pwned"}},
    ("PUT", "/api/v1/budgets/{budget_id}"): {"json": {"monthly_limit": "0", "over_limit": "destroy", "grace_s": 0}},
    ("POST", "/api/v1/sandboxes/{sandbox_id}/grade"): {"json": {"cmd": f"echo pwned > {FILE}", "timeout_s": 10}},
}


def document_operations(stack: Any) -> list[tuple[str, str, dict[str, Any]]]:
    document = httpx.get(f"{stack.url}/api/v1/openapi.json").json()
    return [
        (method.upper(), path, operation)
        for path, methods in document["paths"].items()
        for method, operation in methods.items()
        if method in ("get", "post", "put", "patch", "delete")
    ]


def every_page(client: httpx.Client, path: str, params: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], str]:
    """Every row of a list (all its pages), and the raw text of every page."""
    rows: list[dict[str, Any]] = []
    texts = []
    cursor = None
    while True:
        response = client.get(path, params={**(params or {}), **({"cursor": cursor} if cursor else {})})
        assert response.status_code == 200, f"{path}: {response.text[:300]}"
        texts.append(response.text)
        body = response.json()
        rows += body[path.rsplit("/", 1)[1].replace("network-policies", "network_policies")]
        cursor = body["next_cursor"]
        if not cursor:
            return rows, " ".join(texts)


def absent(value: str) -> str:
    """An id shaped like ``value`` that nobody holds."""
    if value.isdigit():
        return "4194999"  # a pid: above any the kernel hands out (pid_max is at most 4,194,304)
    prefix, separator, tail = value.rpartition("_")
    if separator:
        return f"{prefix}_{'0' * len(tail)}"
    return f"{value}-nobody-has-this"


def wait_snapshot_ready(api: httpx.Client, snapshot_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 120  # a guard against a hang, not a measure
    while True:
        snapshot: dict[str, Any] = api.get(f"/api/v1/snapshots/{snapshot_id}").json()
        if snapshot["state"] != "creating":
            assert snapshot["state"] == "ready", snapshot
            return snapshot
        assert time.monotonic() < deadline, f"snapshot {snapshot_id} still creating: {snapshot}"
        time.sleep(0.1)


def engine_states(stack: Any) -> dict[str, str]:
    """The engine's own state of each sandbox, by the control plane's id (the engine's `key`)."""
    with stack.engine.client() as engine:
        return {record["key"]: record["state"] for record in engine.list() if record.get("key")}


@pytest.fixture(scope="module")
def objects_of_a(stack: Any, judge: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """One real object of team A for every path parameter, and what team A sees of each."""
    tag = uuid.uuid4().hex[:8]
    with stack.client() as api:
        made: dict[str, Any] = {"tag": tag}
        sandboxes = []
        for role in ("running", "paused"):
            response = api.post(
                "/api/v1/sandboxes",
                json={"template": "base", "size": "tiny", "ttl_s": 900, "labels": {"owner": f"a-{tag}", "role": role}},
            )
            assert response.status_code == 201, response.text
            sandbox = response.json()
            written = api.put(f"/api/v1/sandboxes/{sandbox['id']}/files", params={"path": FILE}, content=CONTENT)
            assert written.status_code == 200, written.text
            sandboxes.append(sandbox["id"])
        made["running"], made["paused"] = sandboxes
        paused = api.post(f"/api/v1/sandboxes/{made['paused']}/pause")
        assert paused.status_code == 200 and paused.json()["state"] == "paused", paused.text
        snapshot = api.post(
            f"/api/v1/sandboxes/{made['running']}/snapshot", json={"name": f"a-snap-{tag}", "labels": {"owner": f"a-{tag}"}}
        )
        assert snapshot.status_code == 202, snapshot.text
        made["snapshot"] = wait_snapshot_ready(api, snapshot.json()["id"])["id"]
        launch = api.post(
            "/api/v1/launches",
            json={"template": "base", "size": "tiny", "count": 2, "ttl_s": 900, "labels": {"owner": f"a-{tag}"}},
        )
        assert launch.status_code == 201, launch.text
        made["launch"] = launch.json()["id"]
        assert wait_for_launch(api, made["launch"], {"ready", "running"})["progress"]["running"] == 2
        deadline = time.monotonic() + 60  # the row records its ready time at its chunk's end: wait for it
        while api.get(f"/api/v1/launches/{made['launch']}").json()["ready_at"] is None:
            assert time.monotonic() < deadline, "the launch never recorded its ready time"
            time.sleep(0.1)
        policy = api.post(
            "/api/v1/network-policies",
            json={"name": f"a-only-{tag}", "egress": [{"cidr": "10.0.0.0/8", "ports": [443], "protocol": "tcp"}]},
        )
        assert policy.status_code == 201, policy.text
        made["policy"] = policy.json()["id"]
        key = api.post("/api/v1/keys", json={"name": f"a-second-{tag}", "role": "admin"})
        assert key.status_code == 201, key.text
        made["key"], made["key_secret"] = key.json()["id"], key.json()["secret"]
        lease = api.post("/api/v1/leases", json={"grace_s": 3600})
        assert lease.status_code == 201, lease.text
        made["lease"] = lease.json()["id"]
        # A budget of team A's (a label's, far above anything spent): team B must neither change nor remove it.
        budget = api.post("/api/v1/budgets", json={"label": f"owner=a-{tag}", "monthly_limit": "100000", "alert_percents": []})
        assert budget.status_code == 201, budget.text
        made["budget"] = budget.json()["id"]
        # A background process of team A's (a terminal, reading its input): signalled, fed or waited
        # for by team B, it would end or change.
        process = api.post(
            f"/api/v1/sandboxes/{made['running']}/processes", json={"cmd": "cat >/dev/null", "pty": {"rows": 24, "cols": 80}}
        )
        assert process.status_code == 201, process.text
        made["pid"] = str(process.json()["pid"])
        # An exposed port of team A's (key auth): team B must neither list, close nor re-expose it.
        exposed = api.post(f"/api/v1/sandboxes/{made['running']}/ports", json={"port": 8080, "auth": "key"})
        assert exposed.status_code == 201, exposed.text
        # A team's own template, made in the database (builds are test_template_builds.py's):
        # the selectors look templates up within the team.
        made["template"] = f"a-private-{tag}"
        stack.shell(
            "from sandboxes.models import Template; "
            f"Template.objects.create(name={made['template']!r}, team_id={stack.teams[0].team_id!r}, description='team A only')"
        )
        assert api.get(f"/api/v1/templates/{made['template']}").status_code == 200
        # A dedicated endpoint of team A's (the session's judge) and a grade it made.
        made["endpoint"], made["endpoint_name"] = judge["id"], judge["name"]
        grade = api.post(
            "/api/v1/grades",
            json={
                "model": judge["name"],
                "rubric": [{"role": "user", "content": "Grade {answer}"}],
                "schema": {"type": "object", "properties": {"score": {"enum": [0, 1]}}, "required": ["score"]},
                "max_tokens": 32,
                "items": [{"values": {"answer": f"a-grade-{tag}"}}],
            },
        )
        assert grade.status_code == 200, grade.text
        made["grade"] = grade.json()["id"]
        made["values"] = {
            "sandbox_id": [made["running"], made["paused"]],
            "launch_id": [made["launch"]],
            "snapshot_id": [made["snapshot"]],
            "policy_id": [made["policy"]],
            "key_id": [made["key"]],
            "name": [made["template"]],
            "lease_id": [made["lease"]],
            "pid": [made["pid"]],
            "port": ["8080"],
            "budget_id": [made["budget"]],
            "endpoint_id": [made["endpoint"]],
            "grade_id": [made["grade"]],
        }
        # What team B must never be shown: what it could not have sent itself...
        made["private"] = [
            CONTENT.decode().strip(),
            made["key_secret"],
            f"a-{tag}",  # the labels
            f"a-snap-{tag}",
            f"a-only-{tag}",
            f"a-second-{tag}",
        ]
        # ... and, in its lists, not even the ids and names it was given here.
        # (A pid is a small number: it is no secret, and would turn up in any text.)
        made["secrets"] = made["private"] + [
            value for name, values in made["values"].items() if name not in ("pid", "port") for value in values
        ]
        yield made
        api.delete(f"/api/v1/launches/{made['launch']}")
        for sandbox_id in sandboxes:
            api.delete(f"/api/v1/sandboxes/{sandbox_id}")
        api.delete(f"/api/v1/snapshots/{made['snapshot']}")
        api.delete(f"/api/v1/network-policies/{made['policy']}")
        api.delete(f"/api/v1/keys/{made['key']}")
        api.delete(f"/api/v1/leases/{made['lease']}")
        api.delete(f"/api/v1/budgets/{made['budget']}")
        stack.shell(f"from sandboxes.models import Template; Template.objects.filter(name={made['template']!r}).delete()")


STEADY = {"elapsed_s", "rate_per_s", "last_used_at"}  # move with time or with team A's own calls


def view_of_a(api: httpx.Client, made: dict[str, Any]) -> dict[str, Any]:
    """Everything team A can see of its objects (what changes by itself left out)."""

    def get(url: str) -> dict[str, Any]:
        response = api.get(url)
        assert response.status_code == 200, f"team A lost {url}: {response.status_code} {response.text[:300]}"
        view = {name: value for name, value in response.json().items() if name not in STEADY}
        if view.get("data_path"):
            view["data_path"] = view["data_path"]["url"]  # its token is minted anew for each answer
        return view

    keys = {key["id"]: key for key in every_page(api, "/api/v1/keys")[0]}
    assert made["key"] in keys, "team A's second key is gone"
    return {
        "running": get(f"/api/v1/sandboxes/{made['running']}"),
        "paused": get(f"/api/v1/sandboxes/{made['paused']}"),
        "launch": get(f"/api/v1/launches/{made['launch']}"),
        "members": sorted(
            (sandbox["id"], sandbox["state"])
            for sandbox in api.get(f"/api/v1/launches/{made['launch']}/sandboxes").json()["sandboxes"]
        ),
        "snapshot": get(f"/api/v1/snapshots/{made['snapshot']}"),
        "policy": get(f"/api/v1/network-policies/{made['policy']}"),
        "key": {name: value for name, value in keys[made["key"]].items() if name not in STEADY},
        "template": get(f"/api/v1/templates/{made['template']}"),
        "lease": get(f"/api/v1/leases/{made['lease']}"),
        "process": get(f"/api/v1/sandboxes/{made['running']}/processes/{made['pid']}"),
        "ports": get(f"/api/v1/sandboxes/{made['running']}/ports"),
        "budget": {name: value for name, value in get(f"/api/v1/budgets/{made['budget']}").items() if name != "spent"},
        "endpoint": get(f"/api/v1/endpoints/{made['endpoint']}"),
        "grade": get(f"/api/v1/grades/{made['grade']}"),
    }


def test_every_endpoint_refuses_another_teams_objects_and_changes_nothing(stack, team_b, objects_of_a):
    made = objects_of_a
    with stack.client() as api:
        before = view_of_a(api, made)
    assert before["running"]["state"] == "running" and before["paused"]["state"] == "paused"
    assert before["launch"]["progress"]["running"] == 2 and before["snapshot"]["state"] == "ready"
    assert before["key"]["revoked_at"] is None
    assert engine_states(stack)[made["running"]] == "running"
    assert engine_states(stack)[made["paused"]] == "paused"

    tried: list[str] = []
    with stack.client(team_b) as intruder:
        for method, path, operation in document_operations(stack):
            names = re.findall(r"{(\w+)}", path)
            if not names:
                continue  # collection endpoints: the tests below
            unknown = [name for name in names if name not in made["values"]]
            assert not unknown, f"{method} {path}: a new path parameter {unknown}: give team A a real object for it here"
            if operation.get("requestBody") and (method, path) not in ATTEMPTS:
                pytest.fail(f"{method} {path} takes a body: say in ATTEMPTS what team B would send it")
            attempt = ATTEMPTS.get((method, path), {})
            for values in itertools.product(*(made["values"][name] for name in names)):
                url = real = fake = path
                for name, value in zip(names, values, strict=True):
                    real = real.replace("{" + name + "}", value)
                    fake = fake.replace("{" + name + "}", absent(value))
                answer = intruder.request(method, real, **attempt)
                control = intruder.request(method, fake, **attempt)
                expected = NOT_FOUND[names[0]]
                where = f"{method} {real}"
                assert answer.status_code == 404, f"{where}: {answer.status_code} {answer.text[:300]}"
                assert answer.json()["error"]["code"] == expected, f"{where}: {answer.text[:300]}"
                # No oracle: an object of another team answers exactly like one that does not exist.
                assert (control.status_code, control.json()["error"]["code"]) == (404, expected), f"{method} {fake}"
                assert not any(secret in answer.text for secret in made["private"]), f"{where} leaked: {answer.text}"
                tried.append(url)
    # Every path parameter's object was attacked on every endpoint that takes it.
    assert len(tried) >= 30, f"the OpenAPI document lost its endpoints? {tried}"

    with stack.client() as api:
        after = view_of_a(api, made)
        assert after == before
        for sandbox_id in (made["running"], made["paused"]):
            content = api.get(f"/api/v1/sandboxes/{sandbox_id}/files", params={"path": FILE})
            assert content.status_code == 200 and content.content == CONTENT, (sandbox_id, content.text[:200])
        snapshots = every_page(api, "/api/v1/snapshots")[0]
        assert made["snapshot"] in [snapshot["id"] for snapshot in snapshots]
        assert "stolen" not in [snapshot["name"] for snapshot in snapshots], "team B's snapshot call took one"
        ran = api.post(f"/api/v1/sandboxes/{made['running']}/exec", json={"cmd": f"cat {FILE}"})
        assert ran.status_code == 200 and ran.json()["stdout"].encode() == CONTENT, ran.text
    # The engine itself: the running sandbox was never paused, the paused one never resumed or destroyed.
    states = engine_states(stack)
    assert (states.get(made["running"]), states.get(made["paused"])) == ("running", "paused"), states
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {made['key_secret']}"}) as second:
        me = second.get("/api/v1/me")
        assert me.status_code == 200 and me.json()["key"] == made["key"], me.text


def test_collection_endpoints_never_reach_another_teams_objects(stack, team_b, objects_of_a):
    """Every endpoint without a path parameter, with team B's key: lists and usage show none of
    team A's objects, and a body or query naming one is refused as if it did not exist."""
    made = objects_of_a
    tag = made["tag"]
    handled: set[tuple[str, str]] = set()

    def refused(response: httpx.Response, code: str, field: str) -> None:
        assert response.status_code == 404, f"{response.request.method} {response.request.url}: {response.text[:300]}"
        error = response.json()["error"]
        assert error["code"] == code, error
        assert error.get("field") == field, error
        assert not any(secret in response.text for secret in made["private"]), response.text

    with stack.client(team_b) as intruder:
        before_b = {path: len(every_page(intruder, path)[0]) for path in ("/api/v1/sandboxes", "/api/v1/launches")}
        # Creates that name team A's snapshot, policy or template: refused, nothing made.
        for path in ("/api/v1/sandboxes", "/api/v1/launches"):
            extra = {"count": 1} if path.endswith("launches") else {}
            base = {"size": "tiny", "ttl_s": 60, **extra}
            refused(intruder.post(path, json={**base, "snapshot": made["snapshot"]}), "snapshot_not_found", "snapshot")
            refused(
                intruder.post(path, json={**base, "template": "base", "network_policy": made["policy"]}),
                "network_policy_not_found",
                "network_policy",
            )
            refused(intruder.post(path, json={**base, "template": made["template"]}), "template_not_found", "template")
            refused(intruder.post(path, json={**base, "template": "base", "lease": made["lease"]}), "lease_not_found", "lease")
            handled.add(("POST", path))
        # A template build from team A's template or snapshot, or under its policy: refused, nothing built.
        build = {"name": f"b-{tag}", "steps": [{"run": "true"}]}
        refused(intruder.post("/api/v1/templates", json={**build, "base": made["template"]}), "template_not_found", "base")
        refused(
            intruder.post("/api/v1/templates", json={**build, "base": f"snapshot:{made['snapshot']}"}),
            "snapshot_not_found",
            "base",
        )
        refused(
            intruder.post("/api/v1/templates", json={**build, "base": "base", "network_policy": made["policy"]}),
            "network_policy_not_found",
            "network_policy",
        )
        assert intruder.get(f"/api/v1/templates/b-{tag}").status_code == 404
        handled.add(("POST", "/api/v1/templates"))
        # A batch naming team A's sandboxes runs nothing in them: each is not found, as nobody's is.
        sandbox_ids = made["values"]["sandbox_id"]
        lines = intruder.post("/api/v1/exec", json={"cmd": f"echo pwned > {FILE}", "sandbox_ids": sandbox_ids})
        assert lines.status_code == 200, lines.text
        answered = [json.loads(line) for line in lines.text.splitlines()]
        assert [line["error"]["code"] for line in answered[:-1]] == ["sandbox_not_found"] * len(sandbox_ids), answered
        assert answered[-1]["errors"] == len(sandbox_ids) and not any(secret in lines.text for secret in made["private"])
        refused(intruder.post("/api/v1/exec", json={"cmd": "true", "launch": made["launch"]}), "launch_not_found", "launch")
        by_label = intruder.post("/api/v1/exec", json={"cmd": "true", "label": f"owner:a-{tag}"})
        assert [json.loads(line)["type"] for line in by_label.text.splitlines()] == ["summary"], by_label.text
        handled.add(("POST", "/api/v1/exec"))
        # A kill by team A's label kills none of team A's; by team A's launch, is refused as nobody's.
        killed = intruder.delete("/api/v1/sandboxes", params={"label": f"owner:a-{tag}"})
        assert killed.status_code == 200 and killed.json()["count"] == 0, killed.text
        refused(intruder.delete("/api/v1/sandboxes", params={"launch": made["launch"]}), "launch_not_found", "launch")
        handled.add(("DELETE", "/api/v1/sandboxes"))
        # An image import names no object: what team B uploads is team B's snapshot, whatever its name.
        imported = intruder.post(
            "/api/v1/snapshots/import", params={"name": f"a-{tag}", "kind": "tar"}, content=_tar_of({"etc/b": b"b\n"})
        )
        assert imported.status_code == 201 and imported.json()["id"] != made["snapshot"], imported.text
        assert intruder.delete(f"/api/v1/snapshots/{imported.json()['id']}").status_code == 200
        handled.add(("POST", "/api/v1/snapshots/import"))
        # Query parameters that name an object of team A.
        for parameter, paths in QUERY_OBJECTS.items():
            for path, name in paths.items():
                value = made["values"][name][0]
                refused(intruder.get(path, params={parameter: value}), NOT_FOUND[name], parameter)
        # Lists, filtered by team A's labels and not: none of team A's objects.
        seen = []
        for path in (
            "/api/v1/sandboxes",
            "/api/v1/launches",
            "/api/v1/snapshots",
            "/api/v1/network-policies",
            "/api/v1/keys",
            "/api/v1/templates",
            "/api/v1/leases",
        ):
            for params in ({}, {"label": f"owner=a-{tag}"}):
                if "label" in params and path not in ("/api/v1/sandboxes", "/api/v1/snapshots"):
                    continue
                rows, text = every_page(intruder, path, params)
                if params:
                    assert rows == [], f"{path} filtered by team A's label: {rows}"
                seen.append(text)
            handled.add(("GET", path))
        for group_by in ("size", "key", "day", "all", "label:owner"):
            response = intruder.get("/api/v1/usage", params={"group_by": group_by})
            assert response.status_code == 200, response.text
            assert f"a-{tag}" not in response.text
            seen.append(response.text)
        handled.add(("GET", "/api/v1/usage"))
        me = intruder.get("/api/v1/me")
        assert me.status_code == 200 and me.json()["team"] == team_b.team_id
        handled.add(("GET", "/api/v1/me"))
        # Budgets and the audit log: none of team A's; a budget naming team A's key is refused as nobody's.
        budgets = intruder.get("/api/v1/budgets")
        assert budgets.status_code == 200 and made["budget"] not in budgets.text, budgets.text
        seen.append(budgets.text)
        handled.add(("GET", "/api/v1/budgets"))
        refused(intruder.post("/api/v1/budgets", json={"api_key": made["key"], "monthly_limit": "1"}), "key_not_found", "api_key")
        handled.add(("POST", "/api/v1/budgets"))
        audit = intruder.get("/api/v1/audit", params={"limit": 1000})
        assert audit.status_code == 200, audit.text
        seen.append(audit.text)
        handled.add(("GET", "/api/v1/audit"))
        # Making its own objects works, and they are team B's: a key, and a policy named like team A's.
        key = intruder.post("/api/v1/keys", json={"name": f"b-{tag}"})
        assert key.status_code == 201, key.text
        with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key.json()['secret']}"}) as new_key:
            assert new_key.get("/api/v1/me").json()["team"] == team_b.team_id
        assert intruder.delete(f"/api/v1/keys/{key.json()['id']}").status_code == 200
        handled.add(("POST", "/api/v1/keys"))
        policy = intruder.post("/api/v1/network-policies", json={"name": f"a-only-{tag}", "egress": []})
        assert policy.status_code == 201, policy.text
        assert policy.json()["id"] != made["policy"]
        assert intruder.delete(f"/api/v1/network-policies/{policy.json()['id']}").status_code == 200
        handled.add(("POST", "/api/v1/network-policies"))
        # Inference: team A's endpoint is no model of team B's (the same answer as a model nobody serves),
        # and a grade naming it is refused whole; team A's endpoints and grades are in no list of B's.
        for model in (made["endpoint_name"], "no-such-model-anywhere"):
            called = intruder.post(
                "/api/v1/inference/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "x"}]}
            )
            assert called.status_code == 404 and called.json()["error"]["code"] == "model_not_found", called.text
        handled.add(("POST", "/api/v1/inference/chat/completions"))
        models = intruder.get("/api/v1/inference/models")
        assert models.status_code == 200 and made["endpoint_name"] not in models.text
        seen.append(models.text)
        handled.add(("GET", "/api/v1/inference/models"))
        graded = intruder.post(
            "/api/v1/grades",
            json={
                "model": made["endpoint_name"],
                "rubric": [{"role": "user", "content": "x"}],
                "schema": {"type": "object", "properties": {"score": {"type": "number"}}, "required": ["score"]},
                "items": [{}],
            },
        )
        assert graded.status_code == 404 and graded.json()["error"]["code"] == "model_not_found", graded.text
        handled.add(("POST", "/api/v1/grades"))
        refused(intruder.post("/api/v1/endpoints", json={"model": "no-such-model-anywhere"}), "model_not_found", "model")
        handled.add(("POST", "/api/v1/endpoints"))
        for path in ("/api/v1/endpoints", "/api/v1/grades"):
            rows, text = every_page(intruder, path)
            assert made["endpoint"] not in text and made["grade"] not in text, (path, rows)
            seen.append(text)
            handled.add(("GET", path))
        # The operator's catalogue of open models is every team's by design (as global templates are).
        assert intruder.get("/api/v1/endpoint-models").status_code == 200
        handled.add(("GET", "/api/v1/endpoint-models"))
        lease = intruder.post("/api/v1/leases", json={"grace_s": 60})
        assert lease.status_code == 201 and lease.json()["id"] != made["lease"], lease.text
        assert intruder.delete(f"/api/v1/leases/{lease.json()['id']}").status_code == 200
        handled.add(("POST", "/api/v1/leases"))
        after_b = {path: len(every_page(intruder, path)[0]) for path in ("/api/v1/sandboxes", "/api/v1/launches")}
    assert after_b == before_b, "a refused create made something"
    everything = " ".join(seen)
    for secret in made["secrets"]:
        assert secret not in everything, f"team B's lists show {secret!r}"
    # Global templates are everyone's by design: team B sees `base` (and must, to start anything).
    assert '"base"' in everything

    collections = {(method, path) for method, path, _ in document_operations(stack) if "{" not in path}
    assert collections <= handled, f"collection endpoints this test does not try as team B: {sorted(collections - handled)}"


def test_global_templates_are_shared_by_design(stack, team_b):
    """Not an isolation gap: a global template (no team) is visible to every team, and the
    same for both. Team-private templates are refused to others (the sweep above)."""
    with stack.client() as api, stack.client(team_b) as intruder:
        mine, theirs = api.get("/api/v1/templates/base"), intruder.get("/api/v1/templates/base")
    assert mine.status_code == theirs.status_code == 200
    assert mine.json() == theirs.json()


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
