"""Static files (the stylesheet, htmx, plotly's own copy) are served in both modes:
from the sources when nobody ran collectstatic, from STATIC_ROOT when someone did."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client

ASSETS = {
    "/static/console.css": "text/css",
    "/static/console.js": "text/javascript",
    "/static/vendor/htmx.min.js": "text/javascript",
    "/static/vendor/plotly/plotly.min.js": "text/javascript",
}


def fetch_all() -> dict[str, Any]:
    client = Client()  # a new client builds its middleware, WhiteNoise included, from the settings now
    return {path: client.get(path) for path in ASSETS}


def test_served_from_the_sources_before_collectstatic(settings: Any, tmp_path: Path) -> None:
    settings.STATIC_ROOT = tmp_path / "never-collected"
    settings.WHITENOISE_USE_FINDERS = True
    for path, response in fetch_all().items():
        assert response.status_code == 200, path
        assert response["Content-Type"].startswith(ASSETS[path]), path


def test_served_compressed_from_static_root_after_collectstatic(settings: Any, tmp_path: Path) -> None:
    settings.STATIC_ROOT = tmp_path / "static"
    settings.WHITENOISE_USE_FINDERS = False
    call_command("collectstatic", interactive=False, verbosity=0)
    assert (tmp_path / "static" / "vendor" / "plotly" / "plotly.min.js.gz").exists()
    client = Client()
    for path, content_type in ASSETS.items():
        response = client.get(path, headers={"Accept-Encoding": "gzip"})
        assert response.status_code == 200, path
        assert response["Content-Type"].startswith(content_type), path
        assert response.get("Content-Encoding") == "gzip", path


@pytest.mark.parametrize("path", ["/static/vendor/plotly/nope.js", "/static/../console/settings.py"])
def test_nothing_else_is_served(settings: Any, tmp_path: Path, path: str) -> None:
    settings.STATIC_ROOT = tmp_path / "never-collected"
    settings.WHITENOISE_USE_FINDERS = True
    assert Client().get(path).status_code == 404


@pytest.mark.parametrize("collected", [False, True], ids=["from-sources", "collected"])
def test_pages_link_fingerprinted_assets_kept_a_year(settings: Any, tmp_path: Path, collected: bool, member_client: Client) -> None:
    """Every page names its assets by their content's hash, and those URLs are cached a year (immutable);
    a changed file would get a new name. The same in both modes."""
    settings.STATIC_ROOT = tmp_path / "static"
    settings.WHITENOISE_USE_FINDERS = not collected
    if collected:
        call_command("collectstatic", interactive=False, verbosity=0)
    page = member_client.get("/usage/").content.decode()
    linked = re.findall(r'(?:src|href)="(/static/[^"]+)"', page)
    plotly = [url for url in linked if "plotly" in url]
    assert plotly and re.fullmatch(r"/static/vendor/plotly/plotly\.min\.[0-9a-f]{12}\.js", plotly[0]), linked
    assert any(re.fullmatch(r"/static/console\.[0-9a-f]{12}\.css", url) for url in linked), linked
    client = Client()
    for url in linked:
        response = client.get(url)
        assert response.status_code == 200, url
        assert response["Cache-Control"] == "max-age=31536000, public, immutable", (url, response["Cache-Control"])
    plain = client.get("/static/console.css")
    assert plain.status_code == 200 and "immutable" not in plain["Cache-Control"]  # a name that may change is not kept
