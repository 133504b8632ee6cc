"""Fixtures shared by the whole suite.

Tests that create real sandboxes need root (namespaces, mounts, cgroups); they
are marked ``root`` and check for it.  Under CI (``FORKYARD_CI=1``) a missing
privilege is a failure, never a silent skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandboxes.engine.client import EngineClient
from tests.support.engine import EngineProcess
from tests.support.grading import deploy, offer_tiny_model
from tests.support.stack import Stack, running_stack
from tests.support.stack import Team as StackTeam

IS_ROOT = os.geteuid() == 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if IS_ROOT:
        return
    if os.environ.get("FORKYARD_CI"):
        raise pytest.UsageError("FORKYARD_CI is set but the suite is not running as root: the kernel tests would not run")
    skip = pytest.mark.skip(reason="needs root: creates namespaces, mounts and cgroups")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def work_dir() -> Iterator[Path]:
    # Short paths: Unix socket paths are limited to 108 bytes.
    directory = Path(tempfile.mkdtemp(prefix="fy-", dir="/tmp"))
    os.chmod(directory, 0o755)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def engine_process(work_dir: Path) -> Iterator[EngineProcess]:
    engine = EngineProcess(work_dir / "engine")
    engine.start()
    with engine.client() as client:
        client.call("templates.build_base", name="base", replace=True)
    yield engine
    engine.reclaim()


@pytest.fixture
def engine(engine_process: EngineProcess) -> Iterator[EngineClient]:
    with engine_process.client() as client:
        yield client


@pytest.fixture
def sandbox(engine: EngineClient) -> Iterator[str]:
    created = engine.create(template="base", size="tiny", ttl_s=600)
    yield created["id"]
    engine.destroy(created["id"])


@pytest.fixture(scope="session")
def probe_binary(work_dir: Path) -> Path:
    """The probe, built static so that it runs in the busybox template."""
    source = Path(__file__).parent / "probe" / "probe.c"
    output = work_dir / "probe"
    compiler = ["musl-gcc"] if shutil.which("musl-gcc") else ["gcc"]
    subprocess.run(compiler + ["-static", "-O1", "-o", str(output), str(source)], check=True)
    return output


@pytest.fixture(scope="session")
def stack(work_dir: Path) -> Iterator[Stack]:
    """The whole product: engine, worker, web server, database (see tests/support/stack.py)."""
    with running_stack(Stack(work_dir / "stack")) as started:
        yield started


@pytest.fixture
def api(stack: Stack) -> Iterator[httpx.Client]:
    """An HTTP client for team A, with its admin key."""
    with stack.client() as client:
        yield client


@pytest.fixture
def running(api: httpx.Client) -> Iterator[str]:
    """The id of a running tiny sandbox of team A, destroyed afterwards."""
    sandbox = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600}).json()
    yield sandbox["id"]
    api.delete(f"/api/v1/sandboxes/{sandbox['id']}")


@pytest.fixture(scope="session")
def team_b(stack: Stack) -> StackTeam:
    return stack.new_team("Team B")


@pytest.fixture(scope="session")
def tiny_model(stack: Stack, work_dir: Path) -> Path:
    """The tiny random model (tests/support/tiny_model.py), offered by the operator for dedicated endpoints."""
    return offer_tiny_model(stack, work_dir / "models")


@pytest.fixture(scope="session")
def judge(stack: Stack, tiny_model: Path) -> Iterator[dict[str, Any]]:
    """Team A's dedicated endpoint serving the tiny model (ready), deleted at the end of the session."""
    with stack.client() as api:
        endpoint = deploy(api, "judge-a")
        yield endpoint
        api.delete(f"/api/v1/endpoints/{endpoint['id']}")
