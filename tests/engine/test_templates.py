"""Templates from a directory, a tarball and OCI images, with whiteouts applied."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from sandboxes.engine import errors

pytestmark = pytest.mark.root


def _layer(entries: dict[str, bytes | str | None], gzipped: bool = False) -> bytes:
    """A layer tar: None (or a name ending in '/') is a directory, a str a symlink."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in entries.items():
            info = tarfile.TarInfo(name.rstrip("/"))
            if isinstance(data, str):  # a symlink to data
                info.type = tarfile.SYMTYPE
                info.linkname = data
                archive.addfile(info)
            elif data is None or name.endswith("/"):
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                archive.addfile(info)
            else:
                info.size = len(data)
                info.mode = 0o755 if name.startswith("bin/") else 0o644
                archive.addfile(info, io.BytesIO(data))
    raw = buffer.getvalue()
    return gzip.compress(raw) if gzipped else raw


def _busybox_layer() -> dict[str, bytes | str | None]:
    return {"bin/": None, "bin/busybox": Path("/bin/busybox").read_bytes(), "bin/sh": "busybox"}


LOWER = {"a/": None, "a/file1": b"one", "a/file2": b"two", "b/": None, "b/x": b"x", "etc/": None, "etc/motd": b"old"}
UPPER = {"a/.wh.file1": b"", "b/.wh..wh..opq": b"", "b/y": b"y", "c/": None, "c/new": b"new", "etc/motd": b"new"}
CONFIG = {"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/bin", "GREETING=from-image"], "WorkingDir": "/a"}}


def _check_whiteouts_applied(engine, template: str) -> None:
    sandbox = engine.create(template=template, size="tiny")["id"]
    try:
        listing = engine.exec(sandbox, "/bin/busybox find /a /b /c | /bin/busybox sort").stdout.decode().split()
        assert listing == ["/a", "/a/file2", "/b", "/b/y", "/c", "/c/new"]
        assert engine.read_file(sandbox, "/etc/motd") == b"new"
        assert engine.exec(sandbox, "/bin/busybox sh -c 'echo $GREETING; pwd'").stdout == b"from-image\n/a\n"
    finally:
        engine.destroy(sandbox)


def test_oci_image_layout_directory(engine, tmp_path):
    layout = tmp_path / "layout"
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def blob(data: bytes) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    layers = [blob(_layer({**_busybox_layer(), **LOWER}, gzipped=True)), blob(_layer(UPPER, gzipped=True))]
    config = blob(json.dumps(CONFIG).encode())
    manifest = blob(
        json.dumps(
            {
                "schemaVersion": 2,
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config},
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **layer} for layer in layers],
            }
        ).encode()
    )
    (layout / "index.json").write_text(
        json.dumps({"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", **manifest}]})
    )
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    events: list[dict] = []
    record = engine.import_template("oci-layout", str(layout), on_progress=events.append)
    assert record["env"]["GREETING"] == "from-image"
    assert any(event.get("phase") == "layer" for event in events)
    _check_whiteouts_applied(engine, "oci-layout")


def test_docker_save_tarball(engine, tmp_path):
    archive_path = tmp_path / "image.tar"
    with tarfile.open(archive_path, "w") as archive:

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))

        add("one/layer.tar", _layer({**_busybox_layer(), **LOWER}))
        add("two/layer.tar", _layer(UPPER))
        add("config.json", json.dumps(CONFIG).encode())
        add(
            "manifest.json",
            json.dumps(
                [{"Config": "config.json", "RepoTags": ["test:1"], "Layers": ["one/layer.tar", "two/layer.tar"]}]
            ).encode(),
        )
    engine.import_template("docker-save", str(archive_path))
    _check_whiteouts_applied(engine, "docker-save")


def test_podman_save_of_a_real_image(engine, tmp_path):
    if shutil.which("podman") is None:
        pytest.fail("podman is not installed; scripts/bootstrap installs it")
    rootfs = tmp_path / "rootfs.tar"
    rootfs.write_bytes(_layer({**_busybox_layer(), "etc/": None, "etc/hello": b"from podman\n"}))
    tag = f"localhost/forkyard-test:{tmp_path.name[-8:].lower()}"
    subprocess.run(["podman", "import", str(rootfs), tag], check=True, capture_output=True)
    try:
        for fmt in ("oci-archive", "docker-archive"):
            saved = tmp_path / f"{fmt}.tar"
            subprocess.run(["podman", "save", "--format", fmt, "-o", str(saved), tag], check=True, capture_output=True)
            name = f"podman-{fmt.split('-')[0]}"
            engine.import_template(name, str(saved))
            sandbox = engine.create(template=name, size="tiny")["id"]
            try:
                assert engine.exec(sandbox, ["/bin/busybox", "cat", "/etc/hello"]).stdout == b"from podman\n"
            finally:
                engine.destroy(sandbox)
    finally:
        subprocess.run(["podman", "rmi", "-f", tag], capture_output=True)


def test_directory_and_tarball_sources(engine, tmp_path):
    source = tmp_path / "tree"
    (source / "bin").mkdir(parents=True)
    shutil.copy2("/bin/busybox", source / "bin" / "busybox")
    (source / "bin" / "sh").symlink_to("busybox")
    (source / "data.txt").write_text("from a directory")
    engine.import_template("from-dir", str(source))
    tarball = tmp_path / "tree.tar.gz"
    with tarfile.open(tarball, "w:gz") as archive:
        archive.add(source, arcname=".")
    engine.import_template("from-tar", str(tarball))
    for name in ("from-dir", "from-tar"):
        sandbox = engine.create(template=name, size="tiny")["id"]
        try:
            assert engine.exec(sandbox, "cat /data.txt").stdout == b"from a directory"
            assert engine.exec(sandbox, "/bin/busybox stat -c %u /data.txt").stdout.strip() == b"0"
        finally:
            engine.destroy(sandbox)


def test_hostile_image_cannot_write_outside_its_layer(engine, tmp_path):
    target = tmp_path / "outside"
    target.mkdir()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        link = tarfile.TarInfo("escape")
        link.type = tarfile.SYMTYPE
        link.linkname = str(target)
        archive.addfile(link)
        for name in ("escape/planted", f"../../../../../{target}/dotdot", str(target / "absolute")):
            info = tarfile.TarInfo(name)
            info.size = 4
            archive.addfile(info, io.BytesIO(b"evil"))
    (tmp_path / "evil.tar").write_bytes(buffer.getvalue())
    engine.import_template("hostile", str(tmp_path / "evil.tar"))
    assert list(target.iterdir()) == []


def test_template_errors(engine, tmp_path):
    with pytest.raises(errors.TemplateImportFailed):
        engine.import_template("missing", str(tmp_path / "nope"))
    (tmp_path / "garbage").write_bytes(b"not an archive at all")
    with pytest.raises(errors.TemplateImportFailed):
        engine.import_template("garbage", str(tmp_path / "garbage"))
    with pytest.raises(errors.InvalidRequest):
        engine.import_template("Bad Name!", str(tmp_path))
    with pytest.raises(errors.TemplateExists):
        engine.import_template("base", str(tmp_path))
    with pytest.raises(errors.TemplateNotFound):
        engine.call("templates.get", name="never")


def test_a_templates_default_user_runs_its_commands(engine, tmp_path):
    source = tmp_path / "with-user"
    (source / "bin").mkdir(parents=True)
    (source / "etc").mkdir()
    shutil.copy2("/bin/busybox", source / "bin" / "busybox")
    for applet in ("sh", "id"):
        (source / "bin" / applet).symlink_to("busybox")
    (source / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\ntrainer:x:1000:1000::/home/trainer:/bin/sh\n")
    record = engine.import_template("with-user", str(source), user="trainer")
    assert record["user"] == "trainer"
    sandbox = engine.create(template="with-user", size="tiny")["id"]
    try:
        # No user: the template's; a user given: that one (root included).
        assert engine.exec(sandbox, "id -u; echo $HOME").stdout == b"1000\n/home/trainer\n"
        assert engine.exec(sandbox, "id -u", user="root").stdout == b"0\n"
        # A snapshot keeps it, and so do its forks.
        snapshot = engine.call("snapshots.create", sandbox=sandbox, name="with-user-snap")
        fork = engine.create(template=snapshot["name"], size="tiny")["id"]
        try:
            assert engine.exec(fork, "id -u").stdout == b"1000\n"
        finally:
            engine.destroy(fork)
    finally:
        engine.destroy(sandbox)
    with pytest.raises(errors.InvalidRequest):
        engine.import_template("bad-user", str(source), user="not a name")


def test_an_images_user_becomes_the_default_user():
    from sandboxes.engine.template_store import TemplateStore

    assert TemplateStore._image_user({"config": {"User": "app:app"}}) == "app"
    assert TemplateStore._image_user({"config": {"User": "1000"}}) == "1000"
    assert TemplateStore._image_user({"config": {}}) == ""
    assert TemplateStore._image_user({"config": {"User": "../../x"}}) == ""
