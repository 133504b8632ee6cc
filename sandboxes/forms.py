"""Forms for the console's sandbox pages: the list's filters, the command box, network policies, snapshots."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from django import forms
from django.core.validators import MaxValueValidator
from pydantic import ValidationError

from console.forms import parse_labels

from .models import Sandbox
from .schemas import HOSTNAME, SandboxCreate, ServiceIn

# A label key the database lookup takes literally: no "__" (Django would read a
# lookup in it), no spaces or quotes.
LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,62}$")
PROTOCOLS = ("tcp", "udp", "any")


class SandboxFilterForm(forms.Form):
    q = forms.CharField(required=False, max_length=40, strip=True, label="Find by id", help_text="an id, or its start")
    state = forms.ChoiceField(required=False, choices=[("", "Live (not ended)"), ("all", "Any state"), *Sandbox.State.choices])
    label = forms.CharField(required=False, max_length=200, strip=True, help_text="key=value, or key for any value")
    cursor = forms.CharField(required=False, max_length=100)

    def clean_q(self) -> str:
        query: str = self.cleaned_data["q"]
        if query and not re.fullmatch(r"[A-Za-z0-9_]+", query):
            raise forms.ValidationError("A sandbox id is letters, digits and _ (sb_…).")
        return query

    def clean_label(self) -> str:
        label: str = self.cleaned_data["label"]
        key = label.partition("=")[0]
        if label and (not LABEL_KEY.match(key) or "__" in key):
            raise forms.ValidationError("A label key is letters, digits and . _ : / - (no double underscore).")
        return label


class ExecForm(forms.Form):
    cmd = forms.CharField(
        label="Command",
        max_length=10_000,
        strip=False,
        widget=forms.Textarea(attrs={"rows": 2, "spellcheck": "false", "autocomplete": "off"}),
        help_text="Runs under /bin/sh -c in the sandbox.",
    )
    # Under the engine client's own socket timeout (300 s), so the command times out first.
    timeout_s = forms.FloatField(label="Timeout (s)", initial=30, min_value=0.1, max_value=120)

    def clean_cmd(self) -> str:
        cmd: str = self.cleaned_data["cmd"]
        if not cmd.strip():
            raise forms.ValidationError("Type a command to run.")
        return cmd


class TerminalForm(forms.Form):
    rows = forms.IntegerField(min_value=2, max_value=500, initial=24)
    cols = forms.IntegerField(min_value=10, max_value=1000, initial=80)


def _rule(line: str, number: int) -> dict[str, Any]:
    """``<cidr or host> [ports] [protocol]``, e.g. ``pypi.org 443`` or ``10.0.0.0/8 53 udp``."""
    parts = line.split()
    if len(parts) > 3:
        raise forms.ValidationError(f"Line {number}: write a network or host, then ports, then a protocol.")
    target, ports, protocol = parts[0], parts[1] if len(parts) > 1 else "", parts[2] if len(parts) > 2 else "tcp"
    if ports in PROTOCOLS:  # "host udp": no ports given
        ports, protocol = "", ports
    rule: dict[str, Any] = {"cidr": None, "host": None, "protocol": protocol.lower()}
    try:
        rule["cidr"] = str(ipaddress.ip_network(target, strict=False))
    except ValueError:
        if "/" in target or re.fullmatch(r"[\d.]+", target) or not HOSTNAME.match(target.removeprefix("*.")):
            raise forms.ValidationError(f"Line {number}: {target!r} is neither a network (CIDR) nor a host name.") from None
        rule["host"] = target.lower()
    try:
        rule["ports"] = sorted({int(port) for port in ports.split(",") if port})
    except ValueError:
        raise forms.ValidationError(f"Line {number}: ports are numbers separated by commas, like 80,443.") from None
    if any(not 1 <= port <= 65535 for port in rule["ports"]) or len(rule["ports"]) > 64:
        raise forms.ValidationError(f"Line {number}: ports are 1 to 65535, at most 64 of them.")
    if rule["protocol"] not in PROTOCOLS:
        raise forms.ValidationError(f"Line {number}: the protocol is tcp, udp or any.")
    return rule


def egress_text(egress: list[dict[str, Any]]) -> str:
    """A policy's rules as the form writes them, one a line."""
    lines = []
    for rule in egress:
        ports = ",".join(str(port) for port in rule.get("ports") or [])
        lines.append(
            " ".join(part for part in (rule.get("cidr") or rule.get("host"), ports, rule.get("protocol", "tcp")) if part)
        )
    return "\n".join(lines)


class PolicyForm(forms.Form):
    name = forms.CharField(max_length=64, strip=True)
    description = forms.CharField(max_length=255, required=False, strip=True)
    egress = forms.CharField(
        label="Allowed destinations",
        required=False,
        widget=forms.Textarea(attrs={"rows": 6, "spellcheck": "false", "placeholder": "pypi.org 443\n10.0.0.0/8 53 udp"}),
        help_text="One a line: a network (CIDR) or a host name, then ports (comma-separated; none for all), "
        "then tcp, udp or any (tcp if left out). Empty: nowhere but the sandbox's own loopback.",
    )
    same_launch = forms.BooleanField(
        label="Sandboxes of the same launch may reach each other", required=False, help_text="A multi-service environment."
    )

    def clean_egress(self) -> list[dict[str, Any]]:
        rules, errors = [], []
        for number, line in enumerate(self.cleaned_data["egress"].splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                rules.append(_rule(line, number))
            except forms.ValidationError as error:
                errors.append(error)  # every bad line at once, not one per submit
        if errors:
            raise forms.ValidationError(errors)
        if len(rules) > 256:
            raise forms.ValidationError("A policy has at most 256 rules.")
        return rules


# --- snapshots -----------------------------------------------------------------------------

READY_KINDS = [("tcp", "TCP port answers"), ("http", "HTTP GET answers"), ("exec", "command exits 0")]


class SnapshotForm(forms.Form):
    name = forms.CharField(max_length=100, strip=True, help_text="For people; forks name the snapshot's id.")


class ServiceForm(forms.Form):
    """One service every fork starts; checked by the API's own schema (``schemas.ServiceIn``)."""

    name = forms.CharField(max_length=32, required=False, help_text="a-z 0-9 _ -; its log: /var/log/forkyard/<name>.log")
    command = forms.CharField(max_length=4096, required=False, widget=forms.TextInput(attrs={"spellcheck": "false"}))
    ready = forms.ChoiceField(label="Ready when", choices=READY_KINDS, initial="tcp")
    check = forms.CharField(
        label="Port, port/path or command", max_length=4096, required=False, widget=forms.TextInput(attrs={"spellcheck": "false"})
    )
    timeout_s = forms.FloatField(label="Timeout (s)", initial=30, min_value=0.1, max_value=300)

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if not data.get("name") and not data.get("command"):
            data["service"] = None  # an empty row: no service
            return data
        check = (data.get("check") or "").strip()
        ready: dict[str, Any] = {}
        try:
            if data.get("ready") == "tcp":
                ready = {"tcp": int(check)}
            elif data.get("ready") == "http":
                port, slash, path = check.partition("/")
                ready = {"http": {"port": int(port), "path": slash + path or "/"}}
            else:
                ready = {"exec": check}
        except ValueError:
            self.add_error("check", "A port number, or port/path for HTTP (8080/health).")
            return data
        try:
            service = ServiceIn.model_validate(
                {
                    "name": data.get("name"),
                    "command": data.get("command"),
                    "ready": ready,
                    "timeout_s": data.get("timeout_s") or 30,
                }
            )
        except ValidationError as error:
            first = error.errors()[0]
            where = str(first["loc"][0]) if first["loc"] else ""
            self.add_error(
                where if where in ("name", "command", "timeout_s") else "check", first["msg"].removeprefix("Value error, ")
            )
            return data
        data["service"] = service.as_engine()
        return data


ServiceFormSet = forms.formset_factory(ServiceForm, extra=2, max_num=8, validate_max=True)


class LaunchFromSnapshotForm(forms.Form):
    count = forms.IntegerField(min_value=1, initial=10, help_text="How many forks.")
    size = forms.ChoiceField(choices=[("tiny", "tiny"), ("default", "default")], initial="tiny")
    ttl_s = forms.IntegerField(label="TTL (s)", min_value=1, max_value=7 * 24 * 3600, initial=3600)

    def __init__(self, *args: Any, sizes: list[str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if sizes:
            self.fields["size"].choices = [(size, size) for size in sizes]  # type: ignore[attr-defined]


# --- new sandboxes and launches from the console ---------------------------------------------


class NewSandboxForm(forms.Form):
    """What ``POST /api/v1/sandboxes`` takes, as a person fills it in; checked by the API's own schema."""

    template = forms.ChoiceField(choices=[])
    size = forms.ChoiceField(choices=[])
    ttl_s = forms.IntegerField(label="TTL (s)", min_value=1, initial=3600, help_text="Destroyed this long after it is ready.")
    network_policy = forms.ChoiceField(label="Network policy", required=False, choices=[])
    labels = forms.CharField(required=False, max_length=1000, help_text="key=value, comma-separated.")

    def __init__(
        self,
        *args: Any,
        templates: list[str],
        sizes: list[str],
        policies: list[tuple[str, str]],
        max_ttl_s: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.fields["template"].choices = [(name, name) for name in templates]  # type: ignore[attr-defined]
        self.fields["size"].choices = [(name, name) for name in sizes]  # type: ignore[attr-defined]
        self.fields["network_policy"].choices = [("", "None: loopback only"), *policies]  # type: ignore[attr-defined]
        ttl = self.fields["ttl_s"]
        assert isinstance(ttl, forms.IntegerField)
        ttl.max_value = max_ttl_s
        ttl.validators.append(MaxValueValidator(max_ttl_s))
        ttl.help_text = f"Destroyed this long after it is ready; at most {max_ttl_s:,} s for this team."

    def clean_labels(self) -> dict[str, str]:
        return parse_labels(self.cleaned_data.get("labels") or "")

    def spec(self, **extra: Any) -> SandboxCreate:
        data = self.cleaned_data
        fields = {"template": data["template"], "size": data["size"], "ttl_s": data["ttl_s"], "labels": data["labels"], **extra}
        if data.get("network_policy"):
            fields["network_policy"] = data["network_policy"]
        try:
            return SandboxCreate.model_validate(fields)
        except ValidationError as error:
            first = error.errors()[0]
            raise forms.ValidationError(f"{'.'.join(str(part) for part in first['loc'])}: {first['msg']}") from None


class NewLaunchForm(NewSandboxForm):
    count = forms.IntegerField(min_value=1, initial=10, help_text="How many sandboxes.")

    field_order = ["count", "template", "size", "ttl_s", "network_policy", "labels"]

    def __init__(self, *args: Any, max_count: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        count = self.fields["count"]
        assert isinstance(count, forms.IntegerField)
        count.max_value = max_count
        count.validators.append(MaxValueValidator(max_count))
        count.help_text = f"How many sandboxes: at most {max_count:,} in one launch for this team."
