"""Writes for network policies.

A policy lists where a sandbox may connect.  Sandboxes without one reach
nothing but their own loopback; enforcing the egress rules on the host is a
separate piece of work, and the API says so rather than pretending.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from console.errors import ApiError
from console.models import Team

from .models import NetworkPolicy, Sandbox

HOSTNAME = re.compile(
    r"^(?=.{1,253}$)([a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?\.)*[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?$"
)


def _validate(egress: list[dict[str, Any]]) -> list[dict[str, Any]]:
    cleaned = []
    for index, rule in enumerate(egress):
        cidr, host = rule.get("cidr"), rule.get("host")
        if bool(cidr) == bool(host):
            raise ApiError("invalid_request", f"egress[{index}]: give exactly one of cidr or host", field=f"egress.{index}")
        if cidr:
            try:
                cidr = str(ipaddress.ip_network(cidr, strict=False))
            except ValueError:
                raise ApiError(
                    "invalid_request", f"egress[{index}]: {cidr!r} is not a network", field=f"egress.{index}.cidr"
                ) from None
        if host and not HOSTNAME.match(host):
            raise ApiError("invalid_request", f"egress[{index}]: {host!r} is not a host name", field=f"egress.{index}.host")
        cleaned.append(
            {"cidr": cidr, "host": host, "ports": sorted(set(rule.get("ports") or [])), "protocol": rule.get("protocol", "tcp")}
        )
    return cleaned


def policy_save(
    *, team: Team, policy: NetworkPolicy | None, name: str, description: str, egress: list[dict[str, Any]]
) -> NetworkPolicy:
    rules = _validate(egress)
    try:
        with transaction.atomic():
            if policy is None:
                return NetworkPolicy.objects.create(team=team, name=name, description=description, egress=rules)
            policy.name, policy.description, policy.egress, policy.updated_at = name, description, rules, timezone.now()
            policy.save()
            return policy
    except IntegrityError:
        raise ApiError("name_taken", f"a network policy named {name!r} exists", status=409, field="name") from None


def policy_delete(*, policy: NetworkPolicy) -> None:
    if Sandbox.objects.filter(network_policy=policy, state__in=Sandbox.LIVE).exists():
        raise ApiError("policy_in_use", "sandboxes still run under this policy; destroy them first", status=409)
    policy.delete()
