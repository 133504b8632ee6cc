"""The root filesystem plan: the exact sequence of mounts, checked without root.

The plan is data that native/confine.c runs step by step; what the C does
with each step against the real kernel is checked by tests/engine/test_create.py.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from sandboxes.engine import rootfs, zygote
from sandboxes.engine.kernel import MS_BIND, MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_PRIVATE, MS_RDONLY, MS_REC, MS_REMOUNT

SPEC = rootfs.RootfsSpec(
    layers_dir="/state/layers",
    lower=("snap", "base"),
    scratch_dir="/state/mnt/scratch",
    root_dir="/state/mnt/root",
    disk_bytes=1 << 20,
    dev_dir="/state/dev",
    empty_dir="/state/mnt/empty",
)


def _where(step: rootfs.Step) -> str:
    """A step's target as the sandbox (relative) or the host (absolute) names it."""
    if step.target.startswith("/"):
        return step.target
    return "/" + "/".join(part for part in (step.within, step.target) if part)


def test_steps_run_in_the_documented_order():
    steps = [(step.op, _where(step), step.fstype or step.source) for step in rootfs.plan(SPEC)]
    assert steps == [
        ("mount", "/", ""),
        ("mount", "/state/mnt/scratch", "tmpfs"),
        ("mkdir", "/state/mnt/scratch/upper", ""),
        ("mkdir", "/state/mnt/scratch/work", ""),
        ("mkdir", "/state/mnt/scratch/shm", ""),
        ("keep-layer", "/state/mnt/scratch/upper", ""),
        ("attach-layers", "/state/mnt/scratch/lower", ""),
        ("chdir", "/state/mnt/scratch/lower", ""),
        ("mount", "/state/mnt/root", "overlay"),
        ("enter-root", "/state/mnt/root", ""),
        ("mount", "/proc", "proc"),
        ("mount", "/sys", "sysfs"),
        ("mount", "/dev", "/state/dev"),
        ("mount", "/dev/pts", "devpts"),
        ("bind-remount", "/dev/shm", "/state/mnt/scratch/shm"),
        ("mount", "/dev/mqueue", "mqueue"),
        *[("mount", f"/proc/{name}", "/dev/null") for name in rootfs.MASKED_PROC_FILES],
        ("mount", "/sys/kernel/vmcoreinfo", "/dev/null"),
        *[("bind-remount", f"/proc/{name}", "") for name in rootfs.READ_ONLY_PROC],
        ("bind-remount", "/proc/acpi", "/state/mnt/empty"),
        ("bind-remount", "/proc/scsi", "/state/mnt/empty"),
        ("bind-remount", "/proc/asound", "/state/mnt/empty"),
        ("bind-remount", "/proc/driver", "/state/mnt/empty"),
        ("bind-remount", "/sys/firmware", "/state/mnt/empty"),
        ("mkdir", "/tmp", ""),
        ("mkdir", "/root", ""),
        ("pivot", "/", ""),
    ]


def test_mounts_are_private_before_anything_is_mounted():
    first = rootfs.plan(SPEC)[0]
    assert (first.op, first.target, first.flags) == ("mount", "/", MS_REC | MS_PRIVATE)


def test_scratch_is_sized_to_the_disk_and_holds_the_overlay_layers():
    steps = rootfs.plan(SPEC)
    scratch = steps[1]
    assert scratch.data == f"size={1 << 20},nr_inodes=4096,mode=0755" and scratch.flags == MS_NOSUID | MS_NODEV
    overlay = next(step for step in steps if step.fstype == "overlay")
    assert overlay.data == ("lowerdir=0:1,upperdir=/state/mnt/scratch/upper,workdir=/state/mnt/scratch/work,userxattr")
    # Lower layers are the zygote's idmapped mounts, attached as lower/0 (the
    # topmost, "snap") and lower/1 ("base"): the child enters lower first.
    attach = next(step for step in steps if step.op == "attach-layers")
    chdir = next(step for step in steps if step.op == "chdir")
    assert (attach.target, chdir.target) == ("/state/mnt/scratch/lower", "/state/mnt/scratch/lower")
    assert steps.index(attach) < steps.index(chdir) < steps.index(overlay)
    assert rootfs.layer_paths(SPEC) == ("/state/layers/snap", "/state/layers/base")


def test_every_target_in_the_new_root_is_relative_and_needs_no_symlink():
    steps = rootfs.plan(SPEC)
    root = [step.op for step in steps].index("enter-root")
    for step in steps[root + 1 : -1]:
        assert step.target and not step.target.startswith("/") and ".." not in step.target.split("/"), step
        assert not step.within.startswith("/"), step


def test_proc_sys_and_dev_are_created_if_absent_and_masks_skipped():
    by_where = {_where(step): step for step in rootfs.plan(SPEC)}
    for created in ("/proc", "/sys", "/dev", "/dev/pts", "/dev/mqueue"):
        assert (by_where[created].missing, by_where[created].mode) == ("create", 0o755), created
    for name in rootfs.MASKED_PROC_FILES:
        assert by_where[f"/proc/{name}"].missing == "skip"
    assert by_where["/proc/kcore"].flags == MS_BIND


def test_proc_is_locked_down_and_sys_read_only():
    by_where = {_where(step): step for step in rootfs.plan(SPEC)}
    assert by_where["/proc"].flags == rootfs.LOCKED
    assert by_where["/sys"].flags == MS_RDONLY | rootfs.LOCKED
    for hidden in ("/proc/acpi", "/sys/firmware"):
        assert (by_where[hidden].source, by_where[hidden].missing) == ("/state/mnt/empty", "skip")
        assert by_where[hidden].flags == MS_REMOUNT | MS_BIND | MS_RDONLY | rootfs.LOCKED


def test_remounts_repeat_the_locked_flags():
    remounts = [step for step in rootfs.plan(SPEC) if step.op == "bind-remount"]
    assert [step.target for step in remounts if not step.source] == list(rootfs.READ_ONLY_PROC)
    for step in remounts:
        read_only = 0 if step.target == "shm" else MS_RDONLY
        assert step.flags == MS_REMOUNT | MS_BIND | read_only | MS_NOSUID | MS_NODEV | MS_NOEXEC


def test_tmp_and_root_are_created_with_safe_modes():
    modes = {step.target: step.mode for step in rootfs.plan(SPEC) if step.op == "mkdir"}
    assert modes["tmp"] == 0o1777
    assert modes["root"] == 0o700
    assert modes["/state/mnt/scratch/work"] == 0o700


def test_the_plan_ends_in_the_new_root():
    assert rootfs.plan(SPEC)[-1] == rootfs.Step("pivot")


def test_the_plan_is_encoded_as_nine_fields_a_step():
    raw = zygote.encoded_plan(SPEC)
    fields = raw.split(b"\0")
    assert fields[-1] == b""  # every field ends in NUL
    count = int(fields[0])
    assert count == len(rootfs.plan(SPEC)) and len(fields) - 2 == 9 * count
    assert fields[1:10] == [b"mount", b"", b"/", b"", b"", b"", str(MS_REC | MS_PRIVATE).encode(), b"0", b"fail"]


def test_a_nul_byte_cannot_shift_the_fields():
    with pytest.raises(ValueError):
        zygote.encode_spawn(1, "sb-x\0evil", 0, 1, 0, 1, (), (), b"")
    with pytest.raises(ValueError):
        zygote.encode_spawn(1, "sb-x", 0, 1, 0, 1, (), ("/layers/a\0/etc",), b"")
    with pytest.raises(ValueError):
        zygote.encoded_plan(SPEC._replace(dev_dir="/state/dev\0/"))


def test_replies_and_reports_decode_to_the_engine_error_shape():
    assert zygote.decode_reply(b"ok\x007\x00123\x00") == zygote.Reply(7, 123, None)
    reply = zygote.decode_reply(b"error\x007\x00123\x00place in cgroup\x002\x00/sys/x/cgroup.procs\x00")
    assert reply.error == {
        "step": "place in cgroup",
        "errno": 2,
        "target": "/sys/x/cgroup.procs",
        "message": "place in cgroup failed on /sys/x/cgroup.procs: No such file or directory",
    }
    report = zygote.decode_report(b"Ebuild root filesystem: open mount target\x0040\x00/proc\x00")
    assert (report["step"], report["errno"], report["target"]) == ("build root filesystem: open mount target", 40, "/proc")
    with pytest.raises(ValueError):
        zygote.decode_reply(b"ok\x007")


def test_shared_memory_is_a_directory_of_the_scratch_not_a_filesystem_of_its_own():
    # Every superblock costs every memory cgroup on the host a shrinker slot.
    by_where = {_where(step): step for step in rootfs.plan(SPEC)}
    shm = by_where["/dev/shm"]
    assert (shm.op, shm.source, shm.fstype) == ("bind-remount", "/state/mnt/scratch/shm", "")
    assert shm.flags == MS_REMOUNT | MS_BIND | rootfs.LOCKED and not shm.flags & MS_RDONLY
    assert by_where["/state/mnt/scratch/shm"].mode == 0o1777
    filesystems = [step.fstype for step in rootfs.plan(SPEC) if step.op == "mount" and step.fstype]
    assert filesystems == ["tmpfs", "overlay", "proc", "sysfs", "devpts", "mqueue"]


def test_sys_is_the_hosts_shared_sysfs_bound_read_only_when_the_engine_has_one():
    # The engine's (prepare_sys): no sysfs superblock per sandbox, and none for the kernel to look through.
    steps = rootfs.plan(SPEC._replace(sys_dir="/state/sys"))
    sys = {_where(step): step for step in steps}["/sys"]
    assert (sys.op, sys.source, sys.fstype, sys.missing) == ("bind-remount", "/state/sys", "", "create")
    assert sys.flags == MS_REMOUNT | MS_BIND | MS_RDONLY | rootfs.LOCKED
    assert [step.fstype for step in steps if step.op == "mount" and step.fstype] == ["tmpfs", "overlay", "proc", "devpts", "mqueue"]
    # What is masked in it is masked in the bind, as in a sysfs of its own.
    assert [_where(step) for step in steps if step.within == "sys"] == ["/sys/kernel/vmcoreinfo", "/sys/firmware"]


# --- the sandbox's /etc/hosts ----------------------------------------------------------

HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"


def test_the_hosts_file_is_a_layer_of_the_scratch_above_the_templates():
    steps = rootfs.plan(SPEC._replace(hosts=HOSTS, etc_mode=0o750))
    hosts = next(step for step in steps if step.op == "hosts")
    attach = next(step for step in steps if step.op == "attach-layers")
    overlay = next(step for step in steps if step.fstype == "overlay")
    assert steps.index(attach) < steps.index(hosts) < steps.index(overlay)
    assert (hosts.target, hosts.mode) == ("/state/mnt/scratch/lower/hosts", 0o750)
    # The file: the text, the hostname (the C adds it), the line's end marking it as the engine's.
    assert (hosts.data, hosts.source) == (HOSTS + "127.0.1.1\t", "\t# this sandbox's hostname (forkyard)\n")
    assert overlay.data.startswith("lowerdir=hosts:0:1,")
    # No mount of its own: the same mounts as a plan without it.
    assert sum(step.op == "mount" for step in steps) == sum(step.op == "mount" for step in rootfs.plan(SPEC))


def _layer(root: Path, files: dict[str, str | bytes | None]) -> str:
    """A layer directory: None makes a directory, a str starting with '->' a symlink."""
    root.mkdir()
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            path.mkdir(exist_ok=True)
        elif isinstance(content, str) and content.startswith("->"):
            path.symlink_to(content[2:])
        else:
            path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(root)


def _text(*layers: str) -> str:
    made = rootfs.template_hosts(layers, os.getuid())
    assert made is not None
    return made.text


def test_a_template_without_etc_hosts_gets_the_loopback_lines_and_keeps_its_etc_mode(tmp_path: Path):
    assert rootfs.template_hosts([_layer(tmp_path / "none", {"bin": None})], os.getuid()) == (HOSTS, 0o755)
    layer = _layer(tmp_path / "etc", {"etc": None})
    os.chmod(Path(layer) / "etc", 0o711)
    assert rootfs.template_hosts([layer], os.getuid()) == (HOSTS, 0o711)


def test_a_templates_file_is_kept_with_the_loopback_line_it_lacks_first(tmp_path: Path):
    layer = _layer(tmp_path / "t", {"etc/hosts": "# mine\n127.0.0.1 localhost box\n10.0.0.5 db"})
    assert _text(layer) == "::1\tlocalhost ip6-localhost ip6-loopback\n# mine\n127.0.0.1 localhost box\n10.0.0.5 db\n"
    # "localhost" in a comment is no localhost line.
    commented = _layer(tmp_path / "c", {"etc/hosts": "127.0.0.1 box # localhost\n::1 localhost\n"})
    assert _text(commented) == "127.0.0.1\tlocalhost\n127.0.0.1 box # localhost\n::1 localhost\n"


def test_a_parents_hostname_line_is_dropped(tmp_path: Path):
    parent = HOSTS + "10.0.0.5 db\n127.0.1.1\tsb-parent\t# this sandbox's hostname (forkyard)\n"
    assert _text(_layer(tmp_path / "snap", {"etc/hosts": parent})) == HOSTS + "10.0.0.5 db\n"


def test_the_topmost_layer_decides_and_an_opaque_etc_hides_the_ones_below(tmp_path: Path):
    lower = _layer(tmp_path / "lower", {"etc/hosts": "127.0.0.1 localhost lower\n::1 localhost\n"})
    upper = _layer(tmp_path / "upper", {"etc/hosts": "127.0.0.1 localhost upper\n::1 localhost\n"})
    middle = _layer(tmp_path / "middle", {"etc/motd": "hi"})
    assert _text(upper, middle, lower) == "127.0.0.1 localhost upper\n::1 localhost\n"
    assert _text(middle, lower) == "127.0.0.1 localhost lower\n::1 localhost\n"
    opaque = _layer(tmp_path / "opaque", {"etc": None})
    try:
        os.setxattr(Path(opaque) / "etc", "user.overlay.opaque", b"y")
    except OSError:
        pytest.skip("no user xattrs here")
    assert _text(opaque, lower) == HOSTS


@pytest.mark.skipif(os.geteuid() != 0, reason="a whiteout is a device node: making one needs root")
def test_a_whiteout_hides_the_file_below(tmp_path: Path):
    lower = _layer(tmp_path / "lower", {"etc/hosts": "127.0.0.1 localhost lower\n"})
    deleted = _layer(tmp_path / "deleted", {"etc": None})
    os.mknod(Path(deleted) / "etc" / "hosts", 0o600 | stat.S_IFCHR, 0)
    assert _text(deleted, lower) == HOSTS


def test_a_symlink_or_other_entry_is_never_followed(tmp_path: Path):
    outside = tmp_path / "outside"
    outside.write_text("127.0.0.1 localhost outside\n")
    assert _text(_layer(tmp_path / "linked", {"etc/hosts": f"->{outside}"})) == HOSTS  # replaced, not read through
    fifo = _layer(tmp_path / "fifo", {"etc": None})
    os.mkfifo(Path(fifo) / "etc" / "hosts")
    assert _text(fifo) == HOSTS  # and never waited on
    # /etc itself a symlink, or hosts a directory: left as the template has them.
    etc_link = _layer(tmp_path / "etc-link", {"usr/etc/hosts": "127.0.0.1 localhost\n", "etc": "->usr/etc"})
    assert rootfs.template_hosts([etc_link], os.getuid()) is None
    assert rootfs.template_hosts([_layer(tmp_path / "dir", {"etc/hosts": None})], os.getuid()) is None


def test_a_file_too_long_is_left_alone_and_one_not_text_replaced(tmp_path: Path):
    long = "127.0.0.1 localhost\n" + "10.0.0.1 name\n" * 300
    assert rootfs.template_hosts([_layer(tmp_path / "long", {"etc/hosts": long})], os.getuid()) is None
    assert _text(_layer(tmp_path / "binary", {"etc/hosts": b"127.0.0.1 localhost\0\xff\n"})) == HOSTS


def test_an_etc_another_user_owns_is_left_alone(tmp_path: Path):
    layer = _layer(tmp_path / "t", {"etc/hosts": "127.0.0.1 localhost\n"})
    assert rootfs.template_hosts([layer], os.getuid() + 1) is None


def test_a_resolv_conf_needs_the_hosts_layer_it_is_written_into() -> None:
    """The child writes a spawn's resolv.conf beside its /etc/hosts: a spec with the one and not the other is
    refused when parsed, never spawned with the file silently missing."""
    from sandboxes.engine.spawner import SpawnSpec

    raw = {"sandbox_id": "sb-x", "uid_base": 0, "uid_count": 1, "cgroup_procs": [], "socket_path": "/run/x.sock"}
    rootfs_spec = {**SPEC._asdict(), "lower": list(SPEC.lower)}
    resolv = "nameserver 198.19.0.0\n"
    assert SpawnSpec({**raw, "rootfs": {**rootfs_spec, "hosts": "127.0.0.1 localhost\n"}, "resolv": resolv}).resolv == resolv
    assert SpawnSpec({**raw, "rootfs": rootfs_spec}).resolv == ""
    with pytest.raises(ValueError, match="beside the hosts file"):
        SpawnSpec({**raw, "rootfs": rootfs_spec, "resolv": resolv})


def test_the_shared_sysfs_found_mounted_is_kept_and_a_failure_to_mount_is_an_oserror(tmp_path: Path, monkeypatch):
    directory = tmp_path / "sys"
    table = tmp_path / "mountinfo"
    table.write_text(f"74 27 0:69 / {os.path.realpath(tmp_path)}/sys ro,nosuid,nodev,noexec - sysfs {rootfs.SYS_SOURCE} ro\n")
    assert rootfs.prepare_sys(str(directory), str(table)) is False  # a restart: nothing is run
    table.write_text("")
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))  # no unshare, no mount
    with pytest.raises(OSError):  # which the engine takes for "a sysfs each" (engine.start)
        rootfs.prepare_sys(str(directory), str(table))
