"""The shipped environments (sandboxes/environments/*.json) are specs the API accepts, each named as its file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from console.errors import NotFound
from console.models import Team
from sandboxes.models import Template
from sandboxes.schemas import TemplateBuildIn
from sandboxes.selectors import BuildBase, build_base
from sandboxes.worker.template_builds import step_command

SPECS = sorted((Path(__file__).resolve().parents[2] / "sandboxes" / "environments").glob("*.json"))


def test_there_are_shipped_environments() -> None:
    assert {path.stem for path in SPECS} >= {"python", "node", "desktop"}


@pytest.mark.parametrize("path", SPECS, ids=lambda path: path.stem)
def test_each_is_a_spec_the_api_accepts(path: Path) -> None:
    spec = TemplateBuildIn.model_validate(json.loads(path.read_text()))
    assert spec.name == path.stem
    assert spec.base == "debian:bookworm"
    kinds = [step.kind for step in spec.steps]
    assert kinds[0] == "apt", kinds
    assert kinds[-1] == "user" or spec.services, "a shipped environment runs as a user of its own, or is a desktop"
    apt = step_command(spec.steps[0])
    assert isinstance(apt, list) and apt[:2] == ["sh", "-c"] and "apt-get install" in apt[2]
    assert apt[4:] == spec.steps[0].apt, "the packages go in as argv, never as shell text"


@pytest.mark.django_db
def test_debian_bookworm_names_the_public_debian_template(team: Team) -> None:
    with pytest.raises(NotFound) as missing:
        build_base(team, "debian:bookworm")
    assert (missing.value.code, missing.value.field) == ("template_not_found", "base")
    assert "template build-debian" in missing.value.message
    Template.objects.create(name="debian", layers=["aa11", "bb22"])
    named = build_base(team, "debian:bookworm")
    # The same base as naming the template: the same build key, so the two specs share their cached steps.
    assert named == build_base(team, "debian") == BuildBase("template:debian:aa11,bb22", {"template": "debian"})
    with pytest.raises(NotFound):
        build_base(team, "debian:trixie")  # no such template, and no alias for it
