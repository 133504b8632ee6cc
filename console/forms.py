"""Forms for accounts: API keys, invitations, roles, and signing up from an invitation."""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any

from django import forms
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.forms import AuthenticationForm, UserCreationForm
from django.contrib.auth.models import User
from django.utils import timezone

from . import throttle
from .models import Membership, Role
from .permissions import SCOPE_PRESETS

KEY_ROLES = [(Role.MEMBER.value, "Member: sandboxes and launches"), (Role.ADMIN.value, "Admin: also manages keys")]
LABEL_PAIR = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.:/-]{0,62})=(.{0,255})$")


def parse_labels(text: str) -> dict[str, str]:
    """``key=value, key2=value2`` (commas or new lines) as labels; a ``forms.ValidationError`` naming a bad one."""
    labels: dict[str, str] = {}
    for part in re.split(r"[,\n]", text):
        part = part.strip()
        if not part:
            continue
        matched = LABEL_PAIR.match(part)
        if not matched or "__" in matched.group(1):
            raise forms.ValidationError(f"“{part[:40]}” is not key=value (a key is letters, digits and . _ : / -).")
        labels[matched.group(1)] = matched.group(2)
    return labels


class ApiKeyForm(forms.Form):
    name = forms.CharField(max_length=100, strip=True, help_text="Where the key is used, e.g. “trainer on gpu-3”.")
    role = forms.ChoiceField(choices=KEY_ROLES, initial=Role.MEMBER)
    access = forms.ChoiceField(
        label="Access",
        required=False,
        choices=[(name, label) for name, (label, _) in SCOPE_PRESETS.items()],
        initial="all",
        help_text="Narrower than its role: only sandboxes and launches, read-only, or only inference.",
    )
    label_limit = forms.CharField(
        required=False,
        max_length=600,
        label="Only sandboxes labelled",
        help_text="key=value, comma-separated: it sees and touches only these, and what it makes gets them.",
    )
    expires_in_days = forms.IntegerField(
        required=False, min_value=1, max_value=3650, label="Expires in (days)", help_text="Empty: never."
    )

    def expires_at(self) -> datetime | None:
        days = self.cleaned_data.get("expires_in_days")
        return timezone.now() + timedelta(days=days) if days else None

    def scopes(self) -> list[str]:
        return list(SCOPE_PRESETS[self.cleaned_data.get("access") or "all"][1])

    def clean_label_limit(self) -> dict[str, str]:
        return parse_labels(self.cleaned_data.get("label_limit") or "")


class KeyRenameForm(forms.Form):
    name = forms.CharField(max_length=100, strip=True)


def grantable_roles(acting: Membership) -> list[tuple[str, str]]:
    """The roles ``acting`` may hand out: only owners make owners."""
    return [(value, str(label)) for value, label in Role.choices if value != Role.OWNER or acting.can(Role.OWNER)]


class InviteForm(forms.Form):
    email = forms.EmailField(max_length=254)
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER)

    def __init__(self, *args: Any, acting: Membership, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["role"].choices = grantable_roles(acting)  # type: ignore[attr-defined]


class RoleForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices)


class TeamSwitchForm(forms.Form):
    team = forms.CharField(max_length=32)


class ThrottledSignIn(AuthenticationForm):
    """Sign-in refused, with a sentence, after too many failures for the account or from the address (``throttle``)."""

    def clean(self) -> dict[str, Any]:
        username = str(self.cleaned_data.get("username") or "")
        address = str(self.request.META.get("REMOTE_ADDR", "")) if self.request else ""
        wait = throttle.wait_s(username, address)
        if wait:
            minutes = max(1, round(wait / 60))
            raise forms.ValidationError(
                f"Too many failed sign-ins for this account or from this address: try again in {minutes} minute"
                f"{'' if minutes == 1 else 's'}.",
                code="throttled",
            )
        try:
            cleaned = super().clean()
        except forms.ValidationError:
            throttle.failed(username, address)
            raise
        throttle.succeeded(username, address)
        return cleaned


class ThrottledAdminSignIn(ThrottledSignIn, AdminAuthenticationForm):
    """The admin's sign-in, throttled the same way."""


class SignupForm(UserCreationForm):  # type: ignore[type-arg]
    """A new account from an invitation link; the email comes from the invitation.

    It validates (username free, passwords match and pass the validators); the
    account itself is made by services.user_signup_and_accept, not by save()."""

    class Meta(UserCreationForm.Meta):
        model = User
        fields = ("username",)
