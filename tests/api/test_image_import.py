"""An image archive uploaded through the API becomes a snapshot of the team's: forked, built on, deleted.

The image is an OCI image layout written here as `podman save --format oci-archive` writes one (an
index, a manifest, a config and gzip layers under blobs/sha256/, tarred): the busybox root filesystem
as its first layer, a second layer that adds a file and deletes one of the first's by a whiteout,
and a config with an `Env`, a `WorkingDir` and a `User`.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandboxes.engine.template_store import build_base_rootfs
from tests.api.test_template_builds import build
from tests.support.stack import Stack, Team

pytestmark = pytest.mark.root


def _tar(files: dict[str, bytes], root: Path | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        if root is not None:
            archive.add(root, arcname=".")
        for name, data in files.items():
            member = tarfile.TarInfo(name)
            member.size, member.mode = len(data), 0o644
            archive.addfile(member, io.BytesIO(data))
    return buffer.getvalue()


def oci_archive(tmp_path: Path) -> bytes:
    """A two-layer OCI image, tarred as an oci-archive."""
    rootfs = build_base_rootfs(tmp_path / "rootfs")
    (rootfs / "etc" / "doomed").write_text("the upper layer removes this\n")
    first = _tar({}, rootfs)
    second = _tar({"etc/image-marker": b"from the image\n", "etc/.wh.doomed": b""})
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> dict[str, Any]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"digest": digest, "size": len(data)}

    layers = [gzip.compress(layer, compresslevel=1) for layer in (first, second)]
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "GREETING=from-image"], "WorkingDir": "/srv", "User": "1000"},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest() for layer in (first, second)]},
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **blob(json.dumps(config).encode())},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **blob(layer)} for layer in layers],
    }
    index = {"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", **blob(json.dumps(manifest).encode())}]}
    files = {"oci-layout": b'{"imageLayoutVersion": "1.0.0"}', "index.json": json.dumps(index).encode()}
    files |= {f"blobs/sha256/{digest.removeprefix('sha256:')}": data for digest, data in blobs.items()}
    return _tar(files)


@pytest.fixture(scope="module")
def image(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    archive = oci_archive(tmp_path_factory.mktemp("image"))
    with stack.client() as api:
        answer = api.post("/api/v1/snapshots/import", params={"name": "uploaded image"}, content=archive, timeout=120)
    assert answer.status_code == 201, answer.text
    return answer.json()


def _run(api: httpx.Client, sandbox: str, cmd: str) -> dict[str, Any]:
    ran = api.post(f"/api/v1/sandboxes/{sandbox}/exec", json={"cmd": cmd})
    assert ran.status_code == 200, ran.text
    result: dict[str, Any] = ran.json()
    return result


def test_an_uploaded_image_is_a_ready_snapshot_whose_forks_have_its_files_and_defaults(api: httpx.Client, image: dict):
    assert image["state"] == "ready" and image["name"] == "uploaded image", image
    assert image["parent"] is None and image["source_sandbox"] is None and image["template"] == image["id"]
    assert image["size_bytes"] > 100_000 and image["size_bytes"] == image["total_bytes"] and image["layer_id"]
    assert api.get(f"/api/v1/snapshots/{image['id']}").json()["state"] == "ready"
    fork = api.post("/api/v1/sandboxes", json={"snapshot": image["id"], "size": "tiny", "ttl_s": 120})
    assert fork.status_code == 201, fork.text
    try:
        ran = _run(api, fork.json()["id"], "cat /etc/image-marker; test -e /etc/doomed || echo removed; echo $GREETING; pwd; id -u")
        assert ran["stdout"] == "from the image\nremoved\nfrom-image\n/srv\n1000\n", (ran["stderr"], ran)
    finally:
        api.delete(f"/api/v1/sandboxes/{fork.json()['id']}")


def test_a_template_builds_on_an_uploaded_image(api: httpx.Client, image: dict):
    name = f"on-image-{uuid.uuid4().hex[:6]}"
    built = build(api, {"name": name, "base": f"snapshot:{image['id']}", "size": "tiny", "steps": [{"run": "echo built > /tmp/b"}]})
    assert built["state"] == "ready", built
    made = api.post("/api/v1/sandboxes", json={"template": name, "size": "tiny", "ttl_s": 120}).json()
    try:
        assert _run(api, made["id"], "cat /etc/image-marker /tmp/b")["stdout"] == "from the image\nbuilt\n"
    finally:
        api.delete(f"/api/v1/sandboxes/{made['id']}")
    assert api.delete(f"/api/v1/templates/{name}").status_code == 200


def test_another_team_does_not_see_an_uploaded_image(stack: Stack, team_b: Team, image: dict):
    with stack.client(team_b) as other:
        assert other.get(f"/api/v1/snapshots/{image['id']}").status_code == 404
        refused = other.post("/api/v1/sandboxes", json={"snapshot": image["id"], "size": "tiny"})
        assert refused.status_code == 404, refused.text


def test_what_is_no_image_is_refused_with_a_code_and_the_snapshot_failed(api: httpx.Client, tmp_path: Path):
    for body, kind in ((b"not a tar archive at all" * 100, "auto"), (_tar({"etc/x": b"y"}), "oci")):
        answer = api.post("/api/v1/snapshots/import", params={"name": "junk", "kind": kind}, content=body)
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_image", answer.text
        assert answer.json()["error"]["field"] == "body" and "staging" not in answer.text, answer.text
    failed = [row for row in api.get("/api/v1/snapshots", params={"state": "failed"}).json()["snapshots"] if row["name"] == "junk"]
    assert len(failed) >= 2 and all(row["error"]["code"] for row in failed), failed
    for params in ({}, {"name": "x", "kind": "zip"}, {"name": "x", "colour": "red"}):
        refused = api.post("/api/v1/snapshots/import", params=params, content=b"x")
        assert refused.status_code == 400, (params, refused.text)


def test_a_root_filesystem_tarball_is_an_image_too_until_it_is_deleted(api: httpx.Client):
    archive = _tar({"bin/marker": b"x"}, None)
    made = api.post("/api/v1/snapshots/import", params={"name": "tiny tree", "kind": "tar"}, content=archive)
    assert made.status_code == 201 and made.json()["state"] == "ready", made.text
    deleted = api.delete(f"/api/v1/snapshots/{made.json()['id']}")
    assert deleted.status_code == 200 and deleted.json()["state"] == "deleted", deleted.text
    gone = api.post("/api/v1/sandboxes", json={"snapshot": made.json()["id"], "size": "tiny"})
    assert gone.status_code == 404, gone.text
