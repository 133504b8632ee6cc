"""Files a trainer needs (stat, rename, mkdir, watch) and commands run as a user, through the real HTTP API.

Every case is a real sandbox; the hostile ones are what code inside a sandbox
can plant: symlinks out of it, ``..``, names with newlines, a rename onto a
directory, a flood of changes under a watch.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

pytestmark = pytest.mark.root

USERS = (
    "printf 'trainer:x:1000:1000:trainer:/home/trainer:/bin/sh\\n' >> /etc/passwd && "
    "printf 'trainer:x:1000:\\ndata:x:2000:someone,trainer\\n' >> /etc/group && mkdir -p /home/trainer"
)


def run(api: httpx.Client, sandbox: str, cmd: str, **fields: object) -> httpx.Response:
    return api.post(f"/api/v1/sandboxes/{sandbox}/exec", json={"cmd": cmd, **fields})


# --- user= -------------------------------------------------------------------------------


def test_user_runs_as_that_uid_with_its_groups_and_home(api, running):
    assert run(api, running, USERS).json()["exit_code"] == 0
    answer = run(
        api,
        running,
        "id -u; id -g; id -G; echo $HOME $USER; grep -E '^(Uid|Gid|CapEff):' /proc/self/status; touch /tmp/mine",
        user="trainer",
    ).json()
    assert answer["exit_code"] == 0, answer
    lines = answer["stdout"].splitlines()
    assert lines[0] == "1000" and lines[1] == "1000"
    assert set(lines[2].split()) == {"1000", "2000"}
    assert lines[3] == "/home/trainer trainer"
    # What the kernel holds for the process: every uid and gid, and no capability left.
    assert lines[4].split()[1:] == ["1000"] * 4
    assert lines[5].split()[1:] == ["1000"] * 4
    assert lines[6].split()[1] == "0000000000000000"
    # What it made is its own, as the kernel records it in the sandbox.
    made = api.get(f"/api/v1/sandboxes/{running}/files/stat", params={"path": "/tmp/mine"}).json()
    assert (made["uid"], made["gid"]) == (1000, 1000)
    # The same user by its uid; and the env of the call still wins over the user's HOME.
    by_uid = run(api, running, "id -un; echo $HOME", user=1000, env={"HOME": "/elsewhere"}).json()
    assert by_uid["stdout"].splitlines() == ["trainer", "/elsewhere"]
    # It is not root: root's files stay closed to it.
    assert run(api, running, "cat /root/.profile 2>/dev/null || touch /root/x", user="trainer").json()["exit_code"] != 0


def test_user_not_in_the_sandbox_is_refused_and_the_host_is_never_read(api, running):
    # A user every host has, but this sandbox does not: the sandbox's own /etc/passwd decides.
    refused = run(api, running, "true", user="daemon")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "user_not_found"
    bad = run(api, running, "true", user="a:b")
    assert bad.status_code == 400 and bad.json()["error"]["field"].endswith("user")
    too_high = run(api, running, "true", user=70000)
    assert too_high.status_code == 400


def test_a_hostile_passwd_is_an_error_not_the_hosts_users(api, running):
    # /etc/passwd a symlink to the host's (resolved inside: the sandbox's own path), then a FIFO.
    run(api, running, "rm /etc/passwd && ln -s /proc/1/root/etc/passwd /etc/passwd")
    refused = run(api, running, "true", user="root")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "user_not_found"
    run(api, running, "rm /etc/passwd && mkfifo /etc/passwd")
    refused = run(api, running, "true", user="root")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "user_not_found"
    # A numeric uid without an entry (here, without any /etc/passwd) still runs, as itself.
    run(api, running, "rm /etc/passwd")
    answer = run(api, running, "id -u; id -g", user=4242).json()
    assert answer["stdout"].split() == ["4242", "4242"]


# --- stat, mkdir, rename -------------------------------------------------------------------


def test_stat_describes_without_following_and_404s_when_absent(api, running):
    base = f"/api/v1/sandboxes/{running}/files"
    run(api, running, "echo hi > /tmp/f && ln -s /etc/hostname /tmp/link && ln -s /nowhere /tmp/dangling")
    entry = api.get(f"{base}/stat", params={"path": "/tmp/f"}).json()
    assert (entry["type"], entry["size"], entry["name"]) == ("file", 3, "f")
    link = api.get(f"{base}/stat", params={"path": "/tmp/link"}).json()
    assert (link["type"], link["link_target"]) == ("symlink", "/etc/hostname")
    assert api.get(f"{base}/stat", params={"path": "/tmp/dangling"}).json()["type"] == "symlink"
    missing = api.get(f"{base}/stat", params={"path": "/tmp/nothing"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "file_not_found"
    # '..' cannot climb out of the root: it is the sandbox's own /etc.
    assert api.get(f"{base}/stat", params={"path": "/../../../etc"}).json()["type"] == "directory"
    special = api.get(f"{base}/stat", params={"path": "/proc/1/root"})
    assert special.status_code == 400 and special.json()["error"]["code"] == "invalid_path"


def test_mkdir_makes_parents_and_stays_inside_through_symlinks(api, running, tmp_path):
    base = f"/api/v1/sandboxes/{running}/files"
    made = api.post(f"{base}/mkdir", json={"path": "/work/a/b/c"})
    assert made.status_code == 200 and made.json() == {"path": "/work/a/b/c"}
    assert api.post(f"{base}/mkdir", json={"path": "/work/a/b/c"}).status_code == 200  # already there: fine
    # A symlink pointing out of the sandbox leads to the sandbox's own path of that name.
    outside = tmp_path / "host-dir"
    run(api, running, f"ln -s {outside} /work/out")
    dangling = api.post(f"{base}/mkdir", json={"path": "/work/out/new"})  # as mkdir -p: through a dangling link, no
    assert dangling.status_code == 404 and dangling.json()["error"]["code"] == "file_not_found"
    run(api, running, f"mkdir -p {outside}")
    assert api.post(f"{base}/mkdir", json={"path": "/work/out/new"}).status_code == 200
    assert not outside.exists()
    assert run(api, running, f"test -d {outside}/new").json()["exit_code"] == 0
    run(api, running, "touch /work/file")
    blocked = api.post(f"{base}/mkdir", json={"path": "/work/file/sub"})
    assert blocked.status_code == 409 and blocked.json()["error"]["code"] == "not_a_directory"
    climbing = api.post(f"{base}/mkdir", json={"path": "/work/../../x"})
    assert climbing.status_code == 400 and climbing.json()["error"]["code"] == "invalid_path"
    unknown = api.post(f"{base}/mkdir", json={"path": "/work/z", "parents": True})
    assert unknown.status_code == 400 and unknown.json()["error"]["field"].endswith("parents")


def test_rename_and_its_hostile_cases(api, running, tmp_path):
    base = f"/api/v1/sandboxes/{running}/files"
    newline = "two\nlines"
    api.put(f"{base}", params={"path": f"/r/{newline}"}, content=b"payload")
    moved = api.post(f"{base}/rename", json={"path": f"/r/{newline}", "target": "/r/plain"})
    assert moved.status_code == 200 and moved.json() == {"path": f"/r/{newline}", "target": "/r/plain"}
    assert api.get(base, params={"path": "/r/plain"}).content == b"payload"

    # Onto an existing file: refused unless replace; onto a directory: never.
    api.put(base, params={"path": "/r/other"}, content=b"other")
    exists = api.post(f"{base}/rename", json={"path": "/r/plain", "target": "/r/other"})
    assert exists.status_code == 409 and exists.json()["error"]["code"] == "file_exists"
    assert api.post(f"{base}/rename", json={"path": "/r/plain", "target": "/r/other", "replace": True}).status_code == 200
    assert api.get(base, params={"path": "/r/other"}).content == b"payload"
    api.post(f"{base}/mkdir", json={"path": "/r/dir/inside"})
    onto_directory = api.post(f"{base}/rename", json={"path": "/r/other", "target": "/r/dir", "replace": True})
    assert onto_directory.status_code == 409 and onto_directory.json()["error"]["code"] == "not_a_file"
    full = api.post(f"{base}/mkdir", json={"path": "/r/empty"})
    assert full.status_code == 200
    not_empty = api.post(f"{base}/rename", json={"path": "/r/empty", "target": "/r/dir", "replace": True})
    assert not_empty.status_code == 409 and not_empty.json()["error"]["code"] == "file_exists"
    into_itself = api.post(f"{base}/rename", json={"path": "/r/dir", "target": "/r/dir/inside/again"})
    assert into_itself.status_code == 400 and into_itself.json()["error"]["code"] == "invalid_path"

    # Through a symlink out of the sandbox: the target is the sandbox's own path, never the host's.
    outside = tmp_path / "host-target"
    run(api, running, f"mkdir -p {outside} && ln -s {outside} /r/out")
    assert api.post(f"{base}/rename", json={"path": "/r/other", "target": "/r/out/stolen"}).status_code == 200
    assert not outside.exists()
    assert run(api, running, f"cat {outside}/stolen").json()["stdout"] == "payload"
    # '..' stays in the root; another mount (/proc) and the root itself are refused.
    assert api.post(f"{base}/rename", json={"path": f"{outside}/stolen", "target": "/../../r/back"}).status_code == 200
    assert api.get(base, params={"path": "/r/back"}).content == b"payload"
    across = api.post(f"{base}/rename", json={"path": "/r/back", "target": "/proc/x"})
    assert across.status_code == 400 and across.json()["error"]["code"] == "invalid_path"
    root = api.post(f"{base}/rename", json={"path": "/", "target": "/r/root"})
    assert root.status_code == 400 and root.json()["error"]["code"] == "invalid_path"
    missing = api.post(f"{base}/rename", json={"path": "/r/nothing", "target": "/r/x"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "file_not_found"
    no_parent = api.post(f"{base}/rename", json={"path": "/r/back", "target": "/nowhere/x"})
    assert no_parent.status_code == 404 and no_parent.json()["error"]["code"] == "file_not_found"


# --- watch -------------------------------------------------------------------------------------


def _lines(response: httpx.Response):
    for line in response.iter_lines():
        if line.strip():
            yield json.loads(line)


def test_watch_streams_changes_with_names_and_ends_on_timeout(api, running):
    base = f"/api/v1/sandboxes/{running}/files"
    api.post(f"{base}/mkdir", json={"path": "/watched"})
    with api.stream("GET", f"{base}/watch", params={"path": "/watched", "timeout_s": 30}, timeout=60) as response:
        assert response.status_code == 200
        events = _lines(response)
        assert next(events)["type"] == "ready"
        run(api, running, "cd /watched && printf x > 'new\nline' && mv 'new\nline' moved && mkdir sub && rm moved")
        seen = []
        for event in events:
            seen.append(event)
            if event["type"] == "deleted":
                break
    kinds = [(event["type"], event.get("name")) for event in seen]
    assert ("created", "new\nline") in kinds
    assert ("moved_from", "new\nline") in kinds and ("moved_to", "moved") in kinds
    assert ("created", "sub") in kinds and ("deleted", "moved") in kinds
    assert next(event for event in seen if event.get("name") == "sub")["is_dir"] is True
    cookies = {event["type"]: event["cookie"] for event in seen if event["type"].startswith("moved")}
    assert cookies["moved_from"] == cookies["moved_to"]

    with api.stream("GET", f"{base}/watch", params={"path": "/watched", "timeout_s": 0.5}, timeout=60) as response:
        assert [event["type"] for event in _lines(response)] == ["ready", "end"]


def test_watch_refusals(api, running):
    base = f"/api/v1/sandboxes/{running}/files"
    run(api, running, "touch /tmp/plain && ln -s / /tmp/root-link")
    missing = api.get(f"{base}/watch", params={"path": "/nothing"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "file_not_found"
    a_file = api.get(f"{base}/watch", params={"path": "/tmp/plain"})
    assert a_file.status_code == 409 and a_file.json()["error"]["code"] == "not_a_directory"
    special = api.get(f"{base}/watch", params={"path": "/proc"})
    assert special.status_code == 400 and special.json()["error"]["code"] == "invalid_path"
    bad_timeout = api.get(f"{base}/watch", params={"path": "/", "timeout_s": 0})
    assert bad_timeout.status_code == 400


def test_a_flooded_watch_ends_whole_and_the_engine_answers_meanwhile(api, running):
    """A flood through the HTTP path (the bound itself is tests/engine/test_watches.py, where no web
    server's buffers stand between the engine and a reader that does not read)."""
    base = f"/api/v1/sandboxes/{running}/files"
    api.post(f"{base}/mkdir", json={"path": "/flood"})
    count = 3000
    with api.stream("GET", f"{base}/watch", params={"path": "/flood", "timeout_s": 15}, timeout=60) as response:
        events = _lines(response)
        assert next(events)["type"] == "ready"
        flood = run(api, running, f"cd /flood && i=0; while [ $i -lt {count} ]; do : > f$i; rm f$i; i=$((i+1)); done; echo done")
        assert flood.json()["stdout"] == "done\n"
        assert run(api, running, "echo alive").json()["stdout"] == "alive\n"
        seen = list(events)
    assert seen[-1] == {"type": "end", "reason": "timeout"}
    changes = sum(1 for event in seen if event["type"] in ("created", "deleted"))
    dropped = sum(event["dropped"] for event in seen if event["type"] == "overflow")
    assert 0 < changes + dropped <= 2 * count


def test_a_watch_ends_when_the_directory_goes_or_the_sandbox_does(api, running):
    base = f"/api/v1/sandboxes/{running}/files"
    api.post(f"{base}/mkdir", json={"path": "/going"})
    with api.stream("GET", f"{base}/watch", params={"path": "/going"}, timeout=60) as response:
        events = _lines(response)
        assert next(events)["type"] == "ready"
        run(api, running, "rmdir /going")
        assert [event for event in events if event["type"] == "end"] == [{"type": "end", "reason": "directory_deleted"}]

    ended: list[dict] = []
    with api.stream("GET", f"{base}/watch", params={"path": "/tmp"}, timeout=60) as response:
        events = _lines(response)
        assert next(events)["type"] == "ready"
        killer = threading.Thread(target=lambda: api.delete(f"/api/v1/sandboxes/{running}", params={"wait": True}))
        killer.start()
        ended = [event for event in events if event["type"] == "end"]
        killer.join()
    assert ended[0]["reason"] in ("sandbox_ended", "directory_unmounted")
