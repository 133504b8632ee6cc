from django.contrib import admin

from .models import Price, UsagePeriod


@admin.register(Price)
class PriceAdmin(admin.ModelAdmin[Price]):
    """Sizes and prices are data: an operator edits them here."""

    list_display = ("kind", "size", "cpu", "memory_mib", "amount", "currency")


@admin.register(UsagePeriod)
class UsagePeriodAdmin(admin.ModelAdmin[UsagePeriod]):
    list_display = ("team", "sandbox", "kind", "size", "started_at", "ended_at", "duration_ms", "amount")
    list_filter = ("kind",)
