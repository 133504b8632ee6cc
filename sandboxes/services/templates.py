"""Writes about a team's templates: build one from a spec, delete one.

A team's template is the last snapshot of its build (``worker.template_builds``
runs the steps). The request is checked here, before anything is queued: the
name (a public template's name is the operator's), the base, the policy, the
size. A rebuild under a name the team already has keeps the old template
serving until the new build is ready.

Deleting follows the snapshots' rule: refused while a live sandbox was made
from it, a launch from it is starting, a snapshot was taken of one of its
sandboxes, or a build of it runs. The snapshots of its steps stay, as the
team's (they are what a later build with the same first steps reuses).
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction

from console.errors import Conflict, Unavailable, not_found
from console.models import ApiKey, Team

from .. import commands, selectors, transitions
from ..models import NetworkPolicy, Snapshot, Template, TemplateBuild
from ..schemas import BuildStep, SandboxCreate, TemplateBuildIn
from .admission import admit
from .policies import policy_save

log = logging.getLogger("forkyard.templates")

PACKAGE_INDEXES = "package-indexes"
# What a build's apt, pip and npm steps reach when its spec names no policy.
PACKAGE_INDEX_RULES: list[dict[str, Any]] = [
    {"host": "deb.debian.org", "ports": [80, 443], "protocol": "tcp"},
    {"host": "security.debian.org", "ports": [80, 443], "protocol": "tcp"},
    {"host": "pypi.org", "ports": [443], "protocol": "tcp"},
    {"host": "files.pythonhosted.org", "ports": [443], "protocol": "tcp"},
    {"host": "registry.npmjs.org", "ports": [443], "protocol": "tcp"},
]
INSTALLS = {"apt", "pip", "npm"}


def step_name(step: BuildStep) -> str:
    """What a step does, as its build's steps and log name it."""
    kind = step.kind
    if kind in INSTALLS:
        verb = "npm install -g" if kind == "npm" else f"{kind} install"
        return f"{verb} {' '.join(getattr(step, kind))}"[:200]
    if kind == "run":
        command = step.run if isinstance(step.run, str) else " ".join(step.run or [])
        return f"run {command}"[:200]
    if kind == "file":
        assert step.file is not None
        return f"file {step.file.path}"[:200]
    if kind == "env":
        return f"env {', '.join(sorted(step.env or {}))}"[:200]
    return f"{kind} {getattr(step, kind)}"[:200]


def _policy_for(team: Team, spec: TemplateBuildIn) -> NetworkPolicy | None:
    if spec.network_policy:
        policy = NetworkPolicy.objects.filter(team=team, pk=spec.network_policy).first()
        if policy is None:
            raise not_found("network_policy", spec.network_policy, field="network_policy")
        return policy
    if not any(step.kind in INSTALLS for step in spec.steps):
        return None
    existing = NetworkPolicy.objects.filter(team=team, name=PACKAGE_INDEXES).first()
    if existing is not None:
        return existing
    return policy_save(
        team=team,
        policy=None,
        name=PACKAGE_INDEXES,
        description="made for template builds: Debian's archive, PyPI and npm's registry",
        egress=PACKAGE_INDEX_RULES,
    )


def template_build_create(*, team: Team, key: ApiKey | None, spec: TemplateBuildIn) -> TemplateBuild:
    """Record a build of the team's template ``spec.name`` and queue it; the build."""
    if Template.objects.filter(team=None, name=spec.name).exists():
        raise Conflict("template_name_taken", f"{spec.name!r} is a public template's name: choose another", field="name")
    source = selectors.build_base(team, spec.base).source
    policy = _policy_for(team, spec)
    # Its sandboxes are the team's, paid by its key: one at a time, for the build's time at most.
    admit(
        team=team,
        key=key,
        spec=SandboxCreate.model_validate(
            {**source, "size": spec.size, "ttl_s": spec.timeout_s, "network_policy": policy.pk if policy else None}
        ),
    )
    stored = spec.model_dump(mode="json", exclude_none=True)
    stored["network_policy"] = policy.pk if policy is not None else None
    steps = [{"name": step_name(step), "kind": step.kind} for step in spec.steps]
    if spec.services or not spec.steps:
        steps.append(
            {"name": "services " + ", ".join(s.name for s in spec.services) if spec.services else "base", "kind": "finish"}
        )
    with transaction.atomic():
        template, _ = Template.objects.select_for_update().get_or_create(
            team=team, name=spec.name, defaults={"state": Template.State.BUILDING, "description": spec.description}
        )
        running = template.builds.filter(state__in=(TemplateBuild.State.QUEUED, TemplateBuild.State.BUILDING)).first()
        if running is not None:
            raise Conflict(
                "template_building", f"template {spec.name!r} is being built ({running.pk})", details={"build": running.pk}
            )
        if template.state == Template.State.FAILED:
            template.state = Template.State.BUILDING
            template.save(update_fields=["state"])
        build = TemplateBuild.objects.create(
            team=team,
            api_key=key,
            template=template,
            spec=stored,
            steps=[{**step, "state": "pending", "seconds": None, "snapshot": None} for step in steps],
        )
    try:
        commands.build_template(build.pk)
    except Exception as error:  # whatever the broker raised, the build is not queued
        log.warning("could not queue build %s: %r", build.pk, error)
        transitions.template_build_failed(build, code="broker_unavailable", message="the command could not be queued")
        raise Unavailable("broker_unavailable", "the task broker is unavailable; try again shortly") from error
    return build


def template_users(template: Template) -> dict[str, int]:
    """What holds a team's template: live sandboxes and starting launches made from it, snapshots taken of
    them, builds of it under way."""
    users = {"forks_alive": 0, "launches_starting": 0, "snapshots": 0}
    if template.snapshot is not None:
        held = selectors.snapshot_users(template.snapshot)
        users.update(forks_alive=held["forks_alive"], launches_starting=held["launches_starting"])
        users["snapshots"] = (
            Snapshot.objects.filter(parent=template.snapshot)
            .exclude(state=Snapshot.State.DELETED)
            .exclude(build_key__gt="")
            .count()
        )
    users["builds_running"] = template.builds.filter(state__in=(TemplateBuild.State.QUEUED, TemplateBuild.State.BUILDING)).count()
    return users


def template_delete(*, team: Team, name: str) -> None:
    """Delete one of the team's templates that nothing uses; ``template_in_use`` otherwise."""
    with transaction.atomic():
        template = Template.objects.select_for_update().filter(team=team, name=name).first()
        if template is None:
            if Template.objects.filter(team=None, name=name).exists():
                raise Conflict("template_public", f"{name!r} is a public template: only its operator removes it")
            raise not_found("template", name)
        if template.snapshot is not None:
            selectors.ready_snapshot_locked(team, template.snapshot.pk)  # creates from it lock the same row
        users = template_users(template)
        if any(users.values()):
            raise Conflict(
                "template_in_use",
                f"template {name!r} is in use ({', '.join(f'{k}: {v}' for k, v in users.items() if v)}): end them first",
                details=users,
            )
        template.delete()
