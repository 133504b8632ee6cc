"""The console in a browser: sign in, make an API key and a network policy, run a command in a sandbox."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.browser.conftest import OVERVIEW_URL, screenshot, sign_in
from tests.support.stack import Stack, Team

pytestmark = pytest.mark.root  # the stack's engine makes real sandboxes


def test_sign_in_lands_on_the_overview(page: Page, console_team: Team, artifacts: Path) -> None:
    page.goto("/login/")
    page.get_by_label("Username").fill(console_team.username)
    page.get_by_label("Password").fill("not the password")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_be_visible()
    assert "/login/" in page.url

    sign_in(page, console_team)
    assert OVERVIEW_URL.match(page.url)
    expect(page.get_by_role("heading", level=1)).to_have_text("Browser team")
    expect(page.get_by_role("navigation", name="Console").get_by_role("link", name="Board")).to_be_visible()
    screenshot(page, artifacts, "console-signed-in")


def test_an_api_key_made_in_the_console_works_once_shown(
    console: Page, stack: Stack, console_team: Team, artifacts: Path
) -> None:
    console.goto("/keys/")
    console.get_by_role("link", name="New key").click()
    console.get_by_label("Name").fill("trainer from the browser")
    console.get_by_label("Role").select_option("member")
    console.get_by_role("button", name="Create key").click()

    secret = console.locator("#new-secret").inner_text().strip()
    assert secret.startswith("fy_")
    screenshot(console, artifacts, "console-key-created")
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {secret}"}, timeout=30) as client:
        me = client.get("/api/v1/me")
        assert me.status_code == 200, me.text
        whoami = me.json()
        assert whoami["team"] == console_team.team_id
        assert (whoami["key_name"], whoami["role"]) == ("trainer from the browser", "member")

    console.get_by_role("link", name="Done").click()
    row = console.get_by_role("row").filter(has_text="trainer from the browser")
    expect(row).to_contain_text("active")
    assert secret not in console.content(), "the secret is shown once, never again"
    screenshot(console, artifacts, "console-keys")

    console.once("dialog", lambda dialog: dialog.accept())
    row.locator("summary").click()  # the key's actions: rename, rotate, revoke, delete
    row.get_by_role("button", name="Revoke").click()
    expect(console.get_by_role("row").filter(has_text="trainer from the browser")).to_contain_text("revoked")
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {secret}"}, timeout=30) as client:
        assert client.get("/api/v1/me").status_code == 401


def test_a_network_policy_made_in_the_console_is_the_apis(
    console: Page, stack: Stack, console_team: Team, artifacts: Path
) -> None:
    console.goto("/policies/")
    console.get_by_role("link", name="New policy").click()
    console.get_by_label("Name").fill("package-index")
    console.get_by_label("Description").fill("pip installs from PyPI")
    destinations = console.get_by_label("Allowed destinations")
    destinations.fill("pypi.org 443\nnot a rule at all here")
    console.get_by_role("button", name="Save").click()
    expect(console.locator(".field-error")).to_contain_text("Line 2")  # the form comes back with the line named

    console.get_by_label("Allowed destinations").fill("pypi.org 443\n10.0.0.0/8 53 udp")
    console.get_by_role("button", name="Save").click()
    console.wait_for_url("**/policies/")
    row = console.get_by_role("row").filter(has_text="package-index")
    expect(row).to_contain_text("pypi.org:443/tcp")
    expect(row).to_contain_text("10.0.0.0/8:53/udp")
    screenshot(console, artifacts, "console-policies")

    with stack.client(console_team) as api:
        listed = api.get("/api/v1/network-policies")
        assert listed.status_code == 200, listed.text
    [policy] = [policy for policy in listed.json()["network_policies"] if policy["name"] == "package-index"]
    assert policy["description"] == "pip installs from PyPI"
    assert [(rule["host"] or rule["cidr"], rule["ports"], rule["protocol"]) for rule in policy["egress"]] == [
        ("pypi.org", [443], "tcp"),
        ("10.0.0.0/8", [53], "udp"),
    ]


def test_a_command_runs_in_a_sandbox_from_its_page(console: Page, stack: Stack, console_team: Team, artifacts: Path) -> None:
    with stack.client(console_team) as api:
        created = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600})
        assert created.status_code == 201, created.text
        sandbox_id = created.json()["id"]
        try:
            console.goto("/sandboxes/")
            console.get_by_role("link", name=sandbox_id).click()
            console.wait_for_url(f"**/sandboxes/{sandbox_id}/")
            expect(console.get_by_role("heading", level=1)).to_contain_text("running")

            command_box = console.locator("#exec")  # its answers go to the top of the page's own history
            command_box.get_by_label("Command").fill("echo hello from $(hostname); echo to stderr >&2; exit 3")
            command_box.get_by_role("button", name="Run").click()
            result = command_box.locator("#exec-history .exec-result").first
            expect(result).to_be_visible()
            expect(result.locator(".exec-meta strong")).to_have_text("3")
            expect(result.locator("pre.stdout")).to_have_text(re.compile(r"^hello from \S+\s*$"))
            expect(result.locator("pre.stderr")).to_have_text("to stderr\n")
            screenshot(console, artifacts, "console-sandbox-exec")

            # A second command goes on top of the first: the page keeps its own history (nothing stored).
            command_box.get_by_label("Command").fill("echo again")
            command_box.get_by_role("button", name="Run").click()
            expect(command_box.locator("#exec-history .exec-entry")).to_have_count(2)
            expect(command_box.locator("#exec-history .exec-result").first.locator("pre.stdout")).to_have_text("again\n")
            expect(command_box.locator("#exec-history .exec-result").nth(1).locator(".exec-meta strong")).to_have_text("3")

            console.goto("/sandboxes/")
            expect(console.get_by_role("row").filter(has_text=sandbox_id)).to_contain_text("running")
            screenshot(console, artifacts, "console-sandboxes")

            console.get_by_role("link", name=sandbox_id).click()
            console.once("dialog", lambda dialog: dialog.accept())
            console.get_by_role("button", name="Kill").click()
            deadline = time.monotonic() + 60
            while api.get(f"/api/v1/sandboxes/{sandbox_id}").json()["state"] in ("running", "stopping"):
                assert time.monotonic() < deadline, "the sandbox killed from its page never ended"
                time.sleep(0.2)
            assert api.get(f"/api/v1/sandboxes/{sandbox_id}").json()["state"] == "destroyed"
        finally:
            api.delete(f"/api/v1/sandboxes/{sandbox_id}")
