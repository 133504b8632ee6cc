"""Writes about network policies: save one (new or replaced), apply it to its running sandboxes, delete one.

A policy lists where a sandbox may connect.  Sandboxes without one reach
nothing but their own loopback; each host's engine enforces a sandbox's
rules (``sandboxes/engine/network.py``), given at its create and replaced
when the policy changes.
"""

from __future__ import annotations

import ipaddress
import logging
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from console.audit import Act, Actor, audit_record
from console.errors import Conflict, invalid
from console.models import Team
from sandboxes.engine import errors as engine_errors
from sandboxes.engine.network import METADATA

from .. import engine_link
from ..models import NetworkPolicy, Sandbox
from ..schemas import HOSTNAME

log = logging.getLogger("forkyard.policies")


def _validate(egress: list[dict[str, Any]]) -> list[dict[str, Any]]:
    cleaned = []
    for index, rule in enumerate(egress):
        cidr, host = rule.get("cidr"), rule.get("host")
        if bool(cidr) == bool(host):
            raise invalid(f"egress[{index}]: give exactly one of cidr or host", field=f"egress.{index}")
        if cidr:
            try:
                network = ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise invalid(f"egress[{index}]: {cidr!r} is not a network", field=f"egress.{index}.cidr") from None
            if network.version != 4:
                raise invalid(
                    f"egress[{index}]: a sandbox has IPv4 only, so the IPv6 rule {cidr!r} would reach nothing",
                    field=f"egress.{index}.cidr",
                )
            if network.subnet_of(METADATA):
                raise invalid(
                    f"egress[{index}]: link-local addresses (cloud metadata) are never reachable, so {cidr!r} would reach nothing",
                    field=f"egress.{index}.cidr",
                )
            cidr = str(network)
        # "*.example.org": its subdomains, not example.org itself.
        if host and not HOSTNAME.match(host.removeprefix("*.")):
            raise invalid(f"egress[{index}]: {host!r} is not a host name (or *. and one)", field=f"egress.{index}.host")
        host = host.lower() if host else host
        cleaned.append(
            {"cidr": cidr, "host": host, "ports": sorted(set(rule.get("ports") or [])), "protocol": rule.get("protocol", "tcp")}
        )
    return cleaned


def policy_save(
    *,
    team: Team,
    policy: NetworkPolicy | None,
    name: str,
    description: str,
    egress: list[dict[str, Any]],
    same_launch: bool = False,
    actor: Actor | None = None,
) -> NetworkPolicy:
    """Create a policy (``policy`` None) or replace one's name, description, rules and ``same_launch``."""
    rules = _validate(egress)
    try:
        with transaction.atomic():
            if policy is None:
                created = NetworkPolicy.objects.create(
                    team=team, name=name, description=description, egress=rules, same_launch=same_launch
                )
                audit_record(
                    team=team, actor=actor, action=Act.POLICY_CREATED, target_type="network_policy", target_id=created.pk,
                    target=name, details={"egress": rules, "same_launch": same_launch},
                )
                return created
            before = {"name": policy.name, "egress": policy.egress, "same_launch": policy.same_launch}
            policy.name, policy.description, policy.egress, policy.updated_at = name, description, rules, timezone.now()
            policy.same_launch = same_launch
            policy.save()
            after = {"name": name, "egress": rules, "same_launch": same_launch}
            audit_record(
                team=team, actor=actor, action=Act.POLICY_CHANGED, target_type="network_policy", target_id=policy.pk,
                target=name, details={field: {"from": before[field], "to": after[field]} for field in after if before[field] != after[field]},
            )
            return policy
    except IntegrityError:
        raise Conflict("name_taken", f"a network policy named {name!r} exists", field="name") from None


@dataclass
class Applied:
    sandboxes: int  # running or paused sandboxes whose host now enforces the new rules
    failed: list[str]  # ids of those whose host refused or did not answer (they keep their old rules)


def policy_apply(*, policy: NetworkPolicy) -> Applied:
    """Send a policy's rules to the hosts of its started sandboxes, every host at once: each engine replaces
    its sandboxes' rules (``network.set_many``: one nftables transaction per hundred) before it answers.
    A sandbox that ended meanwhile is skipped; one its host refused keeps its old rules."""
    by_host: dict[int, list[Sandbox]] = defaultdict(list)
    for sandbox in Sandbox.objects.filter(network_policy=policy, state__in=Sandbox.STARTED).select_related("host").order_by("pk"):
        assert sandbox.host is not None  # a started sandbox has a host
        by_host[sandbox.host.pk].append(sandbox)
    if not by_host:
        return Applied(0, [])
    with ThreadPoolExecutor(min(len(by_host), 16)) as pool:
        outcomes = list(pool.map(lambda rows: _apply_on_host(policy, rows), by_host.values()))
    return Applied(sum(outcome.sandboxes for outcome in outcomes), [pk for outcome in outcomes for pk in outcome.failed])


def _apply_on_host(policy: NetworkPolicy, rows: list[Sandbox]) -> Applied:
    host = rows[0].host
    assert host is not None
    applied = Applied(0, [])
    items = [{"id": row.engine_id, "network": policy.engine_network(row.launch_id)} for row in rows]
    try:
        answers = engine_link.engine(host.engine_socket).call("network.set_many", items=items)["sandboxes"]
    except engine_errors.EngineError as error:
        log.warning("policy %s: the sandboxes of %s keep their old rules: %s", policy.pk, host.name, error)
        return Applied(0, [row.pk for row in rows])
    for row, answer in zip(rows, answers, strict=True):
        refused = answer.get("error")
        if refused is None:
            applied.sandboxes += 1
        elif refused.get("code") != engine_errors.SandboxNotRunning.code:  # one that ended meanwhile is skipped
            log.warning("policy %s: sandbox %s keeps its old rules: %s", policy.pk, row.pk, refused.get("message"))
            applied.failed.append(row.pk)
    return applied


@transaction.atomic
def policy_delete(*, policy: NetworkPolicy, actor: Actor | None = None) -> None:
    if Sandbox.objects.filter(network_policy=policy, state__in=Sandbox.LIVE).exists():
        raise Conflict("policy_in_use", "sandboxes still run under this policy; destroy them first")
    audit_record(
        team=policy.team_id, actor=actor, action=Act.POLICY_DELETED, target_type="network_policy", target_id=policy.pk,
        target=policy.name, details={"egress": policy.egress},
    )
    policy.delete()
