"""Team admin through the API: budgets refuse at admission (402), statements export, keys are renamed,
rotated and deleted, and every one of those changes is in the audit log, which only admins read."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def admin_team(stack: Any) -> Any:
    return stack.new_team("Admin Co")


def test_a_budget_refuses_a_create_that_would_pass_it_with_402(stack: Any, admin_team: Any) -> None:
    with stack.client(admin_team) as api:
        budget = api.post("/api/v1/budgets", json={"monthly_limit": "0.00", "alert_percents": [50], "over_limit": "destroy"})
        assert budget.status_code == 201, budget.text
        assert (budget.json()["scope"], budget.json()["reached"]) == ("team", True)
        for path, extra in (("/api/v1/sandboxes", {}), ("/api/v1/launches", {"count": 3})):
            refused = api.post(path, json={"template": "base", "size": "tiny", "ttl_s": 600, **extra})
            assert refused.status_code == 402, refused.text
            error = refused.json()["error"]
            assert error["code"] == "team_budget_exceeded" and error["details"]["budget"] == budget.json()["id"]
            assert Decimal(error["details"]["cost"]) > 0
        assert api.get("/api/v1/sandboxes").json()["sandboxes"] == [], "nothing recorded"
        raised = api.put(f"/api/v1/budgets/{budget.json()['id']}", json={"monthly_limit": "5.00", "alert_percents": [50, 80]})
        assert raised.status_code == 200 and raised.json()["monthly_limit"] == "5.00"
        made = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600})
        assert made.status_code == 201, made.text
        api.delete(f"/api/v1/sandboxes/{made.json()['id']}")
        duplicate = api.post("/api/v1/budgets", json={"monthly_limit": "1.00"})
        assert duplicate.status_code == 409 and duplicate.json()["error"]["code"] == "budget_exists"
        assert api.delete(f"/api/v1/budgets/{budget.json()['id']}").json()["deleted"] is True


def test_the_usage_api_exports_the_months_statement(stack: Any, admin_team: Any) -> None:
    month = datetime.now(UTC).strftime("%Y-%m")
    with stack.client(admin_team) as api:
        made = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600, "labels": {"project": "rl"}})
        assert made.status_code == 201, made.text
        api.delete(f"/api/v1/sandboxes/{made.json()['id']}")
        answer = api.get("/api/v1/usage", params={"month": month, "label_keys": "project"})
        assert answer.status_code == 200, answer.text
        statement = answer.json()["statement"]
        assert statement["month"] == month and statement["currency"] == "USD"
        total = Decimal(statement["total"])
        assert total > 0 and total == sum(Decimal(line["amount"]) for line in statement["lines"])
        assert {line["kind"] for line in statement["lines"]} >= {"running"}
        assert sum(Decimal(row["amount"]) for row in statement["by_label"]["project"]) == total
        exported = api.get("/api/v1/usage", params={"month": month, "format": "csv"})
        assert exported.status_code == 200 and exported.headers["content-type"].startswith("text/csv")
        rows = list(csv.reader(io.StringIO(exported.text)))
        [last] = [row for row in rows if row[0] == "total"]
        assert Decimal(last[6]) >= total  # the same statement, a moment later
        bad = api.get("/api/v1/usage", params={"month": "2026-13"})
        assert bad.status_code == 400 and bad.json()["error"]["field"] == "month"


def test_keys_are_renamed_rotated_and_deleted_and_the_audit_log_says_so(stack: Any, admin_team: Any) -> None:
    with stack.client(admin_team) as api:
        made = api.post("/api/v1/keys", json={"name": "to-rotate", "role": "member"}).json()
        old = made["secret"]
        renamed = api.patch(f"/api/v1/keys/{made['id']}", json={"name": "rotated"})
        assert renamed.status_code == 200 and renamed.json()["name"] == "rotated"
        rotated = api.post(f"/api/v1/keys/{made['id']}/rotate")
        assert rotated.status_code == 200 and rotated.json()["id"] == made["id"] and rotated.json()["secret"] != old
        with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {old}"}) as stale:
            assert stale.get("/api/v1/me").status_code == 401, "the old secret stops working"
        with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {rotated.json()['secret']}"}) as fresh:
            me = fresh.get("/api/v1/me")
            assert me.status_code == 200 and me.json()["key_name"] == "rotated"
            refused = fresh.get("/api/v1/audit")  # a member key: the audit log is for admins
            assert refused.status_code == 403 and refused.json()["error"]["details"]["needs"] == "admin"
        deleted = api.delete(f"/api/v1/keys/{made['id']}", params={"delete": "true"})
        assert deleted.status_code == 200
        assert made["id"] not in {key["id"] for key in api.get("/api/v1/keys").json()["keys"]}
        log = api.get("/api/v1/audit", params={"target": made["id"]}).json()["entries"]
        assert [entry["action"] for entry in log] == ["key.deleted", "key.rotated", "key.renamed", "key.created"]
        assert all(entry["actor"].startswith("key demo") and entry["address"] == "127.0.0.1" for entry in log), log
        assert log[2]["details"] == {"from": "to-rotate", "to": "rotated"}
        family = api.get("/api/v1/audit", params={"action": "key"}).json()["entries"]
        assert {entry["action"] for entry in family} <= {"key.created", "key.renamed", "key.rotated", "key.revoked", "key.deleted"}
        budgets = api.get("/api/v1/audit", params={"action": "budget"}).json()["entries"]
        assert {"budget.created", "budget.changed", "budget.deleted"} <= {entry["action"] for entry in budgets}
