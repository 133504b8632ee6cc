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
from tests.support.netns import Server, allow, server
from tests.support.stack import Stack

__all__ = ["server"]  # a fixture

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
    # The partial htmx adds to the page's own history (newest first), and the form as it was, out of band.
    assert response.text.lstrip().startswith('<li class="exec-entry">') and 'id="exec-form"' in response.text
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
def test_a_command_that_runs_too_long_times_out(stack: Stack, browser: httpx.Client, running_sandbox: str) -> None:
    """Stopped at its timeout, as the engine reports it: the page says timed out, with the duration
    the engine measured (half a second, not the 30 s the command asked for), and nothing of it runs on."""
    html = run(browser, running_sandbox, "echo started; exec sleep 30", timeout_s=0.5)
    assert "timed out" in html and "started" in html
    shown = re.search(r"· ([\d.]+) ms", html)
    assert shown, html
    assert 500 <= float(shown.group(1)) < 30_000, f"the engine reports {shown.group(1)} ms for a 0.5 s timeout"
    with stack.client() as api:
        processes = api.post(
            f"/api/v1/sandboxes/{running_sandbox}/exec", json={"cmd": "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"}
        ).json()
    assert processes["exit_code"] == 0 and "sleep 30" not in processes["stdout"], processes


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
    """The command box is a sync view, run in a thread of its own: while one command runs, other
    pages answer. The command waits for a file that the test writes only after another page has
    answered; had that page waited for the command, the command would report it was never released."""
    import threading

    command = (
        "touch /tmp/started; i=0; while [ ! -e /tmp/go ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; "
        "if [ -e /tmp/go ]; then echo released; else echo never released; fi"
    )
    finished: list[str] = []
    worker = threading.Thread(target=lambda: finished.append(run(browser, running_sandbox, command, timeout_s=60)))
    worker.start()
    with stack.client() as api:
        deadline = time.monotonic() + 30  # a guard against a hang, not a measure
        while api.get(f"/api/v1/sandboxes/{running_sandbox}/files", params={"path": "/tmp/started"}).status_code != 200:
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.05)
        with httpx.Client(base_url=stack.url, cookies=browser.cookies, timeout=60) as other:
            assert other.get("/sandboxes/").status_code == 200
            assert not finished, "the page answered only once the command had finished"
        assert api.put(f"/api/v1/sandboxes/{running_sandbox}/files", params={"path": "/tmp/go"}, content=b"").status_code == 200
    worker.join(timeout=90)
    assert finished and '<pre class="stdout">released\n</pre>' in finished[0], finished  # the form echoes the command


@pytest.mark.root
def test_the_page_shows_what_its_network_policy_refused(stack: Stack, browser: httpx.Client, server: Server) -> None:
    with stack.client() as api:
        policy = api.post("/api/v1/network-policies", json={"name": f"page-{server.address}", **allow(server, 8080)})
        assert policy.status_code == 201, policy.text
        sandbox_id = api.post(
            "/api/v1/sandboxes",
            json={"template": "base", "size": "tiny", "ttl_s": 300, "network_policy": policy.json()["id"]},
        ).json()["id"]
        try:
            refused = api.post(f"/api/v1/sandboxes/{sandbox_id}/exec", json={"cmd": f"echo x | nc -w 3 {server.address} 8081"})
            assert refused.json()["exit_code"] != 0
            page = browser.get(f"/sandboxes/{sandbox_id}/")
            assert page.status_code == 200 and 'id="denied"' in page.text
            assert f"<td><code>{server.address}</code></td><td>tcp 8081</td>" in page.text
            assert re.search(r"<dd>[\d.]+\W\w+ out, [\d.]+\W\w+ in; [1-9][\d,]* packets refused", page.text)
            # A name its resolver refused shows by name (it never had an address).
            asked = api.post(f"/api/v1/sandboxes/{sandbox_id}/exec", json={"cmd": "echo x | nc -w 3 refused.example 80"})
            assert asked.json()["exit_code"] != 0
            page = browser.get(f"/sandboxes/{sandbox_id}/")
            assert "<td><code>refused.example</code></td><td>dns 53</td>" in page.text
        finally:
            api.delete(f"/api/v1/sandboxes/{sandbox_id}")


@pytest.mark.root
def test_the_page_shows_the_kernels_metrics_and_why_it_ended(stack: Stack, browser: httpx.Client) -> None:
    with stack.client() as api:
        sandbox_id = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 300}).json()["id"]
        api.post(f"/api/v1/sandboxes/{sandbox_id}/exec", json={"cmd": "sleep 300 >/dev/null 2>&1 &"})
        metrics = api.get(f"/api/v1/sandboxes/{sandbox_id}/metrics").json()
        page = browser.get(f"/sandboxes/{sandbox_id}/")
        assert page.status_code == 200 and 'id="metrics"' in page.text
        assert f"{metrics['pids']} of 256" in page.text  # the tiny size's pids limit
        assert "Idle timeout</dt><dd>none" in page.text
        api.patch(f"/api/v1/sandboxes/{sandbox_id}", json={"ttl_s": 1})
        deadline = time.monotonic() + 60  # a guard against a hang, not a measure
        while api.get(f"/api/v1/sandboxes/{sandbox_id}").json()["state"] != "destroyed" and time.monotonic() < deadline:
            time.sleep(0.2)
    page = browser.get(f"/sandboxes/{sandbox_id}/")
    assert 'id="metrics"' not in page.text
    assert "Ended by</dt><dd><code>ttl_expired</code>" in page.text
