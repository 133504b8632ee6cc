from django.contrib import admin

from .models import Host, Launch, Lease, NetworkPolicy, Sandbox, Snapshot, Template


@admin.register(Host)
class HostAdmin(admin.ModelAdmin[Host]):
    list_display = ("name", "state", "region", "engine_sandboxes", "max_sandboxes", "last_heartbeat")
    list_filter = ("state", "region")


@admin.register(Sandbox)
class SandboxAdmin(admin.ModelAdmin[Sandbox]):
    list_display = ("id", "team", "state", "host", "template", "size", "created_at")
    list_filter = ("state",)
    search_fields = ("id", "engine_id")
    exclude = ("env",)


@admin.register(Launch)
class LaunchAdmin(admin.ModelAdmin[Launch]):
    list_display = ("id", "team", "state", "count", "template", "created_at")


@admin.register(Lease)
class LeaseAdmin(admin.ModelAdmin[Lease]):
    list_display = ("id", "team", "state", "grace_s", "heartbeat_at", "expires_at")
    list_filter = ("state",)


admin.site.register(Template)
admin.site.register(Snapshot)
admin.site.register(NetworkPolicy)
