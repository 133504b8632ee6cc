"""The console's usage page: sandbox-seconds and cost over time, by size and by key."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from console.access import team_view
from console.models import Membership

from . import charts

WINDOW_LABELS = {"24h": "last 24 hours, by hour", "7d": "last 7 days, by day"}


@team_view()
def usage(request: HttpRequest, membership: Membership) -> HttpResponse:
    window = request.GET.get("window", "24h")
    if window not in charts.WINDOWS:
        window = "24h"
    series = charts.window_series_by(membership.team, window, ("size", "key"))
    by_size, by_key = series["size"], series["key"]
    figures = [
        ("seconds-by-size", charts.seconds_figure(by_size, "Sandbox-seconds by size")),
        ("cost-by-size", charts.cost_figure(by_size, "Cost by size (USD)")),
        ("seconds-by-key", charts.seconds_figure(by_key, "Sandbox-seconds by API key")),
        ("cost-by-key", charts.cost_figure(by_key, "Cost by API key (USD)")),
    ]
    context = {
        "window": window,
        "windows": [(name, label) for name, label in WINDOW_LABELS.items()],
        "window_label": WINDOW_LABELS[window],
        "figures": figures,
        "total": by_size.total_amount(),
        "size_totals": by_size.totals(),
        "key_totals": by_key.totals(),
    }
    return render(request, "billing/usage.html", context)
