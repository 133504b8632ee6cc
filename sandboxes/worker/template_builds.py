"""Build a team's template from its spec: the ``build_template`` command.

Each step runs in a sandbox forked from the step before it, and its result
is saved as a snapshot whose ``build_key`` is the digest of the base and
every step up to it. So:

1. A step whose key a ready snapshot of the team already has is not run: the
   build goes on from that snapshot (a rebuild of the same spec runs
   nothing; two specs that start the same way share those steps' layers).
2. Otherwise a sandbox is forked from where the build is (the base, or the
   last step's snapshot), the step runs in it (its output goes to the
   build's ``log`` as it comes), it is snapshotted and destroyed. A step's
   layer therefore holds that step's changes only.
3. ``env``, ``workdir`` and ``user`` steps run nothing: their snapshot
   carries them as the defaults of every later fork (the engine's template
   record), so later steps and the template's sandboxes get them.
4. The last snapshot (with the spec's services, if any) becomes the
   template. A failed step names itself and keeps its output's tail; the
   sandbox is destroyed whatever happened. The log stays ``LOG_KEPT_S``
   after the end, for a follower that connects late, then the host agent
   clears it (``forget_ended_logs``).

The command is safe to replay: a build that is ready or failed is left
alone, and a replayed one starts again from the steps already saved. A
build its worker lost (still building ``STUCK_AFTER`` after it last wrote)
is queued again by the host agent (``requeue_stuck_builds``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shlex
import time
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from django.utils import timezone

from console.errors import Refused
from sandboxes.engine import errors as engine_errors

from .. import commands, engine_link, placement, selectors, sizes, transitions
from ..models import Sandbox, Snapshot, TemplateBuild
from ..schemas import BuildStep, TemplateBuildIn
from . import bring_up, take_down
from .snapshots import snapshot_take

log = logging.getLogger("forkyard.templates")

LOG_TAIL = 64 * 1024  # of a running build's log, kept for whoever follows it
LOG_EVERY_S = 0.25  # the log is written at most this often
LOG_KEPT_S = 120  # an ended build's log, for a follower that connects late
STUCK_AFTER = timedelta(minutes=10)  # at least: a silent step may run up to its timeout_s
APT = (
    "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends"
    ' "$@" && apt-get clean && rm -rf /var/lib/apt/lists/*'
)


class StepFailed(Exception):
    def __init__(self, code: str, message: str, output: str = "") -> None:
        super().__init__(message)
        self.code, self.message, self.output = code, message, output


def digest(previous: str, part: Any) -> str:
    return hashlib.sha256((previous + json.dumps(part, sort_keys=True, separators=(",", ":"))).encode()).hexdigest()


def step_command(step: BuildStep) -> str | list[str] | None:
    """The command a step runs in its sandbox (as argv where it takes the spec's values: no shell quoting)."""
    if step.apt:
        return ["sh", "-c", APT, "apt", *step.apt]
    if step.pip:
        index = ["--index-url", step.index_url] if step.index_url else []
        if step.index_url and step.index_url.startswith("http://"):
            index += ["--trusted-host", urlsplit(step.index_url).hostname or ""]
        return [
            "python3", "-m", "pip", "install", "--no-input", "--disable-pip-version-check", "--no-cache-dir",
            "--break-system-packages", *index, *step.pip,
        ]  # fmt: skip
    if step.npm:
        return ["npm", "install", "-g", "--no-fund", "--no-audit", *step.npm]
    if step.run is not None:
        return step.run
    if step.workdir:
        return ["mkdir", "-p", step.workdir]
    if step.user is not None:
        return ["id", str(step.user)]  # fails now, naming the step, if the user does not exist
    return None


class BuildLog:
    """A running build's output, its tail written to the row now and then."""

    def __init__(self, build: TemplateBuild) -> None:
        self.build_id = build.pk
        self.text = ""
        self.total = 0
        self.written = 0.0

    def add(self, text: str, *, now: bool = False) -> None:
        self.text = (self.text + text)[-LOG_TAIL:]
        self.total += len(text)
        if now or time.monotonic() - self.written >= LOG_EVERY_S:
            TemplateBuild.objects.filter(pk=self.build_id).update(log=self.text, log_total=self.total, updated_at=timezone.now())
            self.written = time.monotonic()


def _sandbox(build: TemplateBuild, spec: TemplateBuildIn, source: dict[str, str]) -> Sandbox:
    """A running sandbox forked from ``source``, under the build's policy, on a host placement chooses; made
    here, as a launch's chunk is (the build was admitted when it was asked for)."""
    shape = sizes.shape_of(spec.size, None, None)
    snapshot = Snapshot.objects.filter(pk=source["snapshot"]).first() if "snapshot" in source else None
    template = snapshot.template if snapshot is not None else source["template"]
    host = placement.choose_host(
        tiers=placement.hosts_for(team=build.team, template=template, snapshot=snapshot), memory_mib=shape.memory_mib
    )
    sandbox = Sandbox.objects.create(
        team=build.team,
        api_key=build.api_key,
        host=host,
        template=template,
        snapshot=snapshot,
        size=shape.size,
        cpu=shape.cpu,
        memory_mib=shape.memory_mib,
        ttl_s=spec.timeout_s + 300,
        network_policy_id=spec.network_policy,
        labels={"forkyard.build": build.pk},
    )
    bring_up.bring_up(host, [sandbox.pk])
    sandbox = Sandbox.objects.select_related("host").get(pk=sandbox.pk)
    if sandbox.state != Sandbox.State.RUNNING:
        raise StepFailed(
            sandbox.error_code or "sandbox_not_running", f"the build's sandbox is {sandbox.state}: {sandbox.error_message}"
        )
    return sandbox


def _destroy(sandbox: Sandbox) -> None:
    assert sandbox.host is not None
    transitions.sandbox_destroy_requested(sandbox)
    take_down.take_down(sandbox.host, [sandbox.pk])


def _run(sandbox: Sandbox, step: BuildStep, build_log: BuildLog) -> None:
    assert sandbox.host is not None
    engine = engine_link.engine(sandbox.host.engine_socket)
    if step.file is not None:
        engine.write_file(sandbox.engine_id, step.file.path, step.file.data(), mode=step.file.mode, make_parents=True)
        return
    command = step_command(step)
    if command is None:
        return
    shown = command if isinstance(command, str) else shlex.join(command if not step.apt else ["apt-get install", *step.apt])
    build_log.add(f"$ {shown}\n", now=True)
    step_output: list[str] = []

    def output(_stream: str, data: bytes) -> None:
        # What the command printed, as text a database column holds: PostgreSQL's text takes no NUL.
        text = data.decode("utf-8", "replace").replace("\x00", "\ufffd")
        step_output.append(text)
        build_log.add(text)

    result = engine.exec_stream(sandbox.engine_id, command, output, timeout_s=step.timeout_s)
    build_log.add("", now=True)
    if result.timed_out:
        raise StepFailed("step_timed_out", f"it ran longer than {step.timeout_s:g} s", "".join(step_output))
    if result.exit_code != 0:
        raise StepFailed("step_failed", f"it exited with {result.exit_code}", "".join(step_output))


def _defaults(step: BuildStep | None) -> dict[str, Any]:
    if step is None:
        return {}
    if step.env is not None:
        return {"env": step.env}
    if step.workdir is not None:
        return {"workdir": step.workdir}
    if step.user is not None:
        return {"user": str(step.user)}
    return {}


def _snapshot(
    build: TemplateBuild, sandbox: Sandbox, key: str, name: str, services: list[dict[str, Any]], defaults: dict[str, Any]
) -> Snapshot:
    assert sandbox.host is not None
    snapshot = Snapshot.objects.create(
        team=build.team,
        api_key=build.api_key,
        name=f"{build.template.name}: {name}"[:100],
        labels={"forkyard.template": build.template.name, "forkyard.build": build.pk},
        source_sandbox=sandbox,
        parent_id=sandbox.snapshot_id,
        template=sandbox.template,
        host=sandbox.host,
        services=services,
        defaults=defaults,
        build_key=key,
    )
    state = snapshot_take(sandbox.host, snapshot.pk)
    snapshot.refresh_from_db()
    if state != Snapshot.State.READY:
        raise StepFailed(snapshot.error_code or "snapshot_failed", f"its snapshot failed: {snapshot.error}")
    return snapshot


def _set_step(build: TemplateBuild, index: int, **changes: Any) -> None:
    build.steps[index] = {**build.steps[index], **changes}
    TemplateBuild.objects.filter(pk=build.pk).update(steps=build.steps, updated_at=timezone.now())


def build(build_id: str) -> str:
    """Run a queued build to its end; its state then."""
    row = TemplateBuild.objects.select_related("team", "api_key", "template").filter(pk=build_id).first()
    if row is None:
        return "missing"
    if row.state in (TemplateBuild.State.READY, TemplateBuild.State.FAILED):
        return row.state
    TemplateBuild.objects.filter(pk=row.pk).update(state=TemplateBuild.State.BUILDING, updated_at=timezone.now())
    spec = TemplateBuildIn.model_validate(row.spec)
    build_log = BuildLog(row)
    deadline = time.monotonic() + spec.timeout_s
    index = None
    try:
        base = selectors.build_base(row.team, spec.base)  # gone since it was asked for: the build fails with its code
        key, source = base.key, base.source
        services = [service.as_engine() for service in spec.services]
        last: Snapshot | None = None
        for index, planned in enumerate(row.steps):
            step = spec.steps[index] if planned["kind"] != "finish" else None
            part = step.model_dump(mode="json", exclude_none=True, exclude={"timeout_s"}) if step else {"services": services}
            key = digest(key, part)
            cached = (
                Snapshot.objects.filter(team=row.team, build_key=key, state=Snapshot.State.READY).order_by("-created_at").first()
            )
            if cached is not None:
                _set_step(row, index, state="cached", seconds=0.0, snapshot=cached.pk)
                build_log.add(f"== step {index + 1}/{len(row.steps)}: {planned['name']} (cached: {cached.pk})\n", now=True)
                source, last = {"snapshot": cached.pk}, cached
                continue
            if time.monotonic() > deadline:
                raise StepFailed("build_timed_out", f"the build ran longer than {spec.timeout_s} s")
            started = time.monotonic()
            _set_step(row, index, state="running")
            build_log.add(f"== step {index + 1}/{len(row.steps)}: {planned['name']}\n", now=True)
            sandbox = _sandbox(row, spec, source)
            try:
                if step is not None:
                    _run(sandbox, step, build_log)
                carried = services if step is None else []
                last = _snapshot(row, sandbox, key, planned["name"], carried, _defaults(step))
            finally:
                _destroy(sandbox)
            _set_step(row, index, state="done", seconds=round(time.monotonic() - started, 3), snapshot=last.pk)
            source = {"snapshot": last.pk}
        assert last is not None  # a build has at least one step (its finish, when the spec has none)
    except StepFailed as failure:
        message = failure.message if index is None else f"step {index + 1} ({row.steps[index]['name']}): {failure.message}"
        transitions.template_build_failed(row, code=failure.code, message=message, step=index, output=failure.output)
        return TemplateBuild.State.FAILED
    except (Refused, engine_errors.EngineError) as error:
        if isinstance(error, engine_errors.Unavailable):
            raise  # retried: the steps already saved are not run again
        code = getattr(error, "code", "build_failed")
        text = getattr(error, "message", str(error))
        message = text if index is None else f"step {index + 1} ({row.steps[index]['name']}): {text}"
        transitions.template_build_failed(row, code=code, message=message, step=index)
        return TemplateBuild.State.FAILED
    transitions.template_build_ready(row, last, spec.description)
    log.info("template %s built (%s): %s", row.template.name, row.pk, last.pk)
    return TemplateBuild.State.READY


def forget_ended_logs() -> int:
    """Clear the logs of builds that ended more than ``LOG_KEPT_S`` ago; how many."""
    before = timezone.now() - timedelta(seconds=LOG_KEPT_S)
    return TemplateBuild.objects.filter(ended_at__lt=before).exclude(log="").update(log="")


def _silent_for_too_long(build: TemplateBuild, now: datetime) -> bool:
    """Longer than its longest step may run without a word (each step writes when it starts and as its
    output comes), and at least ``STUCK_AFTER``."""
    longest = max((float(step.get("timeout_s", 900)) for step in build.spec.get("steps", [])), default=0.0)
    return build.updated_at < now - max(STUCK_AFTER, timedelta(seconds=longest + 60))


def requeue_stuck_builds() -> int:
    """Builds whose worker went silent (a worker or broker died): queued again; how many."""
    now = timezone.now()
    candidates = TemplateBuild.objects.filter(
        state__in=(TemplateBuild.State.QUEUED, TemplateBuild.State.BUILDING), updated_at__lt=now - STUCK_AFTER
    )[:100]
    stuck = [build.pk for build in candidates if _silent_for_too_long(build, now)][:20]
    for build_id in stuck:
        TemplateBuild.objects.filter(pk=build_id).update(updated_at=timezone.now())
        commands.build_template(build_id)
    return len(stuck)
