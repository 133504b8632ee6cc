from django.contrib import admin

from .forms import ThrottledAdminSignIn
from .models import ApiKey, AuditEntry, Invitation, Membership, Team, TeamLimits

admin.site.login_form = ThrottledAdminSignIn


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
    list_display = ("name", "prefix", "team", "role", "scopes", "created_at", "last_used_at", "revoked_at")
    list_filter = ("role",)
    readonly_fields = ("prefix", "digest")


@admin.register(Invitation)
class InvitationAdmin(admin.ModelAdmin[Invitation]):
    list_display = ("email", "team", "role", "created_at", "accepted_at")


@admin.register(TeamLimits)
class TeamLimitsAdmin(admin.ModelAdmin[TeamLimits]):
    list_display = ("team", "requests_per_second", "max_sandboxes", "max_launch_count", "max_ttl_s")


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin[AuditEntry]):
    """Read-only: the log is written by the services that make each change."""

    list_display = ("at", "team", "actor", "action", "target_type", "target", "address")
    list_filter = ("action",)
    search_fields = ("actor", "target", "target_id")

    def has_change_permission(self, request: object, obj: object = None) -> bool:
        return False

    def has_add_permission(self, request: object) -> bool:
        return False
