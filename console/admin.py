from django.contrib import admin

from .models import ApiKey, Invitation, Membership, Team, TeamLimits


class LimitsInline(admin.StackedInline[TeamLimits, Team]):
    model = TeamLimits
    can_delete = False


class MembershipInline(admin.TabularInline[Membership, Team]):
    model = Membership
    extra = 0


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin[Team]):
    list_display = ("name", "slug", "created_at")
    search_fields = ("name", "slug")
    inlines = [LimitsInline, MembershipInline]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin[ApiKey]):
    list_display = ("name", "prefix", "team", "role", "created_at", "last_used_at", "revoked_at")
    list_filter = ("role",)
    readonly_fields = ("prefix", "digest")


@admin.register(Invitation)
class InvitationAdmin(admin.ModelAdmin[Invitation]):
    list_display = ("email", "team", "role", "created_at", "accepted_at")


@admin.register(TeamLimits)
class TeamLimitsAdmin(admin.ModelAdmin[TeamLimits]):
    list_display = ("team", "requests_per_second", "max_sandboxes", "max_launch_count", "max_ttl_s", "monthly_spend_limit")
