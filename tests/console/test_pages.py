"""Every console page renders for a member of the team, and asks anyone else to sign in."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from tests.console.conftest import PASSWORD, World

pytestmark = pytest.mark.django_db

MEMBER_PAGES = ["overview", "sandboxes", "launches", "templates", "snapshots", "policies", "keys", "members", "usage"]
ADMIN_PAGES = ["policy-new", "key-new", "invite"]


@pytest.fixture
def objects(world: World, make_sandbox, make_launch, make_policy) -> dict[str, str]:
    launch = make_launch(world.key_a)
    return {
        "sandbox": make_sandbox(world.key_a, labels={"run": "7"}).id,
        "launch": launch.id,
        "policy": make_policy(world.team_a).id,
    }


def detail_urls(objects: dict[str, str]) -> list[str]:
    return [
        reverse("console:sandbox", args=[objects["sandbox"]]),
        reverse("console:launch", args=[objects["launch"]]),
    ]


def admin_detail_urls(objects: dict[str, str]) -> list[str]:
    return [
        reverse("console:policy-edit", args=[objects["policy"]]),
        reverse("console:policy-delete", args=[objects["policy"]]),
    ]


def test_every_page_renders_for_a_member(member_client: Client, objects: dict[str, str]) -> None:
    for url in [reverse(f"console:{name}") for name in MEMBER_PAGES] + detail_urls(objects):
        response = member_client.get(url)
        assert response.status_code == 200, url
        assert b"Team A" in response.content, url  # the team is named in the top bar


def test_admin_pages_render_for_an_admin(admin_client: Client, objects: dict[str, str]) -> None:
    for url in [reverse(f"console:{name}") for name in ADMIN_PAGES] + admin_detail_urls(objects):
        assert admin_client.get(url).status_code == 200, url


def test_anonymous_visitors_are_sent_to_sign_in(client: Client, objects: dict[str, str]) -> None:
    urls = [reverse(f"console:{name}") for name in MEMBER_PAGES + ADMIN_PAGES]
    urls += detail_urls(objects) + admin_detail_urls(objects)
    for url in urls:
        response = client.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith(f"/login/?next={url}"), url
    posts = [
        reverse("console:sandbox-exec", args=[objects["sandbox"]]),
        reverse("console:sandbox-kill", args=[objects["sandbox"]]),
        reverse("console:switch-team"),
    ]
    for url in posts:
        assert client.post(url).status_code == 302, url


def test_the_login_form_signs_in_and_out(client: Client, world: World) -> None:
    page = client.get("/login/")
    assert page.status_code == 200 and b'name="username"' in page.content
    wrong = client.post("/login/", {"username": "mel", "password": "nope"})
    assert wrong.status_code == 200 and b"errorlist" in wrong.content
    right = client.post("/login/", {"username": "mel", "password": PASSWORD, "next": "/sandboxes/"})
    assert right.status_code == 302 and right["Location"] == "/sandboxes/"
    assert client.get("/sandboxes/").status_code == 200
    assert client.post("/logout/").status_code == 302
    assert client.get("/sandboxes/").status_code == 302


def test_a_user_without_a_team_is_told_so(client: Client, db: None) -> None:
    from django.contrib.auth.models import User

    client.force_login(User.objects.create_user("loner", password=PASSWORD))
    response = client.get("/")
    assert response.status_code == 403
    assert b"not in a team" in response.content


def test_the_navigation_links_every_section(member_client: Client, world: World) -> None:
    content = member_client.get("/").content.decode()
    for name in MEMBER_PAGES:
        assert f'href="{reverse(f"console:{name}")}"' in content, name


def test_static_files_are_found_by_the_static_machinery() -> None:
    from django.contrib.staticfiles import finders

    assert finders.find("vendor/plotly/plotly.min.js"), "plotly's own copy, served locally"
    assert finders.find("vendor/htmx.min.js")
    assert finders.find("console.css") and finders.find("console.js")
