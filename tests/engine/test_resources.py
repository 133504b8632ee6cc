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
    latencies: list[float] = []
    stop = threading.Event()

    def measure() -> None:
        with engine_process.client() as client:
            while not stop.is_set():
                started = time.perf_counter()
                assert client.exec(bystander, "true").exit_code == 0
                subprocess.run(["true"], check=True)
                latencies.append(time.perf_counter() - started)
                time.sleep(0.05)

    watcher = threading.Thread(target=measure)
    watcher.start()
    try:
        result = engine.exec(probed_tiny, "bomb() { bomb | bomb & }; bomb; sleep 3; ps | wc -l", timeout_s=6)
    finally:
        stop.set()
        watcher.join()
        engine.destroy(bystander)
    assert result.exit_code is not None
    stats = engine.call("stats", id=probed_tiny)
    assert stats["pids"] <= 256  # the tiny size's pids.max
    assert latencies and max(latencies) < 2.0, f"bystander exec took up to {max(latencies):.2f}s during the bomb"
    # Destroying the sandbox takes the whole bomb with it.
    engine.destroy(probed_tiny)
    with pytest.raises(errors.SandboxNotRunning):
        engine.call("stats", id=probed_tiny)


def test_disk_fill_stays_inside_the_sandbox(engine, probed_tiny):
    free_before = shutil.disk_usage("/").free
    result = engine.exec(probed_tiny, "dd if=/dev/zero of=/tmp/fill bs=1M count=4096; echo rc=$?", timeout_s=60)
    # The writable layer is bounded by the size: the write fails (ENOSPC) or
    # the writer is OOM-killed; either way it stops well short of 4 GiB.
    assert b"rc=0" not in result.stdout or result.oom_killed
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
    started = time.monotonic()
    result = engine.exec(probed_tiny, ["/probe", "spin"], timeout_s=1)
    assert result.timed_out
    assert time.monotonic() - started < 4


def test_cpu_limit_is_applied(engine, probed_tiny):
    # Two spinners in a 1-vCPU sandbox share one CPU: together about 1 s of CPU per second.
    engine.exec(probed_tiny, "(/probe spin &) ; (/probe spin &) ; true")
    before = engine.call("stats", id=probed_tiny)["cpu_usage_us"]
    time.sleep(1.0)
    used = engine.call("stats", id=probed_tiny)["cpu_usage_us"] - before
    assert used < 1_300_000, f"{used} us of CPU in 1 s on a 1-vCPU sandbox"
    assert used > 500_000


def test_ttl_destroys_the_sandbox_within_a_second(engine):
    sandbox = engine.create(template="base", size="tiny", ttl_s=1)
    deadline = sandbox["expires_at"]
    while time.time() < deadline + 1.0:
        if engine.get(sandbox["id"])["state"] == "destroyed":
            break
        time.sleep(0.05)
    final = engine.get(sandbox["id"])
    assert final["state"] == "destroyed", final
    assert final["reason"] == "ttl expired"
    assert final["ended_at"] <= deadline + 1.0


def test_pause_stops_cpu_use_and_resume_restarts_it(engine, probed_tiny):
    engine.exec(probed_tiny, "(/probe spin &) ; true")
    engine.call("pause", id=probed_tiny)
    assert engine.get(probed_tiny)["state"] == "paused"
    before = engine.call("stats", id=probed_tiny)["cpu_usage_us"]
    time.sleep(0.5)
    assert engine.call("stats", id=probed_tiny)["cpu_usage_us"] - before < 20_000
    with pytest.raises(errors.SandboxNotRunning):
        engine.exec(probed_tiny, "true")
    engine.call("resume", id=probed_tiny)
    before = engine.call("stats", id=probed_tiny)["cpu_usage_us"]
    time.sleep(0.5)
    assert engine.call("stats", id=probed_tiny)["cpu_usage_us"] - before > 200_000


def test_destroying_a_paused_sandbox_leaves_nothing(engine, engine_process, probed_tiny):
    engine.exec(probed_tiny, "sleep 100 >/dev/null 2>&1 &")
    engine.call("pause", id=probed_tiny)
    engine.destroy(probed_tiny)
    assert engine.get(probed_tiny)["state"] == "destroyed"
    names = [path.name for path in Path("/sys/fs/cgroup").rglob(f"fy-{probed_tiny}")] if os.path.isdir("/sys/fs/cgroup") else []
    assert names == []


@pytest.mark.parametrize(
    "arguments,code",
    [
        ({"size": "huge"}, "invalid_size"),
        ({"size": "tiny", "cpu": 1}, "invalid_size"),
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


def test_explicit_cpu_and_memory(engine):
    sandbox = engine.create(template="base", cpu=0.5, memory_mib=64)
    try:
        assert (sandbox["cpu"], sandbox["memory_mib"]) == (0.5, 64)
        assert engine.exec(sandbox["id"], "true").exit_code == 0
    finally:
        engine.destroy(sandbox["id"])


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
