"""Who may do what: one table, read by the API (for keys) and the console (for members).

Every action names the least role it needs and the resource it reads or
writes.  A member's role decides in the console; a key's role decides in the
API, and a key may be narrowed further by **scopes** (the resources it may
use, each read-only or not) and by a **label limit** (only sandboxes,
launches and snapshots carrying those labels: its creates get them).

``ROUTES`` names the action of every API operation (and of the API's
websockets).  The API checks it in one place, before a request's body is
read (``console.authorize``, called by ``console.asgi`` for HTTP and by each
API websocket consumer), so that a handler never checks a permission itself
and the console and the API cannot disagree.  ``tests/api/test_scopes.py``
reads the published OpenAPI document and fails on an operation this table
does not name, and on one that a key outside its scope could use.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from .errors import Forbidden, invalid
from .models import ROLE_RANK, ApiKey, Role


class Resource(StrEnum):
    """What a key's scope names."""

    SANDBOXES = "sandboxes"  # sandboxes, their commands, files, processes, ports and metrics; leases; batches
    LAUNCHES = "launches"
    SNAPSHOTS = "snapshots"
    TEMPLATES = "templates"
    NETWORK_POLICIES = "network_policies"
    USAGE = "usage"  # usage, statements, budgets to read
    BUDGETS = "budgets"  # budgets to change
    KEYS = "keys"
    MEMBERS = "members"
    AUDIT = "audit"
    INFERENCE = "inference"  # the inference gateway (its models and chat completions) and model-graded grades
    ENDPOINTS = "endpoints"  # dedicated open-model endpoints: each one a model server billed per second


class Access(StrEnum):
    READ = "read"
    WRITE = "write"


class Action(StrEnum):
    """What a caller asks to do, as a sentence's verb phrase (it is shown to people)."""

    READ = "see the team's objects"  # any console page
    WHOAMI = "see its own key and limits"
    SEE_SANDBOXES = "see sandboxes"
    RUN_SANDBOXES = "run sandboxes"  # create, exec, files, processes, ports, pause, destroy, leases
    SEE_LAUNCHES = "see launches"
    RUN_LAUNCHES = "start and tear down launches"
    SEE_SNAPSHOTS = "see snapshots"
    MANAGE_SNAPSHOTS = "take, import and delete snapshots"
    SEE_TEMPLATES = "see templates"
    MANAGE_TEMPLATES = "build and delete templates"
    SEE_POLICIES = "see network policies"
    MANAGE_POLICIES = "manage network policies"
    SEE_USAGE = "see usage, statements and budgets"
    MANAGE_BUDGETS = "change budgets"
    SEE_KEYS = "see API keys"
    MANAGE_KEYS = "manage API keys"
    SEE_MEMBERS = "see members"
    MANAGE_MEMBERS = "manage members"  # invite, change roles, remove others
    SEE_AUDIT = "read the audit log"
    SEE_INFERENCE = "see the models it may call and its grades"
    USE_INFERENCE = "call inference and grades"
    SEE_ENDPOINTS = "see dedicated endpoints"
    DEPLOY_ENDPOINTS = "deploy and delete dedicated endpoints"
    MANAGE_RETENTION = "change what the team keeps of prompts and outputs"  # the console's inference page


@dataclass(frozen=True)
class Rule:
    least_role: Role
    resource: Resource | None  # None: every key, whatever its scopes
    access: Access = Access.READ


R, A = Resource, Access
RULES: dict[Action, Rule] = {
    Action.READ: Rule(Role.MEMBER, None),
    Action.WHOAMI: Rule(Role.MEMBER, None),
    Action.SEE_SANDBOXES: Rule(Role.MEMBER, R.SANDBOXES),
    Action.RUN_SANDBOXES: Rule(Role.MEMBER, R.SANDBOXES, A.WRITE),
    Action.SEE_LAUNCHES: Rule(Role.MEMBER, R.LAUNCHES),
    Action.RUN_LAUNCHES: Rule(Role.MEMBER, R.LAUNCHES, A.WRITE),
    Action.SEE_SNAPSHOTS: Rule(Role.MEMBER, R.SNAPSHOTS),
    Action.MANAGE_SNAPSHOTS: Rule(Role.MEMBER, R.SNAPSHOTS, A.WRITE),
    Action.SEE_TEMPLATES: Rule(Role.MEMBER, R.TEMPLATES),
    Action.MANAGE_TEMPLATES: Rule(Role.MEMBER, R.TEMPLATES, A.WRITE),
    Action.SEE_POLICIES: Rule(Role.MEMBER, R.NETWORK_POLICIES),
    Action.MANAGE_POLICIES: Rule(Role.ADMIN, R.NETWORK_POLICIES, A.WRITE),
    Action.SEE_USAGE: Rule(Role.MEMBER, R.USAGE),
    Action.MANAGE_BUDGETS: Rule(Role.ADMIN, R.BUDGETS, A.WRITE),
    Action.SEE_KEYS: Rule(Role.MEMBER, R.KEYS),
    Action.MANAGE_KEYS: Rule(Role.ADMIN, R.KEYS, A.WRITE),
    Action.SEE_MEMBERS: Rule(Role.MEMBER, R.MEMBERS),
    Action.MANAGE_MEMBERS: Rule(Role.ADMIN, R.MEMBERS, A.WRITE),
    Action.SEE_AUDIT: Rule(Role.ADMIN, R.AUDIT),
    Action.SEE_INFERENCE: Rule(Role.MEMBER, R.INFERENCE),
    Action.USE_INFERENCE: Rule(Role.MEMBER, R.INFERENCE, A.WRITE),
    Action.SEE_ENDPOINTS: Rule(Role.MEMBER, R.ENDPOINTS),
    Action.DEPLOY_ENDPOINTS: Rule(Role.MEMBER, R.ENDPOINTS, A.WRITE),
    Action.MANAGE_RETENTION: Rule(Role.ADMIN, R.INFERENCE, A.WRITE),
}
# Kept for callers that read the least role alone.
LEAST_ROLE: dict[Action, Role] = {action: rule.least_role for action, rule in RULES.items()}
WHO = {Role.MEMBER: "members", Role.ADMIN: "admins and owners", Role.OWNER: "owners"}

# --- the API's operations -------------------------------------------------------------------------

V1 = "/api/v1"
ROUTES: list[tuple[str, str, Action]] = [
    ("GET", "/me", Action.WHOAMI),
    # sandboxes and what runs in them
    ("GET", "/sandboxes", Action.SEE_SANDBOXES),
    ("POST", "/sandboxes", Action.RUN_SANDBOXES),
    ("DELETE", "/sandboxes", Action.RUN_SANDBOXES),
    ("GET", "/sandboxes/{sandbox_id}", Action.SEE_SANDBOXES),
    ("PATCH", "/sandboxes/{sandbox_id}", Action.RUN_SANDBOXES),
    ("DELETE", "/sandboxes/{sandbox_id}", Action.RUN_SANDBOXES),
    ("POST", "/sandboxes/{sandbox_id}/pause", Action.RUN_SANDBOXES),
    ("POST", "/sandboxes/{sandbox_id}/resume", Action.RUN_SANDBOXES),
    ("POST", "/sandboxes/{sandbox_id}/exec", Action.RUN_SANDBOXES),
    ("POST", "/sandboxes/{sandbox_id}/exec/stream", Action.RUN_SANDBOXES),
    ("GET", "/sandboxes/{sandbox_id}/files", Action.SEE_SANDBOXES),
    ("PUT", "/sandboxes/{sandbox_id}/files", Action.RUN_SANDBOXES),
    ("DELETE", "/sandboxes/{sandbox_id}/files", Action.RUN_SANDBOXES),
    ("GET", "/sandboxes/{sandbox_id}/files/list", Action.SEE_SANDBOXES),
    ("GET", "/sandboxes/{sandbox_id}/files/stat", Action.SEE_SANDBOXES),
    ("GET", "/sandboxes/{sandbox_id}/files/watch", Action.SEE_SANDBOXES),
    ("POST", "/sandboxes/{sandbox_id}/files/mkdir", Action.RUN_SANDBOXES),
    ("POST", "/sandboxes/{sandbox_id}/files/rename", Action.RUN_SANDBOXES),
    ("GET", "/sandboxes/{sandbox_id}/archive", Action.SEE_SANDBOXES),
    ("PUT", "/sandboxes/{sandbox_id}/archive", Action.RUN_SANDBOXES),
    ("GET", "/sandboxes/{sandbox_id}/metrics", Action.SEE_SANDBOXES),
    ("GET", "/sandboxes/{sandbox_id}/processes", Action.SEE_SANDBOXES),
    ("POST", "/sandboxes/{sandbox_id}/processes", Action.RUN_SANDBOXES),
    ("GET", "/sandboxes/{sandbox_id}/processes/{pid}", Action.SEE_SANDBOXES),
    ("POST", "/sandboxes/{sandbox_id}/processes/{pid}/input", Action.RUN_SANDBOXES),
    ("POST", "/sandboxes/{sandbox_id}/processes/{pid}/resize", Action.RUN_SANDBOXES),
    ("POST", "/sandboxes/{sandbox_id}/processes/{pid}/signal", Action.RUN_SANDBOXES),
    ("POST", "/sandboxes/{sandbox_id}/processes/{pid}/wait", Action.RUN_SANDBOXES),
    ("GET", "/sandboxes/{sandbox_id}/processes/{pid}/pty", Action.RUN_SANDBOXES),  # websocket
    ("GET", "/sandboxes/{sandbox_id}/desktop", Action.SEE_SANDBOXES),
    ("POST", "/sandboxes/{sandbox_id}/desktop/screenshot", Action.RUN_SANDBOXES),
    ("POST", "/sandboxes/{sandbox_id}/desktop/actions", Action.RUN_SANDBOXES),
    ("POST", "/sandboxes/{sandbox_id}/desktop/view", Action.RUN_SANDBOXES),
    ("GET", "/sandboxes/{sandbox_id}/ports", Action.SEE_SANDBOXES),
    ("POST", "/sandboxes/{sandbox_id}/ports", Action.RUN_SANDBOXES),
    ("DELETE", "/sandboxes/{sandbox_id}/ports/{port}", Action.RUN_SANDBOXES),
    ("POST", "/sandboxes/{sandbox_id}/ports/{port}/wait", Action.RUN_SANDBOXES),
    ("GET", "/sandboxes/{sandbox_id}/ports/{port}/connect", Action.RUN_SANDBOXES),  # websocket
    ("POST", "/exec", Action.RUN_SANDBOXES),
    ("GET", "/leases", Action.SEE_SANDBOXES),
    ("POST", "/leases", Action.RUN_SANDBOXES),
    ("GET", "/leases/{lease_id}", Action.SEE_SANDBOXES),
    ("DELETE", "/leases/{lease_id}", Action.RUN_SANDBOXES),
    ("POST", "/leases/{lease_id}/heartbeat", Action.RUN_SANDBOXES),
    # launches
    ("GET", "/launches", Action.SEE_LAUNCHES),
    ("POST", "/launches", Action.RUN_LAUNCHES),
    ("GET", "/launches/{launch_id}", Action.SEE_LAUNCHES),
    ("DELETE", "/launches/{launch_id}", Action.RUN_LAUNCHES),
    ("GET", "/launches/{launch_id}/sandboxes", Action.SEE_LAUNCHES),
    ("GET", "/launches/{launch_id}/arrivals", Action.SEE_LAUNCHES),
    ("GET", "/launches/{launch_id}/hosts", Action.SEE_LAUNCHES),
    ("GET", "/launches/{launch_id}/metrics", Action.SEE_LAUNCHES),
    # snapshots and templates
    ("POST", "/sandboxes/{sandbox_id}/snapshot", Action.MANAGE_SNAPSHOTS),
    ("GET", "/snapshots", Action.SEE_SNAPSHOTS),
    ("GET", "/snapshots/{snapshot_id}", Action.SEE_SNAPSHOTS),
    ("DELETE", "/snapshots/{snapshot_id}", Action.MANAGE_SNAPSHOTS),
    ("POST", "/snapshots/import", Action.MANAGE_SNAPSHOTS),
    ("GET", "/templates", Action.SEE_TEMPLATES),
    ("POST", "/templates", Action.MANAGE_TEMPLATES),
    ("GET", "/templates/{name}", Action.SEE_TEMPLATES),
    ("DELETE", "/templates/{name}", Action.MANAGE_TEMPLATES),
    ("GET", "/templates/{name}/build", Action.SEE_TEMPLATES),
    ("GET", "/templates/{name}/build/logs", Action.SEE_TEMPLATES),
    # network policies
    ("GET", "/network-policies", Action.SEE_POLICIES),
    ("POST", "/network-policies", Action.MANAGE_POLICIES),
    ("GET", "/network-policies/{policy_id}", Action.SEE_POLICIES),
    ("PUT", "/network-policies/{policy_id}", Action.MANAGE_POLICIES),
    ("DELETE", "/network-policies/{policy_id}", Action.MANAGE_POLICIES),
    # usage, statements and budgets
    ("GET", "/usage", Action.SEE_USAGE),
    ("GET", "/budgets", Action.SEE_USAGE),
    ("POST", "/budgets", Action.MANAGE_BUDGETS),
    ("GET", "/budgets/{budget_id}", Action.SEE_USAGE),
    ("PUT", "/budgets/{budget_id}", Action.MANAGE_BUDGETS),
    ("DELETE", "/budgets/{budget_id}", Action.MANAGE_BUDGETS),
    # inference: the gateway (answered by grading/api/fast.py, checked here all the same), grades, endpoints
    ("GET", "/inference/models", Action.SEE_INFERENCE),
    ("POST", "/inference/chat/completions", Action.USE_INFERENCE),
    ("GET", "/grades", Action.SEE_INFERENCE),
    ("POST", "/grades", Action.USE_INFERENCE),  # material read from sandboxes also needs their scope (authorize_material)
    ("GET", "/grades/{grade_id}", Action.SEE_INFERENCE),
    # A test-based reward runs its check in the sandbox, as an exec does: the sandboxes' scope, and their label limit.
    ("POST", "/sandboxes/{sandbox_id}/grade", Action.RUN_SANDBOXES),
    ("GET", "/endpoints", Action.SEE_ENDPOINTS),
    ("POST", "/endpoints", Action.DEPLOY_ENDPOINTS),
    ("GET", "/endpoints/{endpoint_id}", Action.SEE_ENDPOINTS),
    ("DELETE", "/endpoints/{endpoint_id}", Action.DEPLOY_ENDPOINTS),
    ("GET", "/endpoint-models", Action.SEE_ENDPOINTS),
    # the team itself
    ("GET", "/keys", Action.SEE_KEYS),
    ("POST", "/keys", Action.MANAGE_KEYS),
    ("PATCH", "/keys/{key_id}", Action.MANAGE_KEYS),
    ("DELETE", "/keys/{key_id}", Action.MANAGE_KEYS),
    ("POST", "/keys/{key_id}/rotate", Action.MANAGE_KEYS),
    ("GET", "/audit", Action.SEE_AUDIT),
]
_PARAMETER = re.compile(r"\{([a-z_]+)\}")


def _pattern(template: str) -> re.Pattern[str]:
    parts = _PARAMETER.split(template)
    # Odd parts are parameter names; even parts are the literal text between them.
    regex = "".join(re.escape(part) if index % 2 == 0 else f"(?P<{part}>[^/]+)" for index, part in enumerate(parts))
    return re.compile(f"^{re.escape(V1)}{regex}/?$")


# By method and number of segments: every API request looks its route up (the hot path's too), among a few.
_BY_SHAPE: dict[tuple[str, int], list[tuple[re.Pattern[str], Action]]] = {}
for _method, _template, _action in ROUTES:
    _BY_SHAPE.setdefault((_method, _template.strip("/").count("/")), []).append((_pattern(_template), _action))


def route_action(method: str, path: str) -> tuple[Action, dict[str, str]] | None:
    """The action an API request asks for, and its path's parameters; None for a path the table does not name."""
    if not path.startswith(V1):
        return None
    shape = (method.upper(), path[len(V1) :].strip("/").count("/"))
    for pattern, action in _BY_SHAPE.get(shape, ()):
        matched = pattern.match(path)
        if matched:
            return action, matched.groupdict()
    return None


# --- scopes ---------------------------------------------------------------------------------------

EVERYTHING = "*"
# Shapes a person picks in the console; a key's scopes are any list of "<resource>" or "<resource>:read".
SCOPE_PRESETS: dict[str, tuple[str, list[str]]] = {
    "all": ("Everything its role allows", []),
    "sandboxes": ("Sandboxes and launches only", [R.SANDBOXES.value, R.LAUNCHES.value, f"{R.TEMPLATES.value}:read"]),
    "read_only": ("Read-only", [f"{EVERYTHING}:read"]),
    "inference": ("Inference only", [R.INFERENCE.value]),
}


def parse_scopes(scopes: Iterable[str]) -> list[str]:
    """Scopes checked and normalised (sorted, each once); refused with the one that is wrong."""
    known = {resource.value for resource in Resource} | {EVERYTHING}
    parsed = set()
    for scope in scopes:
        name, _, access = str(scope).partition(":")
        if name not in known or access not in ("", "read"):
            raise invalid(
                f"unknown scope {str(scope)[:40]!r}: a scope is one of {', '.join(sorted(known))}, "
                "optionally followed by :read",
                field="scopes",
            )
        parsed.add(name if not access else f"{name}:read")
    # A resource both read-only and whole is whole.
    return sorted(scope for scope in parsed if not (scope.endswith(":read") and scope[: -len(":read")] in parsed))


def parse_label_limit(labels: Mapping[str, Any] | None) -> dict[str, str]:
    limit = {str(key): str(value) for key, value in (labels or {}).items()}
    if len(limit) > 8 or any(not key or len(key) > 63 or len(value) > 255 or "__" in key for key, value in limit.items()):
        raise invalid("label_limit is at most 8 labels, each key 1-63 characters (no '__'), each value up to 255", field="label_limit")
    return limit


def scope_allows(scopes: list[str], resource: Resource | None, access: Access) -> bool:
    if resource is None or not scopes:
        return True
    granted = set(scopes)
    if EVERYTHING in granted or resource.value in granted:
        return True
    return access == Access.READ and (f"{EVERYTHING}:read" in granted or f"{resource.value}:read" in granted)


def describe_scopes(scopes: list[str]) -> str:
    if not scopes:
        return "everything its role allows"
    return ", ".join(scope.replace(":read", " (read-only)").replace(EVERYTHING, "everything") for scope in scopes)


def allows(role: str, action: Action) -> bool:
    return ROLE_RANK[Role(role)] >= ROLE_RANK[RULES[action].least_role]


def require(role: str, action: Action, *, who: str = "this key") -> None:
    """Refuse (``forbidden``) unless ``role`` may do ``action``."""
    if not allows(role, action):
        needed = RULES[action].least_role
        raise Forbidden(
            "forbidden",
            f"only {WHO[needed]} can {action.value}: {who} is a {role}",
            details={"needs": needed.value, "role": role},
        )


def require_key(key: ApiKey, action: Action) -> None:
    """Refuse unless ``key``'s role and scopes allow ``action``: ``forbidden`` for the role, ``out_of_scope`` for a scope."""
    require(key.role, action)
    rule = RULES[action]
    scopes = list(key.scopes or [])
    if not scope_allows(scopes, rule.resource, rule.access):
        assert rule.resource is not None  # a rule without one is every key's
        needed = rule.resource.value if rule.access == Access.WRITE else f"{rule.resource.value}:read"
        raise Forbidden(
            "out_of_scope",
            f"this key may use {describe_scopes(scopes)}: it cannot {action.value} (that needs the scope {needed!r})",
            details={"needs_scope": needed, "scopes": scopes},
        )


def key_may(key: ApiKey, action: Action) -> bool:
    try:
        require_key(key, action)
    except Forbidden:
        return False
    return True


def labels_within(limit: Mapping[str, str], labels: Mapping[str, Any] | None) -> bool:
    """Whether an object's labels carry every label of a key's limit."""
    held = labels or {}
    return all(str(held.get(key)) == value and key in held for key, value in limit.items())


def labels_for_create(key: ApiKey | None, labels: Mapping[str, str]) -> dict[str, str]:
    """What a create by ``key`` is labelled: its own labels with the key's label limit added; a label of its
    own that contradicts the limit is refused (the key could not see what it made)."""
    limit = dict(key.label_limit or {}) if key is not None else {}
    for name, value in limit.items():
        if name in labels and labels[name] != value:
            raise Forbidden(
                "out_of_scope",
                f"this key may only make sandboxes labelled {name}={value}, not {name}={labels[name]}",
                field="labels",
                details={"label_limit": limit},
            )
    return {**labels, **limit}
