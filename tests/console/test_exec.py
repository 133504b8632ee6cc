"""The command box and the kill button, against a real engine, worker and web server.

The stack tests sign in the way a browser does (the login form and its CSRF
token) and post what the page's htmx posts.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest
from django.test import Client
from django.urls import reverse

from tests.console.conftest import World
from tests.support.stack import Stack

# --- without an engine ---------------------------------------------------------------------------


@pytest.mark.django_db
def test_an_unreachable_host_is_a_message_not_an_error(member_client: Client, world: World, host, make_sandbox) -> None:
    sandbox = make_sandbox(world.key_a, host=host, state="running", engine_id="gone")
    response = member_client.post(
        reverse("console:sandbox-exec", args=[sandbox.id]), {"cmd": "true", "timeout_s": "5"}, headers={"HX-Request": "true"}
    )
    assert response.status_code == 200
    assert b"host is not answering" in response.content
    assert "no-store" in response["Cache-Control"]


# --- against the real stack --------------------------------------------------------------------------


def csrf_token(html: str) -> str:
    match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html)
    assert match, "the page carries a CSRF token"
    return match.group(1)


@pytest.fixture
def browser(stack: Stack) -> Iterator[httpx.Client]:
    """An HTTP client signed in to the console as team A's user, through the login form."""
    team = stack.teams[0]
    with httpx.Client(base_url=stack.url, timeout=60, follow_redirects=False) as client:
        page = client.get("/login/")
        assert page.status_code == 200
        signed_in = client.post(
            "/login/",
            data={
                "username": team.username,
                "password": team.password,
                "next": "/",
                "csrfmiddlewaretoken": csrf_token(page.text),
            },
        )
        assert signed_in.status_code == 302 and signed_in.headers["location"] == "/", signed_in.text[:500]
        yield client


@pytest.fixture
def running_sandbox(stack: Stack) -> Iterator[str]:
    with stack.client() as api:
        created = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 300})
        assert created.status_code in (200, 201), created.text
        sandbox_id = created.json()["id"]
        yield sandbox_id
        api.delete(f"/api/v1/sandboxes/{sandbox_id}")


def run(browser: httpx.Client, sandbox_id: str, cmd: str, timeout_s: float = 10) -> str:
    page = browser.get(f"/sandboxes/{sandbox_id}/")
    assert page.status_code == 200 and 'id="exec"' in page.text
    response = browser.post(
        f"/sandboxes/{sandbox_id}/exec/",
        data={"cmd": cmd, "timeout_s": str(timeout_s)},
        # What htmx sends: the token from hx-headers on <body>, and its own header.
        headers={"HX-Request": "true", "X-CSRFToken": browser.cookies["csrftoken"]},
    )
    assert response.status_code == 200, response.text[:500]
    assert response.text.lstrip().startswith('<section id="exec"')  # the partial htmx swaps in
    return response.text


@pytest.mark.root
def test_the_command_box_runs_a_command(browser: httpx.Client, running_sandbox: str) -> None:
    html = run(browser, running_sandbox, "echo '<b>hello</b>' && hostname && echo oops >&2; exit 3")
    assert 'exit code <strong class="bad">3</strong>' in html
    stdout = re.search(r'<pre class="stdout">(.*?)</pre>', html, re.S)
    stderr = re.search(r'<pre class="stderr">(.*?)</pre>', html, re.S)
    assert stdout and stdout.group(1).startswith("&lt;b&gt;hello&lt;/b&gt;\n")  # escaped, never markup
    assert stderr and stderr.group(1) == "oops\n"
    assert re.search(r"· [\d.]+ ms", html)
    assert "timed out" not in html


@pytest.mark.root
def test_a_command_that_runs_too_long_times_out(browser: httpx.Client, running_sandbox: str) -> None:
    started = time.monotonic()
    html = run(browser, running_sandbox, "echo started; sleep 30", timeout_s=0.5)
    assert time.monotonic() - started < 15
    assert "timed out" in html and "started" in html


@pytest.mark.root
def test_kill_from_the_page(stack: Stack, browser: httpx.Client, running_sandbox: str) -> None:
    response = browser.post(f"/sandboxes/{running_sandbox}/kill/", data={"csrfmiddlewaretoken": browser.cookies["csrftoken"]})
    assert response.status_code == 302 and response.headers["location"] == f"/sandboxes/{running_sandbox}/"
    with stack.client() as api:
        deadline = time.monotonic() + 30
        state = None
        while time.monotonic() < deadline:
            state = api.get(f"/api/v1/sandboxes/{running_sandbox}").json()["state"]
            if state == "destroyed":
                break
            time.sleep(0.1)
    assert state == "destroyed"
    page = browser.get(f"/sandboxes/{running_sandbox}/").text
    assert "is stopping" in page or "destroyed" in page
    assert 'id="exec"' not in page  # no command box for a sandbox that is gone
    refused = run_refused(browser, running_sandbox)
    assert "commands run only while it runs" in refused


def run_refused(browser: httpx.Client, sandbox_id: str) -> str:
    response = browser.post(
        f"/sandboxes/{sandbox_id}/exec/",
        data={"cmd": "true", "timeout_s": "5"},
        headers={"HX-Request": "true", "X-CSRFToken": browser.cookies["csrftoken"]},
    )
    assert response.status_code == 200
    return response.text


@pytest.mark.root
def test_the_stack_serves_the_pages_and_their_static_files(stack: Stack, browser: httpx.Client) -> None:
    for path in ("/", "/sandboxes/", "/launches/", "/usage/", "/keys/"):
        assert browser.get(path).status_code == 200, path
    for path in ("/static/console.css", "/static/vendor/htmx.min.js", "/static/vendor/plotly/plotly.min.js"):
        response = browser.get(path)
        assert response.status_code == 200 and len(response.content) > 1000, path
    assert httpx.get(f"{stack.url}/sandboxes/").status_code == 302  # and nothing without signing in


@pytest.mark.root
def test_a_long_command_does_not_hold_up_other_pages(stack: Stack, browser: httpx.Client, running_sandbox: str) -> None:
    """The command box is a sync view: under Daphne each request has its own thread."""
    import threading

    finished: list[str] = []
    worker = threading.Thread(target=lambda: finished.append(run(browser, running_sandbox, "sleep 3; echo done", timeout_s=10)))
    worker.start()
    time.sleep(0.5)  # the command is running now
    with httpx.Client(base_url=stack.url, cookies=browser.cookies, timeout=10) as other:
        started = time.monotonic()
        assert other.get("/sandboxes/").status_code == 200
        assert time.monotonic() - started < 2
    worker.join(timeout=30)
    assert finished and "done" in finished[0]
