"""An image archive imported through the SDK (sync from a path, async from bytes) and the CLI."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from forkyard import AsyncClient, Client, InvalidRequest
from tests.api.test_image_import import _tar, oci_archive
from tests.sdk.conftest import Run
from tests.support.stack import Stack

pytestmark = pytest.mark.root


def test_import_an_image_from_a_path_and_fork_it(fy: Client, tmp_path: Path) -> None:
    archive = tmp_path / "image.tar"
    archive.write_bytes(oci_archive(tmp_path))
    snap = fy.snapshots.import_image(archive, name="from a path")
    try:
        assert snap.ready and snap.parent is None and snap.source_sandbox is None and snap.size_bytes > 0
        sandbox = fy.sandboxes.create(snapshot=snap.id, size="tiny", ttl_s=120)
        try:
            assert sandbox.exec("cat /etc/image-marker; pwd").stdout == "from the image\n/srv\n"
        finally:
            sandbox.kill(wait=True)
    finally:
        fy.snapshots.delete(snap.id)
    with pytest.raises(InvalidRequest) as refused:
        fy.snapshots.import_image(b"no image here" * 10, name="junk", kind="oci")
    assert refused.value.code == "invalid_image"


def test_import_an_image_with_the_async_client(stack: Stack) -> None:
    async def main() -> tuple[bool, str]:
        async with AsyncClient(stack.url, stack.teams[0].key) as fy:
            snap = await fy.snapshots.import_image(_tar({"etc/tree-marker": b"a tree\n"}), name="a tree", kind="tar")
            await fy.snapshots.delete(snap.id)
            return snap.ready, snap.template

    ready, template = asyncio.run(main())
    assert ready and template.startswith("snap_")


def test_the_cli_imports_an_image(cli: Run, tmp_path: Path) -> None:
    archive = tmp_path / "tree.tar"
    archive.write_bytes(_tar({"etc/cli-marker": b"cli\n"}))
    done = cli("snapshots", "import", str(archive), "--name", "cli image", "--kind", "tar", "--json")
    assert done.returncode == 0, done.stderr
    snapshot = json.loads(done.stdout)
    assert snapshot["state"] == "ready" and snapshot["name"] == "cli image"
    assert cli("snapshots", "delete", snapshot["id"]).returncode == 0
    missing = cli("snapshots", "import", str(tmp_path / "absent.tar"), "--name", "x")
    assert missing.returncode != 0 and "Traceback" not in missing.stderr, missing.stderr
