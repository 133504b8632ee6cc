"""Every list pages the same way: `limit` and `cursor`, answered as `{"<items>": [...], "next_cursor": ...}`."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.root


def every_page(api: httpx.Client, url: str, items: str, limit: int, **params: Any) -> list[list[dict[str, Any]]]:
    pages, cursor = [], None
    while True:
        answer = api.get(url, params={**params, "limit": limit, **({"cursor": cursor} if cursor else {})})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert set(body) == {items, "next_cursor"}, body.keys()
        pages.append(body[items])
        cursor = body["next_cursor"]
        if cursor is None:
            return pages
        assert len(pages) < 50, "the cursor never ends"


def _check(pages: list[list[dict[str, Any]]], made: set[str], limit: int, key: str = "id") -> None:
    seen = [row[key] for page in pages for row in page]
    assert len(seen) == len(set(seen)), "a row on two pages"
    assert made <= set(seen)
    assert all(len(page) <= limit for page in pages) and all(len(page) == limit for page in pages[:-1])


@pytest.fixture(scope="module")
def fresh(stack: Any) -> Any:
    """A team of its own: its lists hold only what these tests make."""
    with stack.client(stack.new_team("Paging")) as client:
        yield client


def test_policies_keys_and_launches_page_one_way(fresh: httpx.Client) -> None:
    api = fresh
    tag = uuid.uuid4().hex[:6]
    policies = {api.post("/api/v1/network-policies", json={"name": f"p-{tag}-{i}", "egress": []}).json()["id"] for i in range(5)}
    _check(every_page(api, "/api/v1/network-policies", "network_policies", 2), policies, 2)
    keys = {api.post("/api/v1/keys", json={"name": f"k-{tag}-{i}"}).json()["id"] for i in range(5)}
    _check(every_page(api, "/api/v1/keys", "keys", 2), keys, 2)
    launches = {
        api.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": 1, "ttl_s": 60}).json()["id"]
        for _ in range(5)
    }
    pages = every_page(api, "/api/v1/launches", "launches", 2)
    _check(pages, launches, 2)
    newest_first = [row["created_at"] for page in pages for row in page]
    assert newest_first == sorted(newest_first, reverse=True)
    # The older way to page launches still works for a release.
    first = pages[0]
    older = api.get("/api/v1/launches", params={"limit": 2, "before": first[-1]["id"]}).json()["launches"]
    assert [row["id"] for row in older] == [row["id"] for row in pages[1]]
    for launch in launches:
        api.delete(f"/api/v1/launches/{launch}")
    for policy in policies:
        api.delete(f"/api/v1/network-policies/{policy}")
    for key in keys:
        api.delete(f"/api/v1/keys/{key}")


def test_templates_and_a_launchs_members_page_one_way(api: httpx.Client) -> None:
    templates = every_page(api, "/api/v1/templates", "templates", 1)
    assert "base" in [row["name"] for page in templates for row in page]
    launch = api.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": 7, "ttl_s": 120}).json()
    deadline = time.monotonic() + 60
    while api.get(f"/api/v1/launches/{launch['id']}").json()["progress"]["queued"] and time.monotonic() < deadline:
        time.sleep(0.2)
    pages = every_page(api, f"/api/v1/launches/{launch['id']}/sandboxes", "sandboxes", 3)
    members = [row for page in pages for row in page]
    assert [len(page) for page in pages] == [3, 3, 1] and len({row["id"] for row in members}) == 7
    api.delete(f"/api/v1/launches/{launch['id']}")


@pytest.mark.parametrize(
    "url",
    [
        "/api/v1/sandboxes",
        "/api/v1/launches",
        "/api/v1/snapshots",
        "/api/v1/templates",
        "/api/v1/network-policies",
        "/api/v1/keys",
    ],
)
def test_a_cursor_the_api_did_not_give_is_refused(api: httpx.Client, url: str) -> None:
    for cursor in ("junk", "WyJ4Il0", "x" * 600):
        answer = api.get(url, params={"cursor": cursor})
        assert answer.status_code == 400, (cursor, answer.text)
        assert answer.json()["error"] == {
            "code": "invalid_request",
            "message": "cursor is not one this API gave out",
            "field": "cursor",
        }
