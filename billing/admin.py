from django.contrib import admin

from .models import Budget, BudgetAlert, BudgetStop, MeteredUsage, Price, UsagePeriod


@admin.register(Price)
class PriceAdmin(admin.ModelAdmin[Price]):
    """Sizes and prices are data: an operator edits them here."""

    list_display = ("kind", "size", "model", "cpu", "memory_mib", "amount", "currency")


@admin.register(UsagePeriod)
class UsagePeriodAdmin(admin.ModelAdmin[UsagePeriod]):
    list_display = ("team", "sandbox", "kind", "size", "started_at", "ended_at", "duration_ms", "amount", "reason")
    list_filter = ("kind",)


@admin.register(MeteredUsage)
class MeteredUsageAdmin(admin.ModelAdmin[MeteredUsage]):
    list_display = ("team", "kind", "item", "quantity", "unit_price", "amount", "at")
    list_filter = ("kind",)


@admin.register(Budget)
class BudgetAdmin(admin.ModelAdmin[Budget]):
    """A team's monthly limits (the team's own, a key's, a label's): the console's budgets page edits the same."""

    list_display = ("team", "scope", "monthly_limit", "alert_percents", "over_limit", "grace_s")
    list_filter = ("over_limit",)


@admin.register(BudgetAlert)
class BudgetAlertAdmin(admin.ModelAdmin[BudgetAlert]):
    list_display = ("team", "budget", "month", "percent", "spent", "at", "webhook_status")


@admin.register(BudgetStop)
class BudgetStopAdmin(admin.ModelAdmin[BudgetStop]):
    list_display = ("team", "sandbox", "scope", "action", "at", "destroy_at", "destroyed_at")
