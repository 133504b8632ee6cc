"""The console's usage pages: sandbox-seconds and cost over time, inference tokens by model, monthly
statements, budgets."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django import forms
from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from console.access import team_view
from console.audit import Actor
from console.errors import Refused
from console.models import ApiKey, Membership
from console.permissions import Action

from . import budgets, charts, selectors, statements
from .models import Budget

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
    now = timezone.now()
    tokens = selectors.token_usage(membership.team, now - charts.WINDOWS[window][0], now)
    context = {
        "window": window,
        "windows": [(name, label) for name, label in WINDOW_LABELS.items()],
        "window_label": WINDOW_LABELS[window],
        "figures": figures,
        "total": by_size.total_amount() + sum((Decimal(line["amount"]) for line in tokens), Decimal(0)),
        "size_totals": by_size.totals(),
        "key_totals": by_key.totals(),
        "month": timezone.now().strftime("%Y-%m"),
        "budgets": selectors.budget_states(membership.team),
        "tokens": tokens,
    }
    return render(request, "billing/usage.html", context)


def _statement(request: HttpRequest, membership: Membership) -> statements.Statement:
    label_keys = [key.strip() for key in request.GET.get("labels", "").split(",") if key.strip()]
    label_keys += [pair[0] for budget in selectors.budgets_of(membership.team) if (pair := budget.label_pair())]
    return statements.statement(membership.team, request.GET.get("month") or None, label_keys=label_keys)


def _months(count: int = 12) -> list[str]:
    """This month and the ones before it, for the month picker."""
    first = timezone.now().replace(day=1)
    months = []
    year, month = first.year, first.month
    for _ in range(count):
        months.append(f"{year:04d}-{month:02d}")
        year, month = (year, month - 1) if month > 1 else (year - 1, 12)
    return months


@team_view(Action.SEE_USAGE)
def statement(request: HttpRequest, membership: Membership) -> HttpResponse:
    """A month's statement as a page that prints (the browser's "Save as PDF" makes the PDF)."""
    try:
        found = _statement(request, membership)
    except Refused as error:
        messages.error(request, error.message)
        return redirect("console:statement")
    context = {"statement": found, "months": _months(), "labels": request.GET.get("labels", "")}
    return render(request, "billing/statement.html", context)


@team_view(Action.SEE_USAGE)
def statement_csv(request: HttpRequest, membership: Membership) -> HttpResponse:
    try:
        found = _statement(request, membership)
    except Refused as error:
        return HttpResponse(error.message, status=400, content_type="text/plain; charset=utf-8")
    response = HttpResponse(statements.as_csv(found), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="forkyard-{found.team.slug}-{found.month}.csv"'
    return response


# --- budgets -----------------------------------------------------------------------------------------


class BudgetForm(forms.Form):
    scope = forms.ChoiceField(label="For", choices=[("team", "The whole team"), ("key", "One API key"), ("label", "Sandboxes with a label")])
    api_key = forms.ChoiceField(label="API key", required=False, choices=[])
    label = forms.CharField(label="Label", required=False, max_length=320, help_text="key=value, e.g. project=rl")
    monthly_limit = forms.DecimalField(label="Monthly limit (USD)", min_value=Decimal(0), max_digits=12, decimal_places=2)
    alert_percents = forms.CharField(
        label="Alert at (% of the limit)", required=False, initial="50, 80", help_text="Comma-separated; 100 % is always alerted."
    )
    over_limit = forms.ChoiceField(label="When it is reached", choices=Budget.OverLimit.choices, initial=Budget.OverLimit.PAUSE)
    grace_minutes = forms.IntegerField(label="Grace before paused sandboxes are destroyed (minutes)", min_value=0, max_value=43200, initial=60)
    webhook_url = forms.URLField(assume_scheme="https", label="Webhook", required=False, max_length=500, help_text="Each alert is POSTed there as JSON.")
    notify_emails = forms.CharField(
        label="Also e-mail", required=False, max_length=1000, help_text="Besides the team's owners and admins; comma-separated."
    )

    def __init__(self, *args: Any, keys: list[ApiKey], editing: Budget | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["api_key"].choices = [("", "—")] + [(key.pk, f"{key.name} ({key.prefix}…)") for key in keys]  # type: ignore[attr-defined]
        if editing is not None:
            for name in ("scope", "api_key", "label"):
                self.fields[name].disabled = True

    def clean_alert_percents(self) -> list[int]:
        try:
            return sorted({int(part) for part in (self.cleaned_data.get("alert_percents") or "").replace("%", "").split(",") if part.strip()})
        except ValueError:
            raise forms.ValidationError("Whole percents, comma-separated: 50, 80.") from None

    def clean_notify_emails(self) -> list[str]:
        emails = [part.strip() for part in (self.cleaned_data.get("notify_emails") or "").split(",") if part.strip()]
        for email in emails:
            forms.EmailField().clean(email)
        return emails

    def fields_for_service(self) -> budgets.BudgetFields:
        data = self.cleaned_data
        return budgets.BudgetFields(
            monthly_limit=data["monthly_limit"],
            alert_percents=data["alert_percents"],
            over_limit=data["over_limit"],
            grace_s=int(data["grace_minutes"]) * 60,
            webhook_url=data.get("webhook_url") or "",
            notify_emails=tuple(data["notify_emails"]),
        )


def _initial(budget: Budget) -> dict[str, Any]:
    return {
        "scope": "key" if budget.api_key_id else "label" if budget.label else "team",
        "api_key": budget.api_key_id or "",
        "label": budget.label,
        "monthly_limit": budget.monthly_limit,
        "alert_percents": ", ".join(str(percent) for percent in budget.alert_percents),
        "over_limit": budget.over_limit,
        "grace_minutes": budget.grace_s // 60,
        "webhook_url": budget.webhook_url,
        "notify_emails": ", ".join(budget.notify_emails),
    }


@team_view(Action.SEE_USAGE)
def budget_list(request: HttpRequest, membership: Membership) -> HttpResponse:
    team = membership.team
    context = {
        "states": selectors.budget_states(team),
        "alerts": [(alert, budgets.alert_sentence(alert)) for alert in selectors.alerts_of(team)],
        "stops": selectors.stops_of(team),
        "can_manage": membership.can("admin"),
    }
    return render(request, "billing/budget_list.html", context)


def _team_keys(membership: Membership) -> list[ApiKey]:
    return list(ApiKey.objects.filter(team=membership.team, revoked_at__isnull=True).order_by("name"))


@team_view(Action.MANAGE_BUDGETS)
def budget_new(request: HttpRequest, membership: Membership) -> HttpResponse:
    keys = _team_keys(membership)
    form = BudgetForm(request.POST if request.method == "POST" else None, keys=keys)
    if form.is_valid():
        scope = form.cleaned_data["scope"]
        key = next((key for key in keys if key.pk == form.cleaned_data.get("api_key")), None) if scope == "key" else None
        if scope == "key" and key is None:
            form.add_error("api_key", "Choose the key this budget is for.")
        else:
            try:
                budgets.budget_create(
                    team=membership.team,
                    fields=form.fields_for_service(),
                    key=key,
                    label=form.cleaned_data.get("label", "") if scope == "label" else "",
                    actor=Actor.of(request),
                )
            except Refused as error:
                form.add_error(error.field if error.field in form.fields else None, error.message)
            else:
                messages.success(request, "Budget set.")
                return redirect("console:budgets")
    return render(request, "billing/budget_form.html", {"form": form, "budget": None})


@team_view(Action.MANAGE_BUDGETS)
def budget_edit(request: HttpRequest, membership: Membership, budget_id: str) -> HttpResponse:
    budget = selectors.budget_for(membership.team, budget_id)
    form = BudgetForm(request.POST if request.method == "POST" else None, keys=_team_keys(membership), editing=budget, initial=_initial(budget))
    if form.is_valid():
        try:
            budgets.budget_update(budget=budget, fields=form.fields_for_service(), actor=Actor.of(request))
        except Refused as error:
            form.add_error(error.field if error.field in form.fields else None, error.message)
        else:
            messages.success(request, f"The {budget.scope} budget is saved.")
            return redirect("console:budgets")
    return render(request, "billing/budget_form.html", {"form": form, "budget": budget})


@require_POST
@team_view(Action.MANAGE_BUDGETS)
def budget_delete_view(request: HttpRequest, membership: Membership, budget_id: str) -> HttpResponse:
    budget = selectors.budget_for(membership.team, budget_id)
    budgets.budget_delete(budget=budget, actor=Actor.of(request))
    messages.success(request, f"The {budget.scope} budget is removed.")
    return redirect("console:budgets")

