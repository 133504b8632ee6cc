"""Host preflight on a fake /proc tree: what max_sandboxes needs of each limit, what is raised, what is left to set.

No root: the tree is files of our own (``EngineConfig.proc_dir``); the real
/proc is checked in tests/engine/test_preflight.py.
"""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from sandboxes.engine import preflight
from sandboxes.engine.config import EngineConfig

SYSCTLS = {
    "kernel/pid_max": 32_768,
    "kernel/threads-max": 100_000,
    "fs/file-max": 1_000_000,
    "fs/file-nr": "3000\t0\t1000000",
    "fs/nr_open": 1_048_576,
    "fs/inotify/max_user_instances": 128,
    "fs/inotify/max_user_watches": 8_192,
    "net/ipv4/neigh/default/gc_thresh1": 128,
    "net/ipv4/neigh/default/gc_thresh2": 512,
    "net/ipv4/neigh/default/gc_thresh3": 1_024,
    "net/netfilter/nf_conntrack_max": 262_144,
    "net/netfilter/nf_conntrack_count": 100,
    **{f"user/max_{namespace}_namespaces": 20_000 for namespace in preflight.NAMESPACES},
}


def fake_proc(tmp_path: Path, tasks: int = 400, memory_cgroups: int = 300, **overrides: int | str) -> Path:
    proc = tmp_path / "proc"
    for name, value in {**SYSCTLS, **overrides}.items():
        path = proc / "sys" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{value}\n")
    (proc / "loadavg").write_text(f"0.50 0.40 0.30 3/{tasks} 12345\n")
    (proc / "cgroups").write_text(
        f"#subsys_name\thierarchy\tnum_cgroups\tenabled\ncpu\t1\t90\t1\nmemory\t4\t{memory_cgroups}\t1\npids\t8\t90\t1\n"
    )
    return proc


def sysctl(proc: Path, name: str) -> int:
    return int((proc / "sys" / name).read_text().split()[0])


def config(proc: Path, max_sandboxes: int, network_pool: str = "198.19.0.0/16") -> EngineConfig:
    return EngineConfig(proc_dir=proc, max_sandboxes=max_sandboxes, network_pool=network_pool)


def by_name(report: preflight.Report) -> dict[str, preflight.Finding]:
    return {finding.name: finding for finding in report.findings}


def test_what_max_sandboxes_needs_of_each_limit(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, tasks=400, memory_cgroups=300)
    report = preflight.check(config(proc, 30_000), live=1_000)
    found = by_name(report)
    # Counted by the kernel: what is in use, plus two tasks for each sandbox still to come.
    pid_max = found["kernel.pid_max"]
    assert (pid_max.in_use, pid_max.need, pid_max.status) == (400, 400 + 2 * 29_000, preflight.SHORT)
    assert pid_max.fits == 1_000 + (32_768 - 400) // 2
    assert found["kernel.threads-max"].status == preflight.OK
    assert found["memory cgroup ids"].need == 300 + 29_000
    assert found["memory cgroup ids"].fits == 1_000 + 65_535 - 300
    assert found["fs.file-max"].need == 3_000 + 16 * 29_000
    # Per user, and each sandbox is a user of its own: what one needs, however many there are.
    assert found["user.max_net_namespaces"].need == 1 and found["user.max_net_namespaces"].status == preflight.OK
    assert found["user.max_net_namespaces"].fits == 30_000
    assert found["fs.inotify.max_user_instances"].need == 1 and found["fs.inotify.max_user_watches"].need == 64
    # Not counted by the kernel: a reserve for the host's own use, plus the allowance for every sandbox.
    assert found["fs.nr_open"].need == 8_192 + 2 * 30_000
    # The network's limits only once sandboxes have networks.
    assert not any(name.startswith("net.") for name in found)
    # pid_max bounds it most (before raising): 17,184 fit.
    assert (report.fits, report.limiting) == (1_000 + (32_768 - 400) // 2, "kernel.pid_max")
    assert not found["fs.inotify.max_user_instances"].caps, "inotify bounds what sandboxes do, not how many fit"
    to_set = report.to_dict()["to_set"]
    assert "sysctl -w kernel.pid_max=4194304 (and in /etc/sysctl.d/ to keep it): 30,000 sandboxes need 58,400" in to_set[0]


def test_a_per_user_limit_of_zero_lets_no_sandbox_be_made(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, **{"user/max_net_namespaces": 0})
    cfg = config(proc, 100)
    report = preflight.check(cfg)
    net = by_name(report)["user.max_net_namespaces"]
    assert (net.status, net.fits, report.fits, report.limiting) == (preflight.SHORT, 0, 0, "user.max_net_namespaces")
    assert "each sandbox, a user of its own, needs 1 (one net namespace)" in net.how
    assert by_name(preflight.raise_short(report, cfg))["user.max_net_namespaces"].status == preflight.RAISED
    assert sysctl(proc, "user/max_net_namespaces") == 1


def test_what_fits_is_max_sandboxes_when_every_limit_holds(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path)
    report = preflight.check(config(proc, 100), uid_ranges=50_000)
    assert report.short == []
    assert (report.fits, report.limiting) == (100, "max_sandboxes")


def test_raising_what_is_short_and_nothing_else(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, **{"fs/nr_open": 5_000_000, "kernel/threads-max": 50_000})
    cfg = config(proc, 30_000)
    report = preflight.raise_short(preflight.check(cfg), cfg)
    found = by_name(report)
    assert found["kernel.pid_max"].status == preflight.RAISED
    assert sysctl(proc, "kernel/pid_max") == preflight.PID_MAX_LIMIT  # the customary value, above the need
    assert (found["kernel.pid_max"].before, found["kernel.pid_max"].value) == (32_768, preflight.PID_MAX_LIMIT)
    assert sysctl(proc, "kernel/threads-max") == 400 + 2 * 30_000  # to what is needed
    # Enough already: not written (and never lowered to the need).
    assert sysctl(proc, "fs/nr_open") == 5_000_000 and found["fs.nr_open"].status == preflight.OK
    # Per user: each sandbox has its own 128; raising it would only let one sandbox hold more.
    assert sysctl(proc, "fs/inotify/max_user_instances") == 128
    assert sysctl(proc, "fs/file-max") == 1_000_000 and found["fs.file-max"].status == preflight.OK
    # Memory cgroup ids cannot be raised: 65,535 whatever is written.
    assert found["memory cgroup ids"].status == preflight.OK
    assert "kernel.pid_max: 32768 -> 4194304" in report.to_dict()["raised"]


def test_a_kernel_that_answers_lower_than_before_gets_the_old_value_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = fake_proc(tmp_path, **{"kernel/threads-max": 50_000})
    real_write = preflight._write

    def kernel_takes_less(limit: preflight.Limit, proc_dir: Path, target: int) -> str:
        # A kernel that clamps what is written, here below what was there: the preflight must undo it.
        if limit.name == "kernel.threads-max":
            limit.path(proc_dir).write_text("40000\n")
            return ""
        return real_write(limit, proc_dir, target)

    monkeypatch.setattr(preflight, "_write", kernel_takes_less)
    cfg = config(proc, 30_000)
    report = preflight.raise_short(preflight.check(cfg), cfg)
    threads = by_name(report)["kernel.threads-max"]
    assert sysctl(proc, "kernel/threads-max") == 50_000, "put back: a limit is never lowered"
    assert threads.status == preflight.SHORT
    assert "the kernel kept 50,000: it would not take more" in threads.how
    assert report.fits == (50_000 - 400) // 2
    assert report.limiting == "kernel.threads-max"


def test_memory_cgroup_ids_bound_the_host_whatever_max_sandboxes_asks(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, memory_cgroups=5_535, **{"kernel/threads-max": 1_000_000})
    cfg = config(proc, 100_000)
    report = preflight.raise_short(preflight.check(cfg), cfg)
    memory = by_name(report)["memory cgroup ids"]
    assert (memory.status, memory.fits) == (preflight.SHORT, 60_000)
    assert "65,535 memory cgroup ids, dying cgroups included" in memory.how
    assert report.limiting == "memory cgroup ids" and report.fits == 60_000


def test_the_network_limits_once_sandboxes_have_networks_bounded_by_the_pool(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path)
    cfg = config(proc, 30_000, network_pool="198.19.0.0/20")  # 2,048 sandboxes with a network at most
    report = preflight.raise_short(preflight.check(cfg, networks=True), cfg)
    found = by_name(report)
    assert found["net.ipv4.neigh.default.gc_thresh3"].need == 1_024 + 2 * 2_048
    assert sysctl(proc, "net/ipv4/neigh/default/gc_thresh3") == 1_024 + 2 * 2_048
    assert sysctl(proc, "net/ipv4/neigh/default/gc_thresh1") == 128 + 2 * 2_048
    assert sysctl(proc, "net/ipv4/neigh/default/gc_thresh1") <= sysctl(proc, "net/ipv4/neigh/default/gc_thresh2")
    assert sysctl(proc, "net/netfilter/nf_conntrack_max") == 262_144  # 100 + 16 x 2,048 fits already
    assert not found["net.ipv4.neigh.default.gc_thresh3"].caps


def test_a_limit_this_kernel_lacks_is_absent(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path)
    (proc / "sys/net/netfilter/nf_conntrack_max").unlink()  # conntrack not loaded
    report = preflight.check(config(proc, 10), networks=True)
    assert by_name(report)["net.netfilter.nf_conntrack_max"].status == preflight.ABSENT
    assert report.fits == 10


def test_the_engines_uid_ranges_bound_it_too(tmp_path: Path) -> None:
    report = preflight.check(config(fake_proc(tmp_path), 10_000), uid_ranges=6_000)
    ranges = by_name(report)["engine uid ranges"]
    assert ranges.status == preflight.SHORT and report.fits == 6_000 and report.limiting == "engine uid ranges"


def test_the_engines_own_open_files_soft_limit_is_raised_up_to_its_hard_one(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard >= 1_024 + 8_192 + 2 * 100, "the test needs a hard limit above what 100 sandboxes need"
    resource.setrlimit(resource.RLIMIT_NOFILE, (1_024, hard))
    try:
        cfg = config(fake_proc(tmp_path), 100)
        report = preflight.raise_short(preflight.check(cfg), cfg)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (8_192 + 2 * 100, hard)
        assert by_name(report)["RLIMIT_NOFILE"].status == preflight.RAISED
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def meminfo(proc: Path, slab_kib: int) -> None:
    (proc / "meminfo").write_text(
        f"MemTotal: 24000000 kB\nSUnreclaim: {slab_kib} kB\nPageTables: 1000 kB\nKernelStack: 500 kB\nPercpu: 100 kB\n"
    )


def test_the_kernels_memory_per_sandbox_measured_from_the_fleet_as_it_grows(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    meminfo(proc, 100_000)
    meter = preflight.OverheadMeter(proc, default_kib=600)
    assert meter.sample(10) == {"kib": 600, "default_kib": 600, "measured_kib": None, "measured_over": 0}
    meminfo(proc, 100_000 + 150 * 900)
    assert meter.sample(160)["measured_kib"] is None, "too few added to tell"
    meminfo(proc, 100_000 + 400 * 900)
    grown = meter.sample(410)
    assert (grown["kib"], grown["measured_kib"], grown["measured_over"]) == (900, 900.0, 400)
    # Fewer sandboxes than the baseline: the baseline moves there.
    meminfo(proc, 90_000)
    meter.sample(5)
    meminfo(proc, 90_000 + 300 * 400)
    smaller = meter.sample(305)
    assert smaller["measured_kib"] == 400.0 and smaller["kib"] == 600, "never below the configured default"
