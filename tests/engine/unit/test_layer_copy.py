"""A snapshot's copy of a sandbox's changes (``layers.LayerCopy``) on plain directories: its running size
and its limit follow the tree through passes that add, grow, replace and remove files."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sandboxes.engine import errors
from sandboxes.engine.layers import LayerCopy
from sandboxes.engine.trees import IdShift

SHIFT = IdShift(os.geteuid(), 65536)  # ids map to ourselves: chown is a no-op


@contextmanager
def opened(*paths: Path) -> Iterator[list[int]]:
    fds = [os.open(path, os.O_RDONLY | os.O_DIRECTORY) for path in paths]
    try:
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


def copied(source: Path, dest: Path, copy: LayerCopy) -> None:
    dest.mkdir(exist_ok=True)
    with opened(source, dest) as (source_fd, dest_fd):
        copy.sync(source_fd, dest_fd)


def fresh(source: Path, work: Path) -> LayerCopy:
    """A first pass over the tree as it is now, into a directory of its own: what any pass must agree with."""
    copy = LayerCopy(SHIFT, 1 << 30)
    copied(source, work / f"fresh-{len(list(work.iterdir()))}", copy)
    return copy


def test_the_size_and_listing_follow_the_tree_pass_after_pass(tmp_path: Path) -> None:
    source, work = tmp_path / "upper", tmp_path / "work"
    (source / "app" / "deep").mkdir(parents=True)
    work.mkdir()
    for number in range(300):
        (source / "app" / f"f{number}").write_bytes(b"x" * number)
    (source / "app" / "deep" / "big").write_bytes(b"y" * 100_000)
    copy = LayerCopy(SHIFT, 1 << 30)
    copied(source, tmp_path / "layer", copy)
    assert copy.total_bytes == sum(range(300)) + 100_000
    assert copy.files == 300 + 1 + 2  # the files and the two directories
    # Grown, shrunk, gone, turned into a symlink, and new: the next pass's figures are a fresh copy's.
    (source / "app" / "f10").write_bytes(b"z" * 5_000)
    (source / "app" / "deep" / "big").write_bytes(b"y" * 10)
    (source / "app" / "f20").unlink()
    (source / "app" / "f30").unlink()
    (source / "app" / "f30").symlink_to("f31")
    (source / "app" / "new").write_bytes(b"n" * 777)
    os.utime(source / "app" / "f10", ns=(0, 0))  # ctime still moves: the change is seen
    copied(source, tmp_path / "layer", copy)
    expected = sum(range(300)) - 10 - 20 - 30 + 5_000 + 10 + 777
    again = fresh(source, work)
    assert copy.total_bytes == again.total_bytes == expected
    assert copy.files == again.files
    assert copy.digest() == again.digest()
    # A whole directory removed takes its files' bytes with it.
    for path in (source / "app" / "deep").iterdir():
        path.unlink()
    (source / "app" / "deep").rmdir()
    copied(source, tmp_path / "layer", copy)
    assert copy.total_bytes == fresh(source, work).total_bytes == expected - 10


def test_changes_over_the_limit_are_refused_counting_what_the_copy_holds(tmp_path: Path) -> None:
    source = tmp_path / "upper"
    source.mkdir()
    for number in range(10):
        (source / f"f{number}").write_bytes(b"x" * 1_000)
    copy = LayerCopy(SHIFT, 10_500)
    copied(source, tmp_path / "layer", copy)  # 10,000 bytes: within the limit
    assert copy.total_bytes == 10_000
    (source / "f0").write_bytes(b"x" * 1_400)  # replaces its 1,000: 10,400 in all, still within
    copied(source, tmp_path / "layer", copy)
    assert copy.total_bytes == 10_400
    (source / "f1").write_bytes(b"x" * 1_200)  # 10,600: over
    with pytest.raises(errors.TooLarge):
        copied(source, tmp_path / "layer", copy)
