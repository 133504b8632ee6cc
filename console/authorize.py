"""The one place the API checks what a key may do, before a request's body is read.

``authorize`` looks the request's operation up in ``console.permissions.ROUTES``
and checks the key's role and scopes against its action; for a key with a
label limit, it also checks that the sandbox, launch, snapshot or lease the
request names (by path, or by ``?launch=``/``?label=``) is one the key may
touch: one it may not is answered exactly as one that does not exist.
``console.asgi`` calls it for every HTTP request (the hot path included), the
API's websocket consumers for every connection, and ``ApiKeyAuth`` for a
request that reached Django some other way.

A request whose body names sandboxes to act on as well (a grade whose items read
a sandbox's file or run a command in one) is checked again once its body is
parsed, by ``authorize_sandboxes``: the same scopes and label limit as the
sandboxes' own operations, so that no route is a way around them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from console.db import db
from sandboxes.models import Launch, Lease, Sandbox, Snapshot

from .errors import Forbidden, Refused, not_found
from .models import ApiKey
from .permissions import Action, labels_within, require_key, route_action

# A path parameter that names an object a label limit applies to: (its model, its kind in a not-found code).
LABELLED: dict[str, tuple[type[Sandbox] | type[Launch] | type[Snapshot], str]] = {
    "sandbox_id": (Sandbox, "sandbox"),
    "launch_id": (Launch, "launch"),
    "snapshot_id": (Snapshot, "snapshot"),
}


async def authorize(key: ApiKey, method: str, path: str, query: Mapping[str, Sequence[str]] | None = None) -> Refused | None:
    """What refuses ``key`` this request (a ``Forbidden``, or the ``NotFound`` of an object beyond its label
    limit), or None: it may go on."""
    found = route_action(method, path)
    if found is None:
        if key.scopes or key.label_limit:
            return Forbidden("out_of_scope", f"a scoped key may not use {method} {path[:100]}: no scope names it")
        return None  # not an operation of ours: the API answers it (404, 405) as for any key
    action, parameters = found
    try:
        require_key(key, action)
    except Refused as refusal:
        return refusal
    if not key.label_limit:
        return None
    return await db(_beyond_label_limit)(key, parameters, dict(query or {}))


def _beyond_label_limit(key: ApiKey, parameters: dict[str, str], query: dict[str, Sequence[str]]) -> Refused | None:
    limit: dict[str, str] = dict(key.label_limit)
    named = dict(parameters)
    if query.get("launch"):
        named["launch_id"] = str(query["launch"][0])
    for parameter, (model, kind) in LABELLED.items():
        if parameter not in named:
            continue
        labels = model.objects.filter(team_id=key.team_id, pk=named[parameter]).values_list("labels", flat=True).first()
        if labels is None or not labels_within(limit, labels):
            return not_found(kind, named[parameter])
    if "lease_id" in named and not Lease.objects.filter(team_id=key.team_id, pk=named["lease_id"], api_key=key).exists():
        return not_found("lease", named["lease_id"])
    for label in query.get("label", []):
        if _pair(label) not in limit.items():
            return Forbidden(
                "out_of_scope",
                f"this key sees only sandboxes labelled {', '.join(f'{k}={v}' for k, v in limit.items())}",
                field="label",
                details={"label_limit": limit},
            )
    return None


def _pair(label: str) -> tuple[str, Any]:
    ends = [index for index in (label.find("="), label.find(":")) if index >= 0]
    cut = min(ends) if ends else len(label)
    return label[:cut], label[cut + 1 :] if ends else None


async def authorize_sandboxes(key: ApiKey, *, read: Collection[str] = (), run: Collection[str] = ()) -> Refused | None:
    """What refuses ``key`` reading files of the sandboxes ``read`` or running commands in those of ``run``
    (as ``GET .../files`` and ``POST .../exec`` would be refused), or None."""
    for ids, action in ((read, Action.SEE_SANDBOXES), (run, Action.RUN_SANDBOXES)):
        if not ids:
            continue
        try:
            require_key(key, action)
        except Refused as refusal:
            return refusal
    if not key.label_limit:
        return None
    return await db(_sandboxes_beyond_label_limit)(key, sorted({*read, *run}))


def _sandboxes_beyond_label_limit(key: ApiKey, sandbox_ids: list[str]) -> Refused | None:
    limit: dict[str, str] = dict(key.label_limit)
    found = dict(Sandbox.objects.filter(team_id=key.team_id, pk__in=sandbox_ids).values_list("pk", "labels"))
    for sandbox_id in sandbox_ids:
        if sandbox_id in found and not labels_within(limit, found[sandbox_id]):
            return not_found("sandbox", sandbox_id)
    return None  # one the team does not have is answered not found where it is read, as for any key
