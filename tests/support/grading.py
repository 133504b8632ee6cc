"""Grading's test support: the tiny model offered to teams, a dedicated endpoint of it, operators' upstreams."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support.stack import Stack
from tests.support.tiny_model import write_tiny_model

TINY = "tiny-random"  # the model as the operator's catalogue names it


def offer_tiny_model(stack: Stack, directory: Path) -> Path:
    """Write the tiny model and offer it for dedicated endpoints, as an operator would (the Django admin's row)."""
    path = write_tiny_model(directory / "tiny.gguf")
    directory.chmod(0o755)
    stack.shell(
        "from grading.models import ServedModel; "
        f"ServedModel.objects.update_or_create(name={TINY!r}, defaults={{'path': {str(path)!r}, 'context_length': 1024, 'threads': 1}})"
    )
    return path


def wait_endpoint(client: httpx.Client, endpoint_id: str, states: tuple[str, ...] = ("ready",), timeout_s: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s  # a guard against a hang, not a measure
    while True:
        endpoint: dict[str, Any] = client.get(f"/api/v1/endpoints/{endpoint_id}").json()
        if endpoint["state"] in states:
            return endpoint
        assert endpoint["state"] not in ("failed", "deleted") or endpoint["state"] in states, endpoint
        assert time.monotonic() < deadline, f"endpoint {endpoint_id} stuck: {endpoint}"
        time.sleep(0.2)


def deploy(client: httpx.Client, name: str) -> dict[str, Any]:
    created = client.post("/api/v1/endpoints", json={"model": TINY, "name": name})
    assert created.status_code == 201, created.text
    return wait_endpoint(client, created.json()["id"])


def add_upstream(stack: Stack, name: str, base_url: str, secret: str, serves: list[str], **options: Any) -> str:
    """An operator's upstream (the admin's row); its id."""
    values = {"base_url": base_url, "secret": secret, "serves": serves, **options}
    return stack.shell(
        "import json; from grading.models import Upstream; "
        f"row, _ = Upstream.objects.update_or_create(name={name!r}, defaults=json.loads({json.dumps(values)!r})); print(row.id)"
    ).strip().splitlines()[-1]


def remove_upstream(stack: Stack, name: str) -> None:
    stack.shell(f"from grading.models import Upstream; Upstream.objects.filter(name={name!r}).delete()")


def set_inference(stack: Stack, team_id: str, **values: Any) -> None:
    stack.shell(
        "import json; from grading.models import TeamInference; "
        f"TeamInference.objects.update_or_create(team_id={team_id!r}, defaults=json.loads({json.dumps(values)!r}))"
    )


def judge_schema() -> dict[str, Any]:
    """A schema the tiny model can always finish within a few dozen tokens (bounded strings, an enum)."""
    return {
        "type": "object",
        "properties": {"score": {"type": "integer", "enum": [0, 1, 2, 3]}, "why": {"type": "string", "maxLength": 6}},
        "required": ["score", "why"],
        "additionalProperties": False,
    }
