"""Template builds through the SDK (its spec builder, both clients) and the CLI, against the real stack."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest

from forkyard import AsyncClient, Client, Conflict, NotFound, Service, TemplateBuild, TemplateBuildFailed, TemplateSpec
from forkyard.errors import InvalidRequest
from tests.sdk.conftest import Run
from tests.support.stack import Stack

pytestmark = pytest.mark.root


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def test_a_spec_built_by_chaining_becomes_a_template_its_sandboxes_start_from(fy: Client) -> None:
    name = unique("sdk")
    spec = (
        TemplateSpec("base", size="tiny")
        .run("mkdir -p /srv && echo from-a-step > /srv/step")
        .file("/srv/index.html", "page\n")
        .file("/srv/blob", b"\x00\xffbytes", mode=0o600)
        .env(MODE="train")
        .workdir("/srv")
        .service(Service.tcp("web", "httpd -f -p 8080 -h /srv", 8080))
    )
    logs: list[str] = []
    moves: list[TemplateBuild] = []
    template = fy.templates.build(name, spec, description="from the SDK", on_log=logs.append, on_progress=moves.append)
    assert (template.name, template.state, template.public, template.description) == (name, "ready", False, "from the SDK")
    assert template.snapshot and template.build
    assert "== step 1/6: run mkdir -p /srv" in "".join(logs)
    assert moves and moves[-1].state == "ready" and [step.state for step in moves[-1].steps] == ["done"] * 6
    sandbox = fy.sandboxes.create(template=name, size="tiny", ttl_s=120)
    try:
        result = sandbox.exec("cat step; echo $MODE; pwd; wget -qO- http://127.0.0.1:8080/; stat -c %a blob")
        assert result.stdout == "from-a-step\ntrain\n/srv\npage\n600\n", result
        assert sandbox.files.read("/srv/blob") == b"\x00\xffbytes"
        with pytest.raises(Conflict) as in_use:
            fy.templates.delete(name)
        assert in_use.value.code == "template_in_use"
    finally:
        sandbox.kill()

    again: list[TemplateBuild] = []
    assert fy.templates.build(name, spec, on_progress=again.append).snapshot == template.snapshot
    assert again[-1].cached and {step.state for step in again[-1].steps} == {"cached"}
    assert fy.templates.last_build(name).id == again[-1].id
    fy.templates.delete(name)
    with pytest.raises(NotFound):
        fy.templates.get(name)


def test_a_failed_build_raises_with_the_steps_output(fy: Client) -> None:
    name = unique("sdk-broken")
    with pytest.raises(TemplateBuildFailed) as failed:
        fy.templates.build(name, TemplateSpec("base", size="tiny").run("echo the-reason; exit 7"))
    assert failed.value.code == "step_failed" and "exited with 7" in failed.value.message
    assert "the-reason" in failed.value.output and failed.value.details["failed_step"] == 0
    assert fy.templates.get(name).state == "failed"
    fy.templates.delete(name)


def test_the_async_client_builds_too(stack: Stack) -> None:
    async def scenario() -> None:
        async with AsyncClient(stack.url, stack.teams[0].key) as fy:
            name = unique("sdk-async")
            template = await fy.templates.build(name, TemplateSpec("base", size="tiny").run("echo async > /a"))
            assert template.state == "ready"
            sandbox = await fy.sandboxes.create(template=name, size="tiny", ttl_s=60)
            try:
                assert (await sandbox.exec("cat /a")).stdout == "async\n"
            finally:
                await sandbox.kill()
            await fy.templates.delete(name)

    asyncio.run(scenario())


def test_a_spec_from_a_file_and_its_unknown_fields(tmp_path: Path) -> None:
    path = tmp_path / "env.json"
    path.write_text(json.dumps({"name": "env", "base": "base", "steps": [{"apt": ["git"]}, {"run": "true"}], "size": "tiny"}))
    given, spec = TemplateSpec.from_file(path)
    assert given == {"name": "env"} and spec.to_api("env") == {
        "name": "env",
        "base": "base",
        "steps": [{"apt": ["git"]}, {"run": "true"}],
        "size": "tiny",
    }
    path.write_text(json.dumps({"name": "env", "base": "base", "stepz": []}))
    with pytest.raises(InvalidRequest) as unknown:
        TemplateSpec.from_file(path)
    assert unknown.value.field == "stepz"


def test_the_cli_builds_from_a_spec_file_and_shows_each_step(cli: Run, tmp_path: Path) -> None:
    name = unique("cli")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"name": name, "base": "base", "size": "tiny", "steps": [{"run": "echo cli-was-here"}]}))
    built = cli("build", str(spec), "--logs")
    assert built.returncode == 0, built.stderr
    assert built.stdout.strip() == name
    assert "[1/1] run echo cli-was-here: done" in built.stderr and "cli-was-here\n" in built.stderr, built.stderr
    again = cli("build", str(spec))
    assert again.returncode == 0 and "[1/1] run echo cli-was-here: cached" in again.stderr, again.stderr

    spec.write_text(json.dumps({"name": name + "-x", "base": "base", "size": "tiny", "steps": [{"run": "echo why >&2; false"}]}))
    failed = cli("build", str(spec))
    assert failed.returncode == 1 and "error [step_failed]" in failed.stderr and "why" in failed.stderr, failed.stderr
    assert "Traceback" not in failed.stderr

    listed = cli("templates", name)
    assert listed.returncode == 0 and name in listed.stdout
    for template in (name, name + "-x"):
        deleted = cli("templates", template, "--delete")
        assert deleted.returncode == 0, deleted.stderr
    assert cli("templates", name).returncode == 1
