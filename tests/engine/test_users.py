"""An exec's ``user`` seen from the host: the kernel's ids of the process and of what it writes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandboxes.engine import errors
from tests.engine.engines import init_pid, root_uid, sandbox_processes, wait_for

pytestmark = pytest.mark.root


def test_a_users_process_and_files_are_its_uid_in_the_sandboxs_range(engine, sandbox):
    base = root_uid(sandbox)
    engine.exec(sandbox, "printf 'trainer:x:1000:1000::/tmp:/bin/sh\\n' >> /etc/passwd")
    # A command that stays a moment, so that the host can look at it while it runs.
    engine.exec(sandbox, "touch /tmp/by-trainer; sleep 60 </dev/null >/dev/null 2>&1 &", user="trainer")
    made = os.stat(f"/proc/{init_pid(sandbox)}/root/tmp/by-trainer")
    assert (made.st_uid, made.st_gid) == (base + 1000, base + 1000)

    def sleeper() -> int | None:
        return next((pid for pid, command in sandbox_processes(sandbox).items() if command == "sleep 60"), None)

    pid = wait_for(sleeper, "the user's command")
    status = Path(f"/proc/{pid}/status").read_text()
    lines = {line.split(":", 1)[0]: line.split(":", 1)[1].split() for line in status.splitlines() if ":" in line}
    assert lines["Uid"] == [str(base + 1000)] * 4 and lines["Gid"] == [str(base + 1000)] * 4
    assert lines["CapEff"] == ["0000000000000000"] and lines["CapPrm"] == ["0000000000000000"]
    engine.exec(sandbox, "pkill sleep; true")


def test_a_passwd_too_big_to_read_is_user_not_found(engine, sandbox):
    engine.exec(sandbox, "head -c 2000000 /dev/zero > /etc/passwd")
    with pytest.raises(errors.UserNotFound):
        engine.exec(sandbox, "true", user="root")
    assert engine.exec(sandbox, "id -u").stdout == b"0\n"  # without a user: root, as before
