"""The ``forkyard`` command and ``python -m forkyard.demo``, run as subprocesses against the real stack."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.sdk.conftest import CLI, Run
from tests.support.stack import Stack

pytestmark = pytest.mark.root


def no_traceback(completed: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in completed.stderr and "Traceback" not in completed.stdout, completed.stderr


def test_sandbox_commands(cli: Run, stack: Stack) -> None:
    created = cli("create", "--size", "tiny", "--ttl", "120", "--label", "via=cli", "-q")
    assert created.returncode == 0, created.stderr
    sandbox = created.stdout.strip()
    assert sandbox.startswith("sb_")
    try:
        ran = cli("exec", sandbox, "echo out; echo err >&2; exit 3")
        assert (ran.returncode, ran.stdout, ran.stderr) == (3, "out\n", "err\n")
        assert cli("exec", sandbox, "printf", "%s,", "a b", "c").stdout == "a b,c,"  # several words are argv
        assert cli("exec", "--cwd", "/tmp", "--env", "X=1", sandbox, "pwd; echo $X").stdout == "/tmp\n1\n"
        assert cli("exec", "--stdin", sandbox, "wc", "-c", stdin="12345").stdout.strip() == "5"

        streamed = cli("exec", "--stream", sandbox, "--", "sh", "-c", "echo a; echo b >&2; exit 4")
        assert (streamed.returncode, streamed.stdout, streamed.stderr) == (4, "a\n", "b\n")

        timed_out = cli("exec", "--timeout", "0.5", sandbox, "sleep 5")
        assert timed_out.returncode == 124 and "error [timed_out]" in timed_out.stderr

        binary = subprocess.run(
            [str(CLI), "exec", sandbox, "printf '\\377\\000\\376'; cat /bin/busybox"],
            capture_output=True,
            env={**os.environ, "FORKYARD_URL": stack.url, "FORKYARD_API_KEY": stack.teams[0].key},
            timeout=60,
        )
        assert binary.returncode == 0 and binary.stdout[:3] == b"\xff\x00\xfe" and len(binary.stdout) > (1 << 20)  # byte for byte

        as_json = json.loads(cli("--json", "exec", sandbox, "echo hi").stdout)
        assert as_json["stdout"] == "hi\n" and as_json["exit_code"] == 0

        assert cli("files", "write", sandbox, "/data/in.txt", stdin="from stdin\n").returncode == 0
        assert cli("files", "read", sandbox, "/data/in.txt").stdout == "from stdin\n"
        assert "in.txt" in cli("files", "ls", sandbox, "/data").stdout
        assert cli("files", "rm", sandbox, "/data/in.txt").returncode == 0
        missing = cli("files", "read", sandbox, "/data/in.txt")
        assert missing.returncode == 1 and missing.stderr.startswith("error [file_not_found]")

        listed = json.loads(cli("list", "--label", "via=cli", "--json").stdout)
        assert [row["id"] for row in listed] == [sandbox]
        assert sandbox in cli("list", "--state", "running", "--all").stdout
        assert json.loads(cli("get", sandbox, "--json").stdout)["state"] == "running"
    finally:
        killed = cli("kill", sandbox)
    assert killed.returncode == 0 and "destroyed" in killed.stdout
    gone = cli("exec", sandbox, "true")
    assert gone.returncode == 1 and gone.stderr.strip().startswith("error [sandbox_not_running]:")
    no_traceback(gone)


def test_errors_are_one_line_and_exit_nonzero(cli: Run, stack: Stack) -> None:
    for args, code in [
        (("get", "sb_nope"), "sandbox_not_found"),
        (("create", "--size", "huge"), "invalid_size"),
        (("launches", "get", "launch_nope"), "launch_not_found"),
    ]:
        completed = cli(*args)
        assert completed.returncode == 1 and completed.stderr.startswith(f"error [{code}]: "), completed.stderr
        no_traceback(completed)
    bad_key = cli("whoami", key="fy_wrong")
    assert bad_key.returncode == 1 and bad_key.stderr.startswith("error [unauthorized]: ")
    nowhere = cli("--url", "http://127.0.0.1:9", "whoami")
    assert nowhere.returncode == 1 and nowhere.stderr.startswith("error [connection_failed]: ")
    usage = cli("exec")
    assert usage.returncode == 2 and "usage:" in usage.stderr
    no_traceback(usage)
    environment = {key: value for key, value in os.environ.items() if key != "FORKYARD_API_KEY"}
    unset = subprocess.run(
        [sys.executable, "-m", "forkyard.cli", "--url", stack.url, "whoami"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unset.returncode == 1 and unset.stderr.startswith("error [configuration]: ")


def test_launch_with_wait_and_progress(cli: Run) -> None:
    launched = cli(
        "launch", "--count", "24", "--size", "tiny", "--ttl", "120", "--wait", "--progress", "--label", "via=cli-launch"
    )
    assert launched.returncode == 0, launched.stderr
    summary = launched.stdout.strip()
    # The launch's own state may still say "creating" for a moment after every sandbox runs: the counts are what matter.
    assert re.fullmatch(r"launch launch_\w+ \w+: 24 running, 0 failed, 0 pending of 24 in [\d.]+s \([\d.]+/s\)", summary), summary
    # The bar is redrawn in place: "\r" (text mode reads it as a newline) and clear-line before every frame.
    assert launched.stderr.count("\x1b[2K[") >= 2 and "24/24 running" in launched.stderr.splitlines()[-1]
    launch_id = summary.split()[1]
    assert launch_id.startswith("launch_")

    shown = json.loads(cli("launches", "get", launch_id, "--json").stdout)
    assert shown["progress"]["running"] == 24
    assert launch_id in cli("launches", "list").stdout
    killed = cli("launches", "kill", launch_id)
    assert killed.returncode == 0 and launch_id in killed.stdout

    quiet = cli("launch", "--count", "2", "--json")
    assert quiet.returncode == 0 and "\x1b[2K" not in quiet.stderr
    cli("launches", "kill", json.loads(quiet.stdout)["id"])


def test_account_commands(cli: Run) -> None:
    who = cli("whoami")
    assert who.returncode == 0 and "team Team A" in who.stdout and "requests/s" in who.stdout
    assert "base" in cli("templates").stdout
    assert json.loads(cli("templates", "base", "--json").stdout)[0]["name"] == "base"
    shown = cli("usage", "--group-by", "all").stdout
    assert "total" in shown
    # Amounts read like money, and the window is the one the API answered for.
    assert "E-" not in shown and "from - to -" not in shown, shown
    assert re.search(r"^usage from \d{4}-\d\d-\d\d \d\d:\d\d:\d\d to \d{4}-", shown, re.M), shown
    assert re.search(r"total\s+(\d[\d,]*\.\d\d|0\.\d{2,6}|<0\.000001) USD", shown), shown

    created = json.loads(cli("keys", "create", "cli-made", "--json").stdout)
    assert created["secret"].startswith("fy_") and created["key"]["role"] == "member"
    human = cli("keys", "create", "cli-made-2")
    assert "secret: fy_" in human.stdout and "shown this once" in human.stderr
    assert "cli-made" in cli("keys", "list").stdout
    assert cli("keys", "revoke", created["key"]["id"]).returncode == 0
    assert cli("whoami", key=created["secret"]).returncode == 1  # revoked


def test_demo(stack: Stack) -> None:
    environment = {**os.environ, "FORKYARD_URL": stack.url, "FORKYARD_API_KEY": stack.teams[0].key}
    completed = subprocess.run(
        [sys.executable, "-m", "forkyard.demo", "--count", "12"], env=environment, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    output = completed.stdout
    assert "sandbox 0 is sb-" in output and "Linux" in output
    assert "12 running, 0 failed of 12" in output and "p50" in output and "p95" in output and "killed   launch launch_" in output


def test_pause_snapshot_and_fork_commands(cli: Run) -> None:
    sandbox = cli("create", "--size", "tiny", "--ttl", "300", "-q").stdout.strip()
    try:
        assert cli("exec", sandbox, "mkdir -p /srv && echo cli-page > /srv/index.html").returncode == 0
        paused = cli("pause", sandbox)
        assert paused.returncode == 0 and "paused" in paused.stdout
        assert "running" in cli("resume", sandbox).stdout

        missing_ready = cli("snapshot", sandbox, "--name", "x", "--service", "web=httpd -f -p 8080 -h /srv")
        assert missing_ready.returncode == 1 and missing_ready.stderr.startswith(
            "error [invalid_request]: give each service a --ready"
        )
        bad_check = cli("snapshot", sandbox, "--name", "x", "--service", "web=true", "--ready", "web=tcp:eighty")
        assert bad_check.returncode == 2 and "NAME=tcp:PORT" in bad_check.stderr
        no_traceback(bad_check)

        taken = cli(
            "snapshot",
            sandbox,
            "--name",
            "cli-web",
            "--service",
            "web=httpd -f -p 8080 -h /srv",
            "--ready",
            "web=http:8080/",
            "--ready-timeout",
            "web=20",
            "--label",
            "via=cli",
            "-q",
        )
        assert taken.returncode == 0, taken.stderr
        snapshot = taken.stdout.strip()
        assert snapshot.startswith("snap_")
        shown = json.loads(cli("snapshots", "get", snapshot, "--json").stdout)
        assert shown["state"] == "ready" and shown["services"][0]["ready"]["http"] == {"port": 8080, "path": "/"}
        assert "web (http:8080/): httpd" in cli("snapshots", "get", snapshot).stdout
        listed = cli("snapshots", "list", "--label", "via=cli")
        assert snapshot in listed.stdout and "cli-web" in listed.stdout

        launched = cli("launch", "--snapshot", snapshot, "--count", "3", "--ttl", "120", "--wait", "--json")
        assert launched.returncode == 0, launched.stderr
        launch_id = json.loads(launched.stdout)["id"]
        fork = json.loads(cli("list", "--label", f"launch={launch_id}", "--json").stdout)[0]["id"]
        assert cli("exec", fork, "wget -qO- http://127.0.0.1:8080/").stdout == "cli-page\n"

        refused = cli("snapshots", "delete", snapshot)
        assert refused.returncode == 1 and refused.stderr.startswith("error [snapshot_in_use]: ")
        cli("launches", "kill", launch_id)
        deadline = time.monotonic() + 60
        while json.loads(cli("snapshots", "get", snapshot, "--json").stdout)["forks_alive"] and time.monotonic() < deadline:
            time.sleep(0.3)
        deleted = cli("snapshots", "delete", snapshot)
        assert deleted.returncode == 0 and "deleted" in deleted.stdout
        assert cli("snapshots", "get", snapshot).stderr.startswith("error [snapshot_not_found]")
    finally:
        cli("kill", sandbox)
