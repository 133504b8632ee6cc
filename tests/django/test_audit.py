"""The audit log of launches (started, torn down: once), and the permission table itself."""

from __future__ import annotations

import json
from typing import Any

import pytest

from console.audit import Actor
from console.management.commands.forkyard_openapi import current_document
from console.models import AuditEntry
from console.permissions import ROUTES, RULES, route_action
from console.routing import api_websocket_urlpatterns
from sandboxes.schemas import SandboxCreate
from sandboxes.services.launches import launch_create, launch_destroy
from sandboxes.services.sandboxes import sandboxes_destroy

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_launch_started_and_torn_down_is_audited_once(cluster: Any, sent: Any, key: Any) -> None:
    cluster.add_host("h1")
    spec = SandboxCreate.model_validate({"template": "base", "size": "tiny", "ttl_s": 60})
    launch, _ = launch_create(team=key.team, key=key, spec=spec, count=3, actor=Actor(key=key, address="198.18.0.9"))
    launch_destroy(launch=launch, actor=Actor(key=key))
    sandboxes_destroy(team=key.team, launch=launch.pk, actor=Actor(key=key))  # again: nothing more to record
    entries = list(AuditEntry.objects.filter(team=key.team, target_id=launch.pk).order_by("at", "id"))
    assert [entry.action for entry in entries] == ["launch.started", "launch.torn_down"]
    assert entries[0].actor == f"key trainer ({key.pk})" and entries[0].address == "198.18.0.9"
    assert entries[0].details["count"] == 3


def test_the_permission_table_names_every_operation_once_and_nothing_else() -> None:
    document = json.loads(current_document())
    operations = {(method.upper(), path) for path, methods in document["paths"].items() for method in methods}
    sockets = {("GET", "/" + str(pattern.pattern).replace("<str:", "{").replace("<int:", "{").replace(">", "}")) for pattern in api_websocket_urlpatterns}
    named = [(method, f"/api/v1{template}") for method, template, _ in ROUTES]
    assert len(named) == len(set(named)), "an operation named twice"
    assert set(named) == operations | sockets, (sorted(operations | sockets - set(named)), sorted(set(named) - operations - sockets))
    assert all(action in RULES for _, _, action in ROUTES)
    assert route_action("POST", "/api/v1/sandboxes/sb_1/exec") is not None
    assert route_action("GET", "/api/v1/sandboxes/sb_1/files/list")[0].name == "SEE_SANDBOXES"
    assert route_action("GET", "/api/v1/nothing-here") is None
