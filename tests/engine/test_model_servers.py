"""The engine's model servers (dedicated endpoints' host processes): checked specs, a real llama.cpp server
that answers with its token only, adopted by a restarted engine, and gone when removed."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest

from sandboxes.engine.errors import InvalidRequest
from tests.support.engine import EngineProcess
from tests.support.tiny_model import write_tiny_model

pytestmark = pytest.mark.root
TOKEN = "model-server-token-" + "x" * 16


def _wait(engine: EngineProcess, server_id: str, state: str, timeout_s: float = 90) -> dict:
    deadline = time.monotonic() + timeout_s  # a guard against a hang, not a measure
    while True:
        with engine.client() as client:
            servers = {server["id"]: server for server in client.call("model_servers.list")["servers"]}
        if servers.get(server_id, {}).get("state") == state:
            return servers[server_id]
        assert time.monotonic() < deadline, servers
        time.sleep(0.2)


def test_a_model_server_is_checked_served_adopted_and_removed(work_dir: Path) -> None:
    model = write_tiny_model(work_dir / "ms-models" / "tiny.gguf")
    (work_dir / "ms-models").chmod(0o755)
    engine = EngineProcess(work_dir / "ms-engine")
    engine.start()
    try:
        spec = {"id": "ep_test", "kind": "llama_cpp", "model": str(model), "name": "tiny", "token": TOKEN, "context_length": 512, "threads": 1}
        with engine.client() as client:
            for bad, field in ((dict(spec, kind="shell"), "kind"), (dict(spec, model="/no/such/file"), "model"), (dict(spec, token="short"), "token")):
                with pytest.raises(InvalidRequest) as refused:
                    client.call("model_servers.ensure", **bad)
                assert refused.value.details.get("field") == field
            client.call("model_servers.ensure", **spec)
        server = _wait(engine, "ep_test", "ready")
        assert json.loads(Path(engine.config.state_dir / "model-servers.json").read_text())["servers"][0]["id"] == "ep_test"
        assert oct(os.stat(engine.config.state_dir / "model-servers.json").st_mode & 0o777) == "0o600"
        base = server["address"]
        assert httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}).status_code == 401
        answer = httpx.post(
            f"{base}/v1/chat/completions",
            headers={"Authorization": f"Bearer {TOKEN}"},
            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3},
        ).json()
        assert answer["usage"]["completion_tokens"] <= 3 and answer["model"] == "tiny"
        # The engine killed outright and started again: the running server is adopted, not started twice.
        engine.kill()
        assert os.kill(server["pid"], 0) is None, "the server outlives the engine"
        engine.start()
        adopted = _wait(engine, "ep_test", "ready")
        assert adopted["pid"] == server["pid"] and adopted["restarts"] == 0
        with engine.client() as client:
            assert client.call("model_servers.remove", id="ep_test")["removed"] is True
            assert client.call("model_servers.list")["servers"] == []
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{server['pid']}") and "Z" not in Path(f"/proc/{server['pid']}/stat").read_text().split(") ")[1][:1]:
            assert time.monotonic() < deadline, "the server is still running"
            time.sleep(0.1)
    finally:
        if engine.running():
            with engine.client() as client:
                client.call("model_servers.remove", id="ep_test")
        engine.reclaim()
