"""The root filesystem steps, recorded without root on a fake tree."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandboxes.engine import rootfs
from sandboxes.engine.kernel import MS_BIND, MS_PRIVATE, MS_RDONLY, MS_REC, MS_REMOUNT, RecordingKernel


class ResolvingKernel(RecordingKernel):
    """Records mounts with their targets resolved (they are /proc/self/fd paths)."""

    def mount(self, source, target, fstype, flags=0, data=None):  # type: ignore[no-untyped-def]
        self.calls.append(("mount", source, os.path.realpath(target), fstype, flags, data))


@pytest.fixture
def fake_tree(tmp_path: Path) -> rootfs.RootfsSpec:
    layers = tmp_path / "layers"
    (layers / "base" / "etc").mkdir(parents=True)
    for directory in ("scratch", "root"):
        (tmp_path / directory).mkdir()
    for directory in ("proc", "sys", "dev", "tmp"):
        (tmp_path / "root" / directory).mkdir()
    return rootfs.RootfsSpec(str(layers), ("snap", "base"), str(tmp_path / "scratch"), str(tmp_path / "root"), 1 << 20)


@pytest.fixture(autouse=True)
def keep_cwd():
    cwd = os.getcwd()
    yield
    os.chdir(cwd)


def test_steps_run_in_the_documented_order(fake_tree: rootfs.RootfsSpec):
    kernel = ResolvingKernel()
    upper_fd = rootfs.build(kernel, fake_tree)
    os.close(upper_fd)
    root = fake_tree.root_dir
    mounts = [call for call in kernel.calls if call[0] == "mount"]
    assert mounts[0] == ("mount", None, "/", None, MS_REC | MS_PRIVATE, None)
    assert mounts[1][2:4] == (fake_tree.scratch_dir, "tmpfs")
    assert f"size={1 << 20}" in mounts[1][5]
    overlay = mounts[2]
    assert overlay[2:4] == (root, "overlay")
    assert overlay[5].startswith("lowerdir=snap:base,upperdir=") and overlay[5].endswith(",userxattr")
    targets = [(call[2], call[3]) for call in mounts[3:]]
    assert (f"{root}/proc", "proc") in targets
    assert (f"{root}/sys", "sysfs") in targets
    assert (f"{root}/dev", "tmpfs") in targets
    sysfs = next(call for call in mounts if call[3] == "sysfs")
    assert sysfs[4] & MS_RDONLY
    # The last steps: pivot into the new root, detach the old one.
    assert kernel.calls[-2:] == [("pivot_root", ".", "."), ("umount", ".", 2)]


def test_tmp_and_root_are_created_with_safe_modes(fake_tree: rootfs.RootfsSpec):
    os.rmdir(Path(fake_tree.root_dir) / "tmp")
    os.close(rootfs.build(RecordingKernel(), fake_tree))
    assert (Path(fake_tree.root_dir) / "tmp").stat().st_mode & 0o7777 == 0o1777
    assert (Path(fake_tree.root_dir) / "root").stat().st_mode & 0o7777 == 0o700


@pytest.mark.parametrize("target", ["proc", "dev", "sys"])
def test_a_symlinked_mount_target_is_refused(fake_tree: rootfs.RootfsSpec, target: str):
    (Path(fake_tree.root_dir) / target).rmdir()
    (Path(fake_tree.root_dir) / target).symlink_to("/")
    kernel = RecordingKernel()
    with pytest.raises(rootfs.RootfsError) as raised:
        rootfs.build(kernel, fake_tree)
    assert raised.value.target == f"/{target}"


def test_a_mount_target_that_is_a_file_is_refused(fake_tree: rootfs.RootfsSpec):
    (Path(fake_tree.root_dir) / "proc").rmdir()
    (Path(fake_tree.root_dir) / "proc").write_text("not a directory")
    with pytest.raises(rootfs.RootfsError):
        rootfs.build(RecordingKernel(), fake_tree)


def test_read_only_remounts_repeat_the_locked_flags(fake_tree: rootfs.RootfsSpec):
    # Pretend the new proc has /proc/sys, as a real one would.
    (Path(fake_tree.root_dir) / "proc" / "sys").mkdir()
    kernel = RecordingKernel()
    os.close(rootfs.build(kernel, fake_tree))
    remounts = [call for call in kernel.calls if call[0] == "mount" and call[4] & MS_REMOUNT]
    assert remounts, "no read-only remount of /proc/sys"
    for call in remounts:
        assert call[4] & MS_BIND and call[4] & MS_RDONLY and call[4] & rootfs.LOCKED == rootfs.LOCKED
