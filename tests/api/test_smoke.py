"""The first request through the whole product."""

import pytest

pytestmark = pytest.mark.root


def test_create_exec_destroy(api):
    created = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 120})
    assert created.status_code == 201, created.text
    sandbox = created.json()
    assert sandbox["state"] == "running"
    result = api.post(f"/api/v1/sandboxes/{sandbox['id']}/exec", json={"cmd": "echo hello"})
    assert result.json()["stdout"] == "hello\n"
    gone = api.delete(f"/api/v1/sandboxes/{sandbox['id']}")
    assert gone.json()["state"] == "destroyed"
