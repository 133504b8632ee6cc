"""A host's heartbeat: register it (the first time), record its engine's capacity and what it holds.

Only what the host reports is written: a save of the whole row would put
back a state an operator changed meanwhile (draining, say).  A host the
fleet's watch marked offline (its heartbeat had stopped: ``worker.fleet``)
is online again once its agent reports; a drained one stays drained.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.utils import timezone

from sandboxes.engine import errors as engine_errors

from .. import engine_link
from ..models import Host, Template
from .snapshots import sync_host


def host_heartbeat(name: str, socket_path: str) -> Host:
    """Register this host (first time) and record its engine's capacity, templates and snapshots."""
    client = engine_link.engine(socket_path)
    info = client.info()
    gateway = _gateway(client)
    reported = {
        "queue": f"host.{name}",
        "engine_socket": settings.FORKYARD_ENGINE_ADDRESS,  # how everyone else reaches it
        "region": settings.FORKYARD_REGION,
        "cpus": info["cpus"],
        "memory_mib": info["memory_mib"],
        "max_sandboxes": info["max_sandboxes"],
        # What its kernel's limits let it hold, and the kernel's memory per sandbox (engines before the preflight:
        # not said, so None and 0: its max_sandboxes, and the default overhead).
        "kernel_max_sandboxes": _fits(info),
        "sandbox_overhead_kib": int(info.get("sandbox_overhead_kib", {}).get("kib", 0)),
        "engine_sandboxes": info["sandboxes"] + info.get("pooled", 0),
        "committed_memory_mib": info["committed_memory_mib"],
        "engine_version": info["version"],
        "gateway_url": gateway["url"],
        "gateway_secret": gateway["secret_b64"],
        "last_heartbeat": timezone.now(),
    }
    if not Host.objects.filter(name=name).update(**reported):
        Host.objects.get_or_create(name=name, defaults=reported)
    Host.objects.filter(name=name, state=Host.State.OFFLINE).update(state=Host.State.ONLINE)
    host = Host.objects.get(name=name)
    held = []
    public = set()
    for template in client.call("templates.list")["templates"]:
        if template.get("kind") == "snapshot":
            held.append(template["name"])  # a team's snapshot, not a public template
            continue
        public.add(template["name"])
        row, _ = Template.objects.update_or_create(
            name=template["name"], team=None, defaults={"size_bytes": template["size_bytes"], "layers": template["layers"]}
        )
        row.hosts.add(host)
    _forget_deleted(host, public)
    sync_host(host, held)
    return host


def _fits(info: dict[str, Any]) -> int | None:
    fits = info.get("preflight", {}).get("fits")
    return int(fits) if fits is not None else None


def _gateway(client: Any) -> dict[str, str]:
    """Where the host's gateway answers and the key of its data tokens; none from an engine without one."""
    try:
        answer = client.call("gateway.info")
    except engine_errors.InvalidRequest:  # an engine older than the gateway: unknown operation
        return {"url": "", "secret_b64": ""}
    return {"url": str(answer.get("url", "")), "secret_b64": str(answer.get("secret_b64", ""))}


def revoke_data_tokens(host: Host, key_ids: list[str]) -> int:
    """The host's gateway refuses every data token of these keys from now on."""
    return int(engine_link.engine(host.engine_socket).call("gateway.revoke", keys=key_ids)["revoked"])


def _forget_deleted(host: Host, public: set[str]) -> None:
    """Templates this host held and its engine no longer has (deleted there): the host no longer holds them,
    and one that no host holds any more is gone, so that a create from it is ``template_not_found`` rather
    than sent to a host that would refuse it."""
    for row in Template.objects.filter(team=None, hosts=host).exclude(name__in=public):
        row.hosts.remove(host)
        if not row.hosts.exists():
            row.delete()
