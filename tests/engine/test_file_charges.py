"""Files written through the API are the sandbox's: charged to its disk (or memory), bounded by its size.

On a host with a disk backend (disks.py) a sandbox's writable layer is a
btrfs subvolume whose quota group is its disk: what it writes counts there,
and its memory limit is memory only, so a 128 MiB sandbox writes a file
larger than its memory.  On a host without one (``disk=memory``) the
writable layer is a tmpfs in its memory cgroup: whoever writes a page of it
is charged for it in memory.  These tests write through the file API and
the sandbox's own commands, and read what the kernel reports (the quota
group's count, the memory cgroup's charge, the tmpfs's inodes), never a
timing.
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes.engine import errors
from sandboxes.engine.client import EngineClient
from tests.engine.engines import cgroup_file, init_pid, memory_charged, sandbox_processes, separate_engine, wait_for
from tests.support.engine import EngineProcess

pytestmark = pytest.mark.root

MEBIBYTE = 1 << 20


@pytest.fixture
def tiny(engine: EngineClient, probe_binary: Path) -> Iterator[str]:
    """A 128 MiB sandbox (with its size's 1 GiB disk), with the probe."""
    sandbox = engine.create(template="base", size="tiny", ttl_s=300)["id"]
    engine.write_file(sandbox, "/probe", probe_binary.read_bytes(), mode=0o755)
    yield sandbox
    engine.destroy(sandbox)


@pytest.fixture(scope="module")
def memory_engine(work_dir: Path) -> Iterator[EngineProcess]:
    """An engine without a disk backend: writable layers in tmpfs, in memory."""
    with separate_engine(work_dir / "memory-disks", env={"FORKYARD_ENGINE_DISK": "memory"}) as started:
        yield started


@pytest.fixture
def in_memory(memory_engine: EngineProcess, probe_binary: Path) -> Iterator[tuple[EngineClient, str]]:
    """A 128 MiB sandbox whose disk is a tmpfs as large as its memory, with the probe."""
    with memory_engine.client() as client:
        assert client.info()["disks"]["backend"] == "memory"
        sandbox = client.create(template="base", cpu=1, memory_mib=128, disk_mib=128, ttl_s=300)["id"]
        client.write_file(sandbox, "/probe", probe_binary.read_bytes(), mode=0o755)
        yield client, sandbox
        client.destroy(sandbox)


def _tar(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in files.items():
            member = tarfile.TarInfo(name)
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    return buffer.getvalue()


def _disk_used(engine: EngineClient, sandbox: str) -> int:
    return int(engine.call("stats", id=sandbox)["disk_used_bytes"])


# --- on disk ------------------------------------------------------------------------------


def test_the_disk_is_a_subvolume_of_the_shared_filesystem_with_the_size_s_quota(
    engine_process: EngineProcess, engine: EngineClient, tiny: str
):
    assert engine.info()["disks"]["backend"] == "btrfs", "this host has btrfs: the engine's default uses it"
    stats = engine.call("stats", id=tiny)
    assert stats["disk_limit_bytes"] == 1024 * MEBIBYTE  # the tiny size's disk, not its memory
    assert stats["disk_files"] is None  # a quota group counts bytes, not files
    disk = engine_process.config.disks_dir / tiny
    assert disk.stat().st_ino == 256, "its disk is a subvolume (whose root is inode 256), not a directory"
    # No filesystem of its own: its root's writable layer is a directory of the one shared btrfs.
    mounts = [line.split() for line in engine.exec(tiny, "cat /proc/mounts").stdout.decode().splitlines()]
    assert [fields[2] for fields in mounts if fields[2] == "tmpfs"] == []


def test_a_written_file_is_charged_to_the_sandbox_disk_and_given_back_on_removal(
    engine_process: EngineProcess, engine: EngineClient, tiny: str
):
    before = _disk_used(engine, tiny)
    engine.write_file(tiny, "/tmp/blob", os.urandom(48 * MEBIBYTE))
    grown = _disk_used(engine, tiny) - before
    assert 48 * MEBIBYTE <= grown <= 56 * MEBIBYTE, f"its disk grew by {grown / MEBIBYTE:.1f} MiB for 48 MiB"
    engine.call("files.remove", id=tiny, path="/tmp/blob")
    # The quota group's count settles at the filesystem's next commit, forced here from the host (a sandbox's
    # own sync answers 0 without running: seccomp.SKIPPED_SYSCALLS). An unlinked file's extents are freed when
    # btrfs's cleaner thread drops its inode (a delayed iput), which on a busy host can miss the first commit:
    # committed again until the count comes back, for at most 30 s.
    deadline = time.monotonic() + 30
    while True:
        subprocess.run(["btrfs", "filesystem", "sync", str(engine_process.config.disks_dir)], check=True, capture_output=True)
        left = _disk_used(engine, tiny) - before
        if left < 4 * MEBIBYTE or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert left < 4 * MEBIBYTE, f"removing the file gave its disk back: {left / MEBIBYTE:.1f} MiB still charged"


def test_a_tiny_sandbox_writes_a_file_larger_than_its_memory(engine_process: EngineProcess, engine: EngineClient, tiny: str):
    """The issue's case: 128 MiB of memory, a 300 MiB file. Its page cache is reclaimed as it is written back;
    its memory limit is memory only."""
    result = engine.exec(tiny, "dd if=/dev/zero of=/tmp/big bs=1M count=300 2>&1; echo rc=$?; wc -c < /tmp/big", timeout_s=120)
    assert b"rc=0" in result.stdout and result.stdout.split()[-1] == str(300 * MEBIBYTE).encode(), result
    assert not result.oom_killed
    assert _disk_used(engine, tiny) >= 300 * MEBIBYTE
    assert memory_charged(engine_process, tiny) < 128 * MEBIBYTE
    assert any(pid == init_pid(tiny) for pid in sandbox_processes(tiny)), "its init runs on"


def test_writes_past_the_disk_quota_fail_as_disk_full(engine: EngineClient) -> None:
    small = engine.create(template="base", size="tiny", disk_mib=32, ttl_s=300)["id"]
    try:
        assert engine.call("stats", id=small)["disk_limit_bytes"] == 32 * MEBIBYTE
        written = engine.exec(small, "dd if=/dev/zero of=/tmp/fill bs=1M count=64 conv=fsync 2>&1; echo rc=$?")
        assert b"Disk quota exceeded" in written.stdout and b"rc=0" not in written.stdout, written
        with pytest.raises(errors.TooLarge) as raised:
            engine.write_file(small, "/tmp/more", os.urandom(16 * MEBIBYTE))
        assert "disk is full" in raised.value.message
        # A flood of empty files meets it too: their metadata is counted.
        # A touch a process: on a busy machine the flood outlasts exec's default 60 s, and a killed loop echoes nothing.
        flood = engine.exec(
            small,
            "rm -f /tmp/fill /tmp/more; sync; mkdir /f; i=0; while touch /f/$i 2>/dev/null; do i=$((i+1)); done; echo $i",
            timeout_s=600,
        )
        assert 0 < int(flood.stdout) < 1_000_000, flood
        assert engine.exec(small, "rm -rf /f && sync && touch /after && echo ok", timeout_s=120).stdout == b"ok\n"
    finally:
        engine.destroy(small)


def test_a_destroyed_sandbox_disk_is_deleted(engine_process: EngineProcess, engine: EngineClient) -> None:
    sandbox = engine.create(template="base", size="tiny", ttl_s=300)["id"]
    disk = engine_process.config.disks_dir / sandbox
    assert disk.is_dir() and (disk.stat().st_mode & 0o777) == 0o700  # its root's alone
    engine.destroy(sandbox)
    assert not disk.exists()


# --- in memory (a host without a disk backend) ------------------------------------------------


def test_in_memory_a_written_file_is_charged_to_the_sandbox_memory(memory_engine: EngineProcess, in_memory: tuple[EngineClient, str]):
    engine, tiny = in_memory
    before = memory_charged(memory_engine, tiny)
    engine.write_file(tiny, "/tmp/blob", os.urandom(48 * MEBIBYTE))
    grown = memory_charged(memory_engine, tiny) - before
    # The tmpfs pages of the file, and no more than a little besides.
    assert 44 * MEBIBYTE <= grown <= 60 * MEBIBYTE, f"the sandbox's memory grew by {grown / MEBIBYTE:.1f} MiB for 48 MiB"
    engine.call("files.remove", id=tiny, path="/tmp/blob")
    assert memory_charged(memory_engine, tiny) - before < 8 * MEBIBYTE, "removing the file gave its memory back"


def test_in_memory_an_uploaded_tar_is_charged_to_the_sandbox_memory(memory_engine: EngineProcess, in_memory: tuple[EngineClient, str]):
    engine, tiny = in_memory
    before = memory_charged(memory_engine, tiny)
    counts = engine.upload(tiny, "/up", _tar({f"part{index}": os.urandom(8 * MEBIBYTE) for index in range(4)}))
    assert counts["files"] == 4 and counts["bytes"] == 32 * MEBIBYTE
    grown = memory_charged(memory_engine, tiny) - before
    assert 28 * MEBIBYTE <= grown <= 44 * MEBIBYTE, f"the sandbox's memory grew by {grown / MEBIBYTE:.1f} MiB for 32 MiB"


def test_in_memory_a_write_larger_than_the_memory_left_fails_and_the_sandbox_runs_on(
    memory_engine: EngineProcess, in_memory: tuple[EngineClient, str]
):
    """The sandbox holds 80 MiB of its 128; an 80 MiB upload fits its disk but
    not its memory: it fails as too large, what it wrote is given back, and
    the sandbox's own process is not the one the kernel kills."""
    engine, tiny = in_memory
    held = engine.exec(tiny, "setsid /probe hold_memory 80 > /tmp/held.out 2>&1 < /dev/null & echo $!")
    holder = int(held.stdout)

    def holding() -> bool:
        try:
            return b"RESULT OK" in engine.read_file(tiny, "/tmp/held.out")
        except errors.FileNotFound:
            return False  # the background shell has not made it yet

    wait_for(holding, "the probe to hold 80 MiB")
    with pytest.raises(errors.TooLarge) as raised:
        engine.write_file(tiny, "/tmp/too-much", os.urandom(80 * MEBIBYTE))
    assert "memory" in raised.value.message
    # The sandbox runs on: its holder is alive, it answers, and the partial file holds nothing.
    assert engine.exec(tiny, f"kill -0 {holder} && echo alive").stdout == b"alive\n"
    assert engine.call("files.stat", id=tiny, path="/tmp/too-much")["size"] == 0
    assert memory_charged(memory_engine, tiny) < 100 * MEBIBYTE
    engine.write_file(tiny, "/tmp/fits", os.urandom(8 * MEBIBYTE))
    assert engine.exec(tiny, "wc -c < /tmp/fits").stdout.strip() == str(8 * MEBIBYTE).encode()
    assert any("/probe hold_memory" in line for line in sandbox_processes(tiny).values())


def test_in_memory_many_small_files_meet_the_sandbox_inode_limit(memory_engine: EngineProcess, in_memory: tuple[EngineClient, str]):
    """A 128 MiB tmpfs holds one file per page of its disk (32,768):
    an upload of more ends at that limit, as the sandbox's own writes would,
    and the inodes it made are charged to the sandbox."""
    engine, tiny = in_memory
    limit = int(engine.exec(tiny, "df -i / | tail -1").stdout.split()[1])
    assert limit == 128 * MEBIBYTE // 4096
    before = memory_charged(memory_engine, tiny)
    with pytest.raises(errors.TooLarge) as raised:
        engine.upload(tiny, "/many", _tar({f"file{index}": b"" for index in range(limit + 100)}))
    assert "full" in raised.value.message
    free = int(engine.exec(tiny, "df -i / | tail -1").stdout.split()[3])
    assert free == 0, "the upload stopped before the tmpfs ran out of inodes"
    # Each inode and its name cost the sandbox kernel memory (over a KiB here).
    grown = memory_charged(memory_engine, tiny) - before
    assert grown >= limit * 512, f"{limit} inodes grew the sandbox's memory by {grown} bytes only"
    assert engine.exec(tiny, "rm -rf /many && touch /after && echo ok").stdout == b"ok\n"


def test_a_paused_sandbox_files_can_be_read_not_changed(engine: EngineClient, tiny: str):
    engine.write_file(tiny, "/tmp/kept", b"before the pause")
    engine.call("pause", id=tiny)
    try:
        assert engine.read_file(tiny, "/tmp/kept") == b"before the pause"
        for change in (
            lambda: engine.write_file(tiny, "/tmp/new", b"x"),
            lambda: engine.call("files.mkdir", id=tiny, path="/tmp/dir"),
            lambda: engine.call("files.remove", id=tiny, path="/tmp/kept"),
        ):
            with pytest.raises(errors.SandboxNotRunning) as raised:
                change()
            assert "paused" in raised.value.message
    finally:
        engine.call("resume", id=tiny)
    engine.write_file(tiny, "/tmp/new", b"after the pause")
    assert engine.read_file(tiny, "/tmp/new") == b"after the pause"


def test_the_file_writer_is_a_process_of_the_sandbox(engine_process: EngineProcess, engine: EngineClient, tiny: str):
    """While a write runs, its writer is a process of the sandbox, as the host
    sees it: in the sandbox's cgroup, its root, confined like its init, and
    the OOM killer's first choice there."""
    seen: dict[str, str] = {}

    def body() -> Iterator[bytes]:
        yield b"first part, "
        # The writer is waiting for the rest: look at it from the host.
        # One writer serves the call (one kept from an earlier call may be on its way out).
        (pid,) = wait_for(lambda: writers if len(writers := _writers(tiny)) == 1 else [], "the sandbox's file writer")
        status = Path(f"/proc/{pid}/status").read_text()
        seen.update(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        seen["oom_score_adj"] = Path(f"/proc/{pid}/oom_score_adj").read_text().strip()
        seen["init_uid"] = Path(f"/proc/{init_pid(tiny)}/status").read_text().split("Uid:\t", 1)[1].split()[0]
        yield b"then the rest"

    assert engine.call("files.write", body=body(), id=tiny, path="/tmp/streamed")["bytes"] == 25
    assert engine.read_file(tiny, "/tmp/streamed") == b"first part, then the rest"
    assert seen["Uid"].split()[0] == seen["init_uid"], "the writer runs as the sandbox's root"
    assert (seen["Seccomp"].strip(), seen["NoNewPrivs"].strip()) == ("2", "1")
    assert seen["CapEff"] == seen["CapBnd"] and not int(seen["CapEff"], 16) & (1 << 21), "no CAP_SYS_ADMIN"
    assert seen["oom_score_adj"] == "1000"


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _writers(sandbox: str) -> list[int]:
    return [pid for pid in sandbox_processes(sandbox) if _name(pid) == "forkyard-files"]


def test_a_sandbox_at_its_process_limit_gets_a_clear_error(engine_process: EngineProcess, engine: EngineClient, tiny: str):
    """The writer is a process of the sandbox: when the sandbox may start no
    more (its pids limit), a change says so, and works again once it may."""
    wait_for(lambda: not _writers(tiny), "the writer kept from the last call to go")
    limit = cgroup_file(engine_process, tiny, "pids", "pids.max")
    saved = limit.read_text().strip()
    limit.write_text(cgroup_file(engine_process, tiny, "pids", "pids.current").read_text().strip())
    try:
        with pytest.raises(errors.EngineError) as raised:
            engine.write_file(tiny, "/tmp/blocked", b"x")
        assert "process limit" in raised.value.message
    finally:
        limit.write_text(saved)
    engine.write_file(tiny, "/tmp/allowed", b"x")
    assert engine.read_file(tiny, "/tmp/allowed") == b"x"
