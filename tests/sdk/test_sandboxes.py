"""Sandboxes through the SDK, against the real API and real sandboxes."""

from __future__ import annotations

import io
import tarfile
import time

import pytest

from forkyard import Client, Conflict, ForkyardError, Sandbox

pytestmark = pytest.mark.root


def test_create_exec_kill(fy: Client) -> None:
    sandbox = fy.sandboxes.create(template="base", size="tiny", ttl_s=120, labels={"case": "create"})
    assert sandbox.id.startswith("sb_")
    assert sandbox.state == "running" and sandbox.running
    assert sandbox.host and sandbox.region == "test-region-1"
    assert sandbox.labels == {"case": "create"} and sandbox.size == "tiny" and sandbox.memory_mib == 128
    assert sandbox.ready_at is not None and sandbox.expires_at is not None

    result = sandbox.exec("echo hello from $(hostname)")
    assert result.ok and result.exit_code == 0
    assert result.stdout.startswith("hello from ") and result.stderr == ""
    assert result.duration_ms > 0 and not result.timed_out and not result.oom_killed

    assert sandbox.kill() is sandbox
    assert sandbox.state == "destroyed" and sandbox.ended_at is not None
    assert fy.sandboxes.get(sandbox.id).state == "destroyed"


def test_exec_options_and_results(sb: Sandbox) -> None:
    failing = sb.exec("echo out; echo err >&2; exit 3")
    assert (failing.exit_code, failing.stdout, failing.stderr, failing.ok) == (3, "out\n", "err\n", False)

    assert sb.exec(["printf", "%s|", "a b", "c"]).stdout == "a b|c|"  # argv: no shell splitting
    assert sb.exec("pwd; echo $GREETING", cwd="/tmp", env={"GREETING": "hi"}).stdout == "/tmp\nhi\n"
    assert sb.exec("cat", stdin="typed text").stdout == "typed text"
    raw = bytes(range(256))
    assert sb.exec("cat", stdin=raw, output="base64").stdout_bytes == raw

    slow = sb.exec("sleep 5", timeout_s=0.5)
    assert slow.timed_out and not slow.ok  # a timeout is a result, not an error

    truncated = sb.exec("head -c 5000 /dev/zero", max_output_bytes=100)
    assert truncated.stdout_truncated and len(truncated.stdout) <= 100


def test_exec_stream_yields_output_as_it_comes(sb: Sandbox) -> None:
    stream = sb.exec_stream("echo one; sleep 0.5; echo two >&2; exit 5")
    arrivals = []
    for chunk in stream:
        arrivals.append((time.monotonic(), chunk.stream, chunk.data))
    assert [(kind, data) for _, kind, data in arrivals] == [("stdout", "one\n"), ("stderr", "two\n")]
    assert arrivals[1][0] - arrivals[0][0] >= 0.3, "the first line came only with the last: not streamed"
    assert stream.result is not None and stream.result.exit_code == 5 and not stream.result.timed_out


def test_exec_stream_of_exact_bytes(sb: Sandbox) -> None:
    stream = sb.exec_stream("head -c 300000 /bin/busybox", output="base64")
    streamed = b"".join(chunk.bytes for chunk in stream)
    assert streamed == sb.files.read("/bin/busybox")[:300000]
    assert stream.result is not None and stream.result.encoding == "base64"


def test_exec_stream_can_be_left_early(sb: Sandbox) -> None:
    with sb.exec_stream("for i in $(seq 1 50); do echo $i; sleep 0.05; done") as stream:
        first = next(iter(stream))
    assert first.data.startswith("1")
    assert stream.result is None
    assert sb.exec("echo still fine").stdout == "still fine\n"


def test_files_read_write_list_remove(sb: Sandbox) -> None:
    written = sb.files.write("/data/a.py", b"print(1)")
    assert (written.path, written.bytes) == ("/data/a.py", 8)
    assert sb.files.read("/data/a.py") == b"print(1)"
    assert sb.exec("cat /data/a.py").stdout == "print(1)"

    sb.files.write("/data/text.txt", "héllo\n", mode=0o600)
    entries = {entry.name: entry for entry in sb.files.list("/data")}
    assert set(entries) == {"a.py", "text.txt"}
    assert entries["text.txt"].mode & 0o777 == 0o600 and entries["text.txt"].size == len("héllo\n".encode())

    big = bytes(range(256)) * 8192  # 2 MiB, more than one chunk each way
    sb.files.write("/data/big.bin", io.BytesIO(big))
    assert sb.files.read("/data/big.bin") == big

    sb.files.remove("/data/a.py")
    assert "a.py" not in {entry.name for entry in sb.files.list("/data")}


def test_a_download_the_engine_cannot_finish_raises(sb: Sandbox) -> None:
    """A walk deeper than the engine goes fails midway: the SDK raises, whole or streamed, and never
    hands over a truncated archive as if it were whole."""
    sb.exec("d=/tmp/deep; for i in $(seq 300); do d=$d/d; done; mkdir -p $d")
    with pytest.raises(ForkyardError):
        sb.files.download("/tmp/deep")
    with pytest.raises(ForkyardError):
        for _ in sb.files.download_stream("/tmp/deep"):
            pass


def test_a_tree_renamed_under_a_download_gives_a_whole_archive_or_an_error(sb: Sandbox) -> None:
    """The sandbox renames files while they are archived: each download ends (a guard thread, not a
    timing), as a tar that reads to its end or as a ForkyardError."""
    import threading

    sb.exec("mkdir -p /tmp/churn && for i in $(seq 200); do head -c 4096 /dev/zero > /tmp/churn/f$i; done")
    sb.exec(
        "setsid sh -c 'while [ ! -e /tmp/stop ]; do for i in $(seq 200); do mv /tmp/churn/f$i /tmp/churn/g$i; "
        "mv /tmp/churn/g$i /tmp/churn/f$i; done; done' </dev/null >/dev/null 2>&1 &"
    )
    outcomes: list[str] = []

    def download_many() -> None:
        for _ in range(10):
            try:
                archive = b"".join(sb.files.download_stream("/tmp/churn"))
            except ForkyardError as error:
                outcomes.append(f"error:{error.code}")
                continue
            with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
                outcomes.append(f"whole:{len(tar.getmembers())}")

    worker = threading.Thread(target=download_many, daemon=True)
    worker.start()
    worker.join(timeout=240)
    sb.exec("touch /tmp/stop")
    assert not worker.is_alive(), f"a download hung; so far: {outcomes}"
    assert len(outcomes) == 10, outcomes


def test_archive_download_and_upload(sb: Sandbox, fy: Client) -> None:
    sb.files.write("/work/src/main.py", b"print('main')")
    sb.files.write("/work/src/lib/util.py", b"X = 1")
    archive = sb.files.download("/work/src")
    names = tarfile.open(fileobj=io.BytesIO(archive)).getnames()
    assert any(name.endswith("main.py") for name in names) and any(name.endswith("util.py") for name in names)
    assert b"".join(sb.files.download_stream("/work/src", chunk_size=1024)) == archive

    other = fy.sandboxes.create(template="base", size="tiny", ttl_s=120)
    try:
        other.files.upload("/restored", archive)
        assert other.exec("cat $(find /restored -name util.py)").stdout == "X = 1"
    finally:
        other.kill(wait=False)


def test_pause_resume_refresh(sb: Sandbox) -> None:
    assert sb.pause().state == "paused"
    assert sb.refresh().state == "paused"
    assert sb.resume().state == "running"
    assert sb.exec("echo awake").stdout == "awake\n"


def test_list_filters_and_pagination(fy: Client) -> None:
    label = f"page-{time.monotonic_ns()}"
    created = [fy.sandboxes.create(template="base", size="tiny", ttl_s=120, labels={"batch": label}) for _ in range(5)]
    try:
        first = fy.sandboxes.list(label=f"batch={label}", limit=2)
        assert len(first) == 2 and first.next_cursor
        second = fy.sandboxes.list(label=f"batch={label}", limit=2, cursor=first.next_cursor)
        assert {sandbox.id for sandbox in first}.isdisjoint(sandbox.id for sandbox in second)

        every = list(fy.sandboxes.list_all(label=f"batch={label}", page_size=2))
        assert sorted(sandbox.id for sandbox in every) == sorted(sandbox.id for sandbox in created)
        assert [sandbox.id for sandbox in every] == [sandbox.id for sandbox in reversed(created)]  # newest first

        created[0].kill()
        running = {sandbox.id for sandbox in fy.sandboxes.list_all(state="running", label=f"batch={label}")}
        assert running == {sandbox.id for sandbox in created[1:]}
    finally:
        for sandbox in created:
            fy.sandboxes.kill(sandbox.id, wait=False)


def test_kill_by_id_is_idempotent_and_ends_exec(fy: Client) -> None:
    sandbox = fy.sandboxes.create(template="base", size="tiny", ttl_s=120)
    assert fy.sandboxes.kill(sandbox.id).state == "destroyed"
    assert fy.sandboxes.destroy(sandbox.id).state == "destroyed"
    with pytest.raises(Conflict) as raised:
        sandbox.exec("true")
    assert raised.value.code == "sandbox_not_running" and raised.value.details["state"] == "destroyed"


def test_sandbox_as_context_manager_and_ref(fy: Client) -> None:
    with fy.sandboxes.create(template="base", size="tiny", ttl_s=120) as sandbox:
        handle = fy.sandboxes.ref(sandbox.id)
        assert handle.exec("echo via ref").stdout == "via ref\n"
        assert handle.refresh().state == "running"
    assert fy.sandboxes.get(sandbox.id).state in ("stopping", "destroyed")


def test_idempotency_key_makes_one_sandbox(fy: Client) -> None:
    key = f"sdk-test-{time.monotonic_ns()}"
    first = fy.sandboxes.create(template="base", size="tiny", ttl_s=120, idempotency_key=key)
    again = fy.sandboxes.create(template="base", size="tiny", ttl_s=120, idempotency_key=key)
    try:
        assert again.id == first.id
    finally:
        first.kill(wait=False)


def test_account_templates_usage_policies(fy: Client) -> None:
    me = fy.me()
    assert me.team_name == "Team A" and me.role == "admin" and me.limits.requests_per_second > 0
    assert fy.rate_limit is not None and fy.rate_limit.limit == me.limits.requests_per_second

    assert "base" in [template.name for template in fy.templates.list()]
    assert fy.templates.get("base").hosts
    assert all(snapshot.state != "deleted" for snapshot in fy.snapshots.list())

    report = fy.usage(group_by="all")
    assert report.currency == "USD" and report.total >= 0 and report.group_by == "all"

    policy = fy.network_policies.create(name="sdk-egress", egress=[{"cidr": "10.0.0.0/8", "ports": [443]}], description="test")
    assert fy.network_policies.get(policy.id).egress[0].cidr == "10.0.0.0/8"
    updated = fy.network_policies.update(policy.id, name="sdk-egress-2", egress=[{"host": "example.com", "ports": [80]}])
    assert updated.name == "sdk-egress-2" and updated.egress[0].host == "example.com"
    assert policy.id in [item.id for item in fy.network_policies.list()]
    fy.network_policies.delete(policy.id)
    assert policy.id not in [item.id for item in fy.network_policies.list()]
