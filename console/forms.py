"""Forms for accounts: API keys, invitations, roles, and signing up from an invitation."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django import forms
from django.contrib.auth.forms import UserCreationForm
from django.contrib.auth.models import User
from django.utils import timezone

from .models import Membership, Role

KEY_ROLES = [(Role.MEMBER.value, "Member: sandboxes and launches"), (Role.ADMIN.value, "Admin: also manages keys")]


class ApiKeyForm(forms.Form):
    name = forms.CharField(max_length=100, strip=True, help_text="Where the key is used, e.g. “trainer on gpu-3”.")
    role = forms.ChoiceField(choices=KEY_ROLES, initial=Role.MEMBER)
    expires_in_days = forms.IntegerField(
        required=False, min_value=1, max_value=3650, label="Expires in (days)", help_text="Empty: never."
    )

    def expires_at(self) -> datetime | None:
        days = self.cleaned_data.get("expires_in_days")
        return timezone.now() + timedelta(days=days) if days else None


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


class SignupForm(UserCreationForm):  # type: ignore[type-arg]
    """A new account from an invitation link; the email comes from the invitation.

    It validates (username free, passwords match and pass the validators); the
    account itself is made by services.user_signup_and_accept, not by save()."""

    class Meta(UserCreationForm.Meta):
        model = User
        fields = ("username",)
