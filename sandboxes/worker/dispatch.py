"""Make a launch's sandboxes: the ``dispatch_launch`` command, on the control lane.

The missing members are made in chunks of ``FORKYARD_LAUNCH_CHUNK``, each on
the host with the most room among those that can run the launch (holding its
template; for a fork any host, each copying the snapshot once), and each
chunk is one ``ensure_running`` command on its host's lane.  A unique
(launch, index) makes a replayed dispatch insert nothing twice.  Each chunk
is inserted under the launch's row lock and only while the launch is still
starting (``transitions.launch_admits_members``): a launch torn down
meanwhile gains no member.
"""

from __future__ import annotations

from django.conf import settings
from django.db import transaction

from console.db import insert_each, one_writer
from console.sealing import unseal

from .. import commands, placement, transitions
from ..models import Launch, Sandbox


def dispatch(launch_id: str, sealed_env: str) -> int:
    """Make the launch's missing sandboxes and queue them; how many were queued."""
    env = unseal(sealed_env)
    launch = Launch.objects.select_related("team", "snapshot").get(pk=launch_id)
    if launch.state != Launch.State.CREATING:
        return 0
    existing = set(Sandbox.objects.filter(launch=launch).values_list("launch_index", flat=True))
    missing = [index for index in range(launch.count) if index not in existing]
    # Every host that can run it, forks included: a launch spreads over hosts
    # for speed, and a host without the snapshot gets it copied once.
    hosts = [
        host
        for tier in placement.hosts_for(team=launch.team, template=launch.template, snapshot=launch.snapshot)
        for host in tier
    ]
    if not hosts:
        transitions.launch_failed(launch)
        return 0
    size = settings.FORKYARD_LAUNCH_CHUNK
    chunks = [missing[start : start + size] for start in range(0, len(missing), size)]
    queued = 0
    places = placement.spread(hosts, [len(chunk) for chunk in chunks], launch.memory_mib)
    for indexes, host in zip(chunks, places, strict=True):
        with one_writer(), transaction.atomic():
            if not transitions.launch_admits_members(launch):
                break  # torn down: nothing more is made
            insert_each(Sandbox, [launch.member(index, host, env) for index in indexes])
        ids = list(
            Sandbox.objects.filter(launch=launch, launch_index__in=indexes, state=Sandbox.State.QUEUED).values_list(
                "pk", flat=True
            )
        )
        commands.ensure_running(host, ids)
        queued += len(ids)
    transitions.launch_settled(launch)
    return queued
