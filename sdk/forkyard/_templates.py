"""Template specs, built step by step, and the wait for a build (``fy.templates.build``).

    spec = TemplateSpec("debian:bookworm").apt("git").pip("pytest").run("git --version").user("agent")
    template = fy.templates.build("my-env", spec, on_log=print)
    sb = fy.sandboxes.create(template="my-env")

A spec is what ``POST /templates`` takes: a base (a template's name, or ``snapshot:<id>``), steps in
order, services. Each step's result is saved on the server, so building the same spec again, or one
that starts with the same steps, reuses them.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .errors import InvalidRequest, TemplateBuildFailed
from .models import Service, TemplateBuild

SPEC_FIELDS = {"name", "description", "base", "steps", "services", "network_policy", "size", "timeout_s"}


class TemplateSpec:
    """A build spec: each method adds a step (or sets an option) and returns the spec, so they chain."""

    def __init__(self, base: str = "base", *, size: str | None = None, network_policy: str | None = None) -> None:
        self.base = base
        self.steps: list[dict[str, Any]] = []
        self.services: list[Service] = []
        self.options: dict[str, Any] = {}
        if size is not None:
            self.options["size"] = size
        if network_policy is not None:
            self.options["network_policy"] = network_policy

    def _step(self, step: dict[str, Any], timeout_s: float | None) -> TemplateSpec:
        if timeout_s is not None:
            step["timeout_s"] = timeout_s
        self.steps.append(step)
        return self

    def apt(self, *packages: str, timeout_s: float | None = None) -> TemplateSpec:
        """Install Debian packages (``apt-get install --no-install-recommends``)."""
        return self._step({"apt": list(packages)}, timeout_s)

    def pip(self, *requirements: str, index_url: str | None = None, timeout_s: float | None = None) -> TemplateSpec:
        """Install Python packages with pip (from PyPI, or ``index_url``)."""
        step: dict[str, Any] = {"pip": list(requirements)}
        if index_url is not None:
            step["index_url"] = index_url
        return self._step(step, timeout_s)

    def npm(self, *packages: str, timeout_s: float | None = None) -> TemplateSpec:
        """Install npm packages globally."""
        return self._step({"npm": list(packages)}, timeout_s)

    def run(self, command: str | list[str], *, timeout_s: float | None = None) -> TemplateSpec:
        """Run a command (a string for the shell, or an argv list); a non-zero exit fails the build."""
        return self._step({"run": command}, timeout_s)

    def file(self, path: str, content: str | bytes, *, mode: int = 0o644) -> TemplateSpec:
        """Write a file (text, or bytes)."""
        body: dict[str, Any] = {"path": path, "mode": mode}
        if isinstance(content, bytes):
            body["content_b64"] = base64.b64encode(content).decode()
        else:
            body["content"] = content
        return self._step({"file": body}, None)

    def env(self, variables: Mapping[str, str] | None = None, **more: str) -> TemplateSpec:
        """Environment variables every later step and every sandbox of the template get."""
        return self._step({"env": {**(variables or {}), **more}}, None)

    def workdir(self, path: str) -> TemplateSpec:
        """The working directory (made if missing) of every later step and every sandbox of the template."""
        return self._step({"workdir": path}, None)

    def user(self, user: str | int) -> TemplateSpec:
        """Whom every later step and every command in the template's sandboxes runs as (it must exist)."""
        return self._step({"user": user}, None)

    def service(self, service: Service) -> TemplateSpec:
        """A process every sandbox of the template starts, and is ready once it answers."""
        self.services.append(service)
        return self

    def to_api(self, name: str, *, description: str = "", timeout_s: float | None = None) -> dict[str, Any]:
        """The body of ``POST /templates`` for a template called ``name``."""
        body: dict[str, Any] = {"name": name, "base": self.base, "steps": list(self.steps), **self.options}
        if self.services:
            body["services"] = [service.to_api() for service in self.services]
        if description:
            body["description"] = description
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        return body

    @classmethod
    def from_api(cls, body: Mapping[str, Any]) -> TemplateSpec:
        """A spec from a ``POST /templates`` body (its ``name`` and ``description`` are the caller's to pass)."""
        unknown = set(body) - SPEC_FIELDS
        if unknown:
            raise InvalidRequest("unknown_field", f"a template spec has no {sorted(unknown)[0]!r}", field=sorted(unknown)[0])
        spec = cls(str(body.get("base", "base")))
        spec.steps = [dict(step) for step in body.get("steps", [])]
        spec.services = [Service.from_api(service) for service in body.get("services", [])]
        spec.options = {key: body[key] for key in ("network_policy", "size", "timeout_s") if key in body}
        return spec

    @classmethod
    def from_file(cls, path: str | Path) -> tuple[dict[str, Any], TemplateSpec]:
        """A spec from a JSON file holding a ``POST /templates`` body: (the body's other fields, the spec)."""
        body = json.loads(Path(path).read_text())
        if not isinstance(body, dict):
            raise InvalidRequest("invalid_spec", f"{path}: a template spec is a JSON object")
        return {key: body[key] for key in ("name", "description") if key in body}, cls.from_api(body)


def raise_if_build_failed(build: TemplateBuild) -> None:
    if build.state != "failed":
        return
    error = TemplateBuildFailed(
        build.error.code if build.error else "build_failed",
        build.error.message if build.error else "the template build failed",
        details={"build": build.id, "failed_step": build.failed_step},
    )
    error.output = build.error_output
    raise error


class BuildFollower:
    """What ``fy.templates.build`` reads of a build's log stream: its lines handed to ``on_log``, its steps
    to ``on_progress``, and the build it ended as."""

    def __init__(self, on_log: Callable[[str], None] | None, on_progress: Callable[[TemplateBuild], None] | None) -> None:
        self.on_log, self.on_progress = on_log, on_progress
        self.ended: TemplateBuild | None = None

    def feed(self, line: str) -> bool:
        """One line of the stream; True once the build ended."""
        if not line.strip():
            return False
        message = json.loads(line)
        kind = message.get("type")
        if kind == "log" and self.on_log is not None:
            self.on_log(str(message.get("text", "")))
        elif kind in ("build", "end"):
            build = TemplateBuild.from_api(message["build"])
            if self.on_progress is not None:
                self.on_progress(build)
            if kind == "end":
                self.ended = build
                return True
        return False
