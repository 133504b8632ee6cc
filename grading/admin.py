"""What an operator configures: upstreams (sealed secrets, never shown again), open models, team settings."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.http import HttpRequest

from .models import Endpoint, Grade, InferenceCall, KeyInference, ServedModel, TeamInference, Upstream


class UpstreamForm(forms.ModelForm):  # type: ignore[type-arg]  # generic only in the stubs
    """The secret is written, never read back: an empty field keeps the one stored."""

    secret = forms.CharField(
        required=False, widget=forms.PasswordInput(render_value=False), help_text="its API key (left empty: unchanged)"
    )

    class Meta:
        model = Upstream
        fields = ["name", "base_url", "secret", "serves", "model_names", "keeps_prompts", "enabled", "timeout_s", "priority"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initial["secret"] = ""

    def clean_secret(self) -> str:
        given = str(self.cleaned_data.get("secret") or "")
        if not given and self.instance.pk:
            return str(Upstream.objects.get(pk=self.instance.pk).secret or "")
        return given

    def clean_serves(self) -> Any:
        names = self.cleaned_data.get("serves")
        if not isinstance(names, list) or not all(isinstance(name, str) and name for name in names):
            raise forms.ValidationError('a list of model names, e.g. ["gpt-4o-mini"]')
        return names


@admin.register(Upstream)
class UpstreamAdmin(admin.ModelAdmin[Upstream]):
    form = UpstreamForm
    list_display = ("name", "base_url", "keeps_prompts", "enabled", "priority", "timeout_s")
    list_filter = ("enabled", "keeps_prompts")


@admin.register(ServedModel)
class ServedModelAdmin(admin.ModelAdmin[ServedModel]):
    list_display = ("name", "server", "path", "context_length", "enabled")


@admin.register(Endpoint)
class EndpointAdmin(admin.ModelAdmin[Endpoint]):
    list_display = ("id", "team", "name", "model", "state", "host", "restarts", "created_at")
    list_filter = ("state",)
    exclude = ("token",)
    readonly_fields = ("address", "restarts", "started_at", "ready_at", "ended_at")


@admin.register(TeamInference)
class TeamInferenceAdmin(admin.ModelAdmin[TeamInference]):
    list_display = ("team", "zero_retention", "requests_per_minute", "tokens_per_minute")


@admin.register(KeyInference)
class KeyInferenceAdmin(admin.ModelAdmin[KeyInference]):
    list_display = ("key", "zero_retention")


@admin.register(InferenceCall)
class InferenceCallAdmin(admin.ModelAdmin[InferenceCall]):
    """Metadata only: a call's content, when its team keeps it, is the team's to see (the console), not ours."""

    list_display = ("id", "team", "model", "status", "error_code", "input_tokens", "output_tokens", "latency_ms", "created_at")
    list_filter = ("status",)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Grade)
class GradeAdmin(admin.ModelAdmin[Grade]):
    list_display = ("id", "team", "model", "items", "failed", "mean_score", "retained", "created_at")

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
