"""The usage page and the overview's spend: plotly figures built on the server."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from decimal import Decimal

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from tests.console.conftest import World, usage_period

pytestmark = pytest.mark.django_db


def figures(html: str) -> dict[str, dict]:
    found = re.findall(r'<script id="([\w-]+)-data" type="application/json">(.*?)</script>', html, re.S)
    return {name: json.loads(body) for name, body in found}


def test_the_usage_page_carries_plotly_figures(member_client: Client, world: World) -> None:
    now = timezone.now()
    usage_period(world, now - timedelta(hours=5), now - timedelta(hours=4))
    html = member_client.get(reverse("console:usage")).content.decode()
    # Linked by their content's hash (kept a year by browsers: console/staticfiles.py).
    assert re.search(r"/static/vendor/plotly/plotly\.min\.[0-9a-f]{12}\.js", html) and re.search(r"/static/console\.[0-9a-f]{12}\.js", html)
    charts = figures(html)
    assert set(charts) == {"seconds-by-size", "cost-by-size", "seconds-by-key", "cost-by-key"}
    seconds = charts["seconds-by-size"]
    assert seconds["data"][0]["type"] == "bar" and seconds["data"][0]["name"] == "tiny"
    assert len(seconds["data"][0]["x"]) == 24 and sum(seconds["data"][0]["y"]) == 3600
    assert charts["cost-by-key"]["data"][0]["name"] == "trainer"
    assert 'data-figure="seconds-by-size-data"' in html
    week = figures(member_client.get(reverse("console:usage"), {"window": "7d"}).content.decode())
    assert len(week["seconds-by-size"]["data"][0]["x"]) == 7
    assert member_client.get(reverse("console:usage"), {"window": "<script>"}).status_code == 200  # falls back to 24h


def test_the_overview_shows_spend_today(member_client: Client, world: World) -> None:
    now = timezone.now()
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if now - midnight < timedelta(minutes=2):
        pytest.skip("too close to midnight to tell today from yesterday")
    usage_period(world, midnight - timedelta(hours=1), midnight + timedelta(seconds=60), price=Decimal("36"))  # $0.60 today
    html = member_client.get(reverse("console:overview")).content.decode()
    assert re.search(r'Spend today</div><div class="value">\$0\.60</div>', html)
    assert "overview-seconds-data" in html


def test_the_usage_page_shows_inference_tokens_by_model(member_client: Client, world: World) -> None:
    from billing.services import install_default_prices, metered_record, tokens_metered

    install_default_prices()  # the rate card: a price per million tokens for every model
    records = tokens_metered(
        team_id=world.team_a.id, api_key_id=None, model="judge-x", input_tokens=1200, output_tokens=340, billed=True, at=timezone.now()
    )
    metered_record(records)
    html = member_client.get(reverse("console:usage")).content.decode()
    row = re.search(r"<tr><td>judge-x</td><td class=\"num\">1200</td><td class=\"num\">340</td>", html)
    assert row is not None, html[html.find("Inference tokens") :][:600]
    assert sum(record.amount for record in records) > Decimal(0)
