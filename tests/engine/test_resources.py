"""Resource abuse is contained, and the host and other sandboxes stay responsive."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from sandboxes.engine import errors
from sandboxes.engine.cgroups import CgroupsV1, detect
from tests.engine.engines import cgroup_file, cpu_ticks, frozen, sandbox_processes, wait_for

pytestmark = pytest.mark.root


@pytest.fixture
def probed_tiny(engine, probe_binary: Path):
    sandbox = engine.create(template="base", size="tiny", ttl_s=300)["id"]
    engine.write_file(sandbox, "/probe", probe_binary.read_bytes(), mode=0o755)
    yield sandbox
    engine.destroy(sandbox)


def test_memory_hog_past_the_limit_is_reported_as_oom(engine, probed_tiny):
    result = engine.exec(probed_tiny, ["/probe", "memory_hog"], timeout_s=60)
    assert result.oom_killed, result
    assert result.signal == 9
    reached = [int(line.split()[1]) for line in result.stdout.decode().splitlines() if line.startswith("MiB")]
    assert reached and max(reached) < 128, "the hog got past the 128 MiB limit"
    assert engine.exec(probed_tiny, "echo alive").stdout == b"alive\n"


def test_fork_bomb_is_contained_and_others_stay_responsive(engine_process, engine, probed_tiny):
    bystander = engine.create(template="base", size="tiny", ttl_s=120)["id"]
    bystander_execs: list[int] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def keep_using_the_bystander() -> None:
        try:
            with engine_process.client() as client:
                while not stop.is_set():
                    assert client.exec(bystander, "echo alive").stdout == b"alive\n"
                    subprocess.run(["true"], check=True)
                    bystander_execs.append(1)
                    time.sleep(0.05)
        except BaseException as error:  # noqa: BLE001 - failed in the thread: the test fails below
            failures.append(error)

    pids_max = int(cgroup_file(engine_process, probed_tiny, "pids", "pids.max").read_text())
    assert pids_max == 256  # the tiny size's
    watcher = threading.Thread(target=keep_using_the_bystander)
    watcher.start()
    try:
        engine.exec(probed_tiny, "setsid sh -c 'bomb() { bomb | bomb & }; bomb' </dev/null >/dev/null 2>&1 &")
        # The kernel holds it at the limit: it refuses the bomb's forks (its
        # pids.events "max" counter), and never lets the count pass pids.max.
        # pids.current itself oscillates below the limit as refused shells
        # exit, so it is not the signal to wait for.
        wait_for(lambda: forks_refused(engine_process, probed_tiny) > 0, "the kernel to refuse the bomb's forks")
        assert engine.call("stats", id=probed_tiny)["pids"] <= pids_max
        # The bystander (and the host) keep working while the bomb is at its limit.
        at_limit = len(bystander_execs)
        wait_for(lambda: len(bystander_execs) >= at_limit + 3 or failures, "the bystander's execs")
        assert int(cgroup_file(engine_process, probed_tiny, "pids", "pids.current").read_text()) <= pids_max
    finally:
        stop.set()
        watcher.join()
        engine.destroy(bystander)
    if failures:
        raise failures[0]
    # Destroying the sandbox takes the whole bomb with it.
    engine.destroy(probed_tiny)
    with pytest.raises(errors.SandboxNotRunning):
        engine.call("stats", id=probed_tiny)
    assert not detect(engine_process.config).exists(f"fy-{probed_tiny}")


def forks_refused(engine_process, sandbox: str) -> int:
    """Forks the kernel refused at the sandbox's pids limit. cgroup v1 counts
    them in the cgroup the fork came from (a command's exec cgroup below the
    sandbox's), v2 in the cgroup whose limit was hit: sum the whole subtree."""
    top = cgroup_file(engine_process, sandbox, "pids", "pids.events").parent
    total = 0
    for events in top.rglob("pids.events"):
        try:
            fields = dict(line.split() for line in events.read_text().splitlines())
        except FileNotFoundError:  # an exec cgroup removed while we walked
            continue
        total += int(fields.get("max", "0"))
    return total


def test_disk_fill_stays_inside_the_sandbox(engine_process, engine, probed_tiny):
    image = engine_process.config.disks_image  # the test engine's disk pool: an image it made, allocated up front
    blocks_before = image.stat().st_blocks
    assert blocks_before * 512 >= image.stat().st_size, "all of it allocated (no discard punched a hole in it)"
    os.sync()  # the host's own delayed allocations (earlier tests' files) settled before it is measured
    free_before = shutil.disk_usage("/").free
    result = engine.exec(probed_tiny, "dd if=/dev/zero of=/tmp/fill bs=1M count=4096; echo rc=$?", timeout_s=60)
    # The writable layer is bounded by the size: the write fails (its disk's quota) or
    # the writer is OOM-killed; either way it stops well short of 4 GiB.
    assert b"rc=0" not in result.stdout or result.oom_killed
    # What it wrote went into the pool's image, whose blocks were the host's already: none more taken.
    assert image.stat().st_blocks == blocks_before
    os.sync()
    assert shutil.disk_usage("/").free > free_before - 64 * 1024 * 1024
    engine.exec(probed_tiny, "rm -f /tmp/fill")
    assert engine.exec(probed_tiny, "echo ok > /tmp/small && cat /tmp/small").stdout == b"ok\n"


def test_file_descriptor_exhaustion_is_contained(engine, probed_tiny):
    result = engine.exec(probed_tiny, ["/probe", "fd_exhaustion"], timeout_s=30)
    assert b"RESULT EMFILE" in result.stdout or b"RESULT ENFILE" in result.stdout
    count = int(result.stdout.decode().split("COUNT ")[1].split()[0])
    assert 0 < count <= 65536
    assert engine.exec(probed_tiny, "echo fine").stdout == b"fine\n"


def test_cpu_spin_is_stopped_at_the_wall_clock_timeout(engine, probed_tiny):
    result = engine.exec(probed_tiny, ["/probe", "spin"], timeout_s=1)
    assert result.timed_out and result.signal == 9
    assert "/probe spin" not in sandbox_processes(probed_tiny).values(), "the spinner outlived its timeout"


def test_cpu_limit_is_applied(engine_process, engine, probe_binary):
    """The quota is the kernel's: written to the cgroup, and enforced (the
    cgroup is throttled once a spinner uses its share of a period)."""
    sandbox = engine.create(template="base", cpu=0.1, memory_mib=128, ttl_s=300)["id"]
    try:
        if isinstance(detect(engine_process.config), CgroupsV1):
            assert cgroup_file(engine_process, sandbox, "cpu", "cpu.cfs_period_us").read_text().split() == ["100000"]
            assert cgroup_file(engine_process, sandbox, "cpu", "cpu.cfs_quota_us").read_text().split() == ["10000"]
        else:
            assert cgroup_file(engine_process, sandbox, "cpu", "cpu.max").read_text().split() == ["10000", "100000"]

        def throttling() -> dict[str, int]:
            lines = cgroup_file(engine_process, sandbox, "cpu", "cpu.stat").read_text().splitlines()
            stat = {key: int(value) for key, value in (line.split() for line in lines)}
            return {"periods": stat["nr_throttled"], "time": stat.get("throttled_time", stat.get("throttled_usec", 0))}

        before = throttling()
        engine.write_file(sandbox, "/probe", probe_binary.read_bytes(), mode=0o755)
        engine.exec(sandbox, "(/probe spin &) ; true")
        # A spinner wants all of every period; a tenth is its share: the kernel throttles it.
        wait_for(
            lambda: (now := throttling())["periods"] > before["periods"] + 2 and now["time"] > before["time"],
            "the cgroup to be throttled",
        )
    finally:
        engine.destroy(sandbox)


def test_ttl_destroys_the_sandbox_when_it_expires(engine_process, engine):
    sandbox = engine.create(template="base", size="tiny", ttl_s=1)
    final = wait_for(lambda: (now := engine.get(sandbox["id"]))["state"] == "destroyed" and now, "the TTL's destroy")
    assert final["reason"] == "ttl expired"
    assert final["ended_at"] >= sandbox["expires_at"], "destroyed before its TTL"
    assert not detect(engine_process.config).exists(f"fy-{sandbox['id']}")


def test_pause_stops_cpu_use_and_resume_restarts_it(engine_process, engine, probed_tiny):
    engine.exec(probed_tiny, "(/probe spin &) ; true")
    (spinner,) = wait_for(
        lambda: [pid for pid, line in sandbox_processes(probed_tiny).items() if line == "/probe spin"], "the spinner"
    )
    engine.call("pause", id=probed_tiny)
    assert engine.get(probed_tiny)["state"] == "paused"
    assert frozen(engine_process, probed_tiny), "the kernel does not say the cgroup is frozen"
    ticks = cpu_ticks(spinner)
    time.sleep(0.5)  # not a measure: a frozen task runs nothing, however long we look
    assert cpu_ticks(spinner) == ticks, "a frozen spinner used CPU"
    with pytest.raises(errors.SandboxNotRunning):
        engine.exec(probed_tiny, "true")
    engine.call("resume", id=probed_tiny)
    assert not frozen(engine_process, probed_tiny)
    wait_for(lambda: cpu_ticks(spinner) > ticks, "the resumed spinner to run again")


def test_destroying_a_paused_sandbox_leaves_nothing(engine, engine_process, probed_tiny):
    engine.exec(probed_tiny, "sleep 100 >/dev/null 2>&1 &")
    engine.call("pause", id=probed_tiny)
    engine.destroy(probed_tiny)
    assert engine.get(probed_tiny)["state"] == "destroyed"
    assert not detect(engine_process.config).exists(f"fy-{probed_tiny}")


@pytest.mark.parametrize(
    "arguments,code",
    [
        ({"size": "huge"}, "invalid_size"),
        ({"size": "tiny", "cpu": 1}, "invalid_size"),
        ({"cpu": 1}, "invalid_size"),
        ({"memory_mib": 128}, "invalid_size"),
        ({"cpu": 0, "memory_mib": 128}, "invalid_size"),
        ({"cpu": 1, "memory_mib": 10**9}, "invalid_size"),
        ({"cpu": "two", "memory_mib": 128}, "invalid_size"),
        ({"template": "no-such-template"}, "template_not_found"),
        ({"ttl_s": 0}, "invalid_request"),
        ({"ttl_s": 10**9}, "invalid_request"),
        ({"id": "Bad_ID!"}, "invalid_request"),
        ({"labels": {"k": 5}}, "invalid_request"),
        ({"env": ["A=B"]}, "invalid_request"),
    ],
)
def test_bad_create_input_is_a_clear_error(engine, arguments, code):
    with pytest.raises(errors.EngineError) as raised:
        engine.create(**{"template": "base", **arguments})
    assert raised.value.code == code


@pytest.mark.parametrize("given,missing", [({"cpu": 1}, "memory_mib"), ({"size": "tiny", "memory_mib": 128}, "cpu")])
def test_half_a_shape_names_the_missing_field(engine, given, missing):
    with pytest.raises(errors.InvalidSize) as raised:
        engine.create(template="base", **given)
    assert raised.value.details["field"] == missing
    assert missing in raised.value.message


def test_explicit_cpu_and_memory(engine):
    sandbox = engine.create(template="base", cpu=0.5, memory_mib=64)
    try:
        assert (sandbox["cpu"], sandbox["memory_mib"]) == (0.5, 64)
        assert engine.exec(sandbox["id"], "true").exit_code == 0
    finally:
        engine.destroy(sandbox["id"])


def test_destroy_many_destroys_each_and_answers_each_in_order(engine):
    live = [engine.create(template="base", size="tiny")["id"] for _ in range(3)]
    gone = engine.create(template="base", size="tiny")["id"]
    engine.destroy(gone)
    assert all(sandbox_processes(sandbox) for sandbox in live)
    answers = engine.destroy_many([*live, gone, "never-existed"])
    assert [answer["id"] for answer in answers] == [*live, gone, "never-existed"]
    assert [answer.get("state") for answer in answers[:4]] == ["destroyed"] * 4
    assert answers[4]["error"]["code"] == "sandbox_not_found"
    for sandbox in live:
        assert engine.get(sandbox)["state"] == "destroyed"
        assert sandbox_processes(sandbox) == {}, f"{sandbox}: its processes are gone, as the kernel sees it"
    for bad in ([], "not-a-list", [1, 2], ["x"] * 1001):
        with pytest.raises(errors.InvalidRequest) as refused:
            engine.destroy_many(bad)
        assert refused.value.details["field"] == "ids"


def test_create_with_an_id_is_idempotent_and_destroy_too(engine):
    first = engine.create(template="base", size="tiny", id="rollout-7-env-3")
    again = engine.create(template="base", size="tiny", id="rollout-7-env-3")
    assert first["id"] == again["id"] == "rollout-7-env-3"
    assert len([s for s in engine.list() if s["id"] == "rollout-7-env-3"]) == 1
    assert engine.destroy("rollout-7-env-3")["state"] == "destroyed"
    assert engine.destroy("rollout-7-env-3")["state"] == "destroyed"
    # A replayed create after destroy does not resurrect it.
    assert engine.create(template="base", size="tiny", id="rollout-7-env-3")["state"] == "destroyed"
    with pytest.raises(errors.SandboxNotFound):
        engine.destroy("never-existed")
