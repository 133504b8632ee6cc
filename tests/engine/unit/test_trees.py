"""Tree operations on a plain directory: the resolution rules hold without root."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes.engine import errors
from sandboxes.engine.trees import IdShift, Tree, clean_path

SHIFT = IdShift(os.geteuid(), 65536)  # ids map to ourselves: chown is a no-op


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Tree]:
    root = tmp_path / "root"
    root.mkdir()
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    yield Tree(fd, SHIFT)
    os.close(fd)


def test_clean_path():
    assert clean_path("/a//b/./c/") == "a/b/c"
    assert clean_path("/") == "."
    with pytest.raises(errors.InvalidPath):
        clean_path("a\0b")
    with pytest.raises(errors.InvalidPath):
        clean_path("")


def test_absolute_symlink_resolves_inside_the_root(tree: Tree, tmp_path: Path):
    outside = tmp_path / "outside.txt"
    outside.write_text("host")
    root = tmp_path / "root"
    (root / "link").symlink_to(str(outside))
    with pytest.raises(errors.FileNotFound):
        tree.read_bytes("/link", 100)
    (root / str(outside).lstrip("/")).parent.mkdir(parents=True)
    (root / str(outside).lstrip("/")).write_text("inside")
    assert tree.read_bytes("/link", 100) == b"inside"
    tree.write("/link", b"rewritten")
    assert outside.read_text() == "host"


def test_tar_round_trip_keeps_links_and_modes(tree: Tree, tmp_path: Path):
    tree.make_directories("/src/pkg")
    tree.write("/src/pkg/run", b"#!/bin/sh\n", mode=0o755)
    tree.symlink("/src/latest", "pkg/run")
    data = b"".join(tree.tar_chunks("/src"))
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        members = {member.name: member for member in archive.getmembers()}
    assert members["src/pkg/run"].mode == 0o755
    assert members["src/latest"].linkname == "pkg/run"
    tree.extract(io.BytesIO(data), "/copy")
    assert (tmp_path / "root/copy/src/pkg/run").read_bytes() == b"#!/bin/sh\n"
    assert os.readlink(tmp_path / "root/copy/src/latest") == "pkg/run"


def test_oci_whiteouts_hide_lower_content_only(tree: Tree):
    tree.make_directories("/a")
    tree.write("/a/gone", b"lower")
    tree.write("/a/kept", b"lower")
    tree.make_directories("/opaque")
    tree.write("/opaque/old", b"lower")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in (("a/.wh.gone", b""), ("opaque/.wh..wh..opq", b""), ("opaque/new", b"upper")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    raw = buffer.getvalue()
    assert tree.oci_whiteouts(io.BytesIO(raw)) == 2
    counts = tree.extract(io.BytesIO(raw), ".", oci_whiteouts=True)
    assert counts["whiteouts"] == 2 and counts["files"] == 1
    assert [entry["name"] for entry in tree.list("/a")["entries"]] == ["kept"]
    assert [entry["name"] for entry in tree.list("/opaque")["entries"]] == ["new"]


def test_remove_refuses_to_cross_into_another_mount(tree: Tree):
    # /proc is another mount: a tree rooted at / must not descend into it.
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY)
    try:
        with pytest.raises(errors.InvalidPath):
            Tree(fd, SHIFT).stat("/proc/self/status")
    finally:
        os.close(fd)
