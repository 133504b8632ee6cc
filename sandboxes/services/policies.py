"""Writes about network policies: save one (new or replaced), apply it to its running sandboxes, delete one.

A policy lists where a sandbox may connect.  Sandboxes without one reach
nothing but their own loopback; each host's engine enforces a sandbox's
rules (``sandboxes/engine/network.py``), given at its create and replaced
when the policy changes.
"""

from __future__ import annotations

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
from sandboxes.engine import network

from .. import engine_link
from ..models import NetworkPolicy, Sandbox

log = logging.getLogger("forkyard.policies")


def _validate(egress: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rules as saved, checked by the engine's own parser (``network.parse_egress``): a rule the engine would
    refuse, or one that could reach nothing (IPv6, link-local), is refused here, when the policy is saved."""
    try:
        rules = network.parse_egress(egress)
    except engine_errors.InvalidRequest as error:
        field = str(error.details.get("field", "network.egress")).removeprefix("network.")
        raise invalid(error.message.replace("network.egress", "egress"), field=field) from None
    return [
        {"cidr": str(rule.network) if rule.network else None, "host": rule.host, "ports": list(rule.ports), "protocol": rule.protocol}
        for rule in rules
    ]


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
