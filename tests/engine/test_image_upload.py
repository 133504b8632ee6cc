"""``templates.upload``: an image archive sent as the call's body, imported as a snapshot of no parent.

What the control plane's ``POST /snapshots/import`` streams to a host (tests/api/test_image_import.py
goes through the API). Here: the record, forks of it, what is left in the engine's staging directory
(nothing, whatever happened), an archive that is no image, and the size limit.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes.engine import errors
from sandboxes.engine.client import EngineClient
from tests.api.test_image_import import _tar, oci_archive
from tests.engine.engines import separate_engine
from tests.support.engine import EngineProcess

pytestmark = pytest.mark.root


def _staged(process: EngineProcess) -> list[str]:
    staging = process.config.state_dir / "staging"
    return sorted(path.name for path in staging.glob("upload-*")) if staging.exists() else []


def test_an_uploaded_image_is_a_snapshot_of_no_parent_that_forks(
    engine: EngineClient, engine_process: EngineProcess, tmp_path: Path
) -> None:
    name = f"img-{uuid.uuid4().hex[:8]}"
    record = engine.call("templates.upload", body=oci_archive(tmp_path), name=name)
    try:
        assert (record["kind"], record["parent"], len(record["layers"])) == ("snapshot", "", 1)
        assert record["total_bytes"] == record["size_bytes"] > 0 and record["workdir"] == "/srv" and record["user"] == "1000"
        assert _staged(engine_process) == []
        fork = engine.create(template=name, size="tiny", ttl_s=60)["id"]
        try:
            ran = engine.exec(fork, "cat /etc/image-marker; echo $GREETING; pwd", timeout_s=30)
            assert ran.stdout == b"from the image\nfrom-image\n/srv\n", ran
        finally:
            engine.destroy(fork)
    finally:
        engine.call("templates.delete", name=name)


@pytest.mark.parametrize("body", [b"\x00not an archive" * 64, _tar({"etc/only": b"a file"})], ids=["junk", "no-index"])
def test_an_archive_that_is_no_image_is_invalid_image_and_leaves_nothing(
    engine: EngineClient, engine_process: EngineProcess, body: bytes
) -> None:
    name = f"img-{uuid.uuid4().hex[:8]}"
    with pytest.raises(errors.InvalidImage) as raised:
        engine.call("templates.upload", body=body, name=name, kind="oci")
    assert raised.value.details["field"] == "body" and "staging" not in raised.value.message
    assert _staged(engine_process) == []
    with pytest.raises(errors.TemplateNotFound):
        engine.call("templates.get", name=name)


def test_bad_arguments_are_refused_by_field(engine: EngineClient) -> None:
    with pytest.raises(errors.InvalidRequest) as raised:
        engine.call("templates.upload", body=b"x", name="img-x", kind="zip")
    assert raised.value.details["field"] == "kind"
    with pytest.raises(errors.InvalidRequest):
        engine.call("templates.upload", body=b"x", name="Bad Name")


@pytest.fixture(scope="module")
def small_engine(work_dir: Path) -> Iterator[EngineProcess]:
    """An engine that takes images of at most 1 MiB."""
    with separate_engine(work_dir / "small-images", env={"FORKYARD_ENGINE_MAX_IMAGE_MIB": "1"}) as started:
        yield started


def test_an_archive_over_the_limit_is_too_large_and_leaves_nothing(small_engine: EngineProcess) -> None:
    with small_engine.client() as client:
        with pytest.raises(errors.TooLarge):
            client.call("templates.upload", body=(b"\x00" * (256 << 10) for _ in range(8)), name="img-big")
        assert _staged(small_engine) == []
        assert client.call("ping") is not None  # the connection's rest was read: the engine still answers
