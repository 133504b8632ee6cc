"""The SDK's file calls a trainer needs and ``exec(user=...)``, sync and async, against the real stack."""

from __future__ import annotations

import asyncio
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from forkyard import AsyncClient, Client, Conflict, InvalidRequest, NotFound, Sandbox, UnknownOption, UnsafeArchive
from tests.support.stack import Stack

pytestmark = pytest.mark.root

USERS = "printf 'trainer:x:1000:1000::/home/trainer:/bin/sh\\n' >> /etc/passwd"


def test_exec_as_a_user(sb: Sandbox) -> None:
    assert sb.exec(USERS).ok
    result = sb.exec("id -u; grep ^Uid: /proc/self/status; touch /tmp/by-trainer", user="trainer")
    lines = result.stdout.splitlines()
    assert lines[0] == "1000" and lines[1].split()[1:] == ["1000"] * 4
    assert sb.files.stat("/tmp/by-trainer").uid == 1000
    chunks = list(sb.exec_stream("id -u", user=1000))
    assert "".join(chunk.data for chunk in chunks) == "1000\n"
    with pytest.raises(InvalidRequest) as refused:
        sb.exec("true", user="nobody-here")
    assert refused.value.code == "user_not_found"
    with pytest.raises(UnknownOption):
        sb.exec("true", uid=1000)  # type: ignore[call-arg]


def test_exists_stat_mkdir_rename(sb: Sandbox, fy: Client) -> None:
    files = sb.files
    assert not files.exists("/w/a")
    assert not files.exists("/etc/passwd/below-a-file")
    files.mkdir("/w/a/b")
    assert files.exists("/w/a/b") and files.stat("/w/a/b").type == "directory"
    files.write("/w/a/f", b"hello")
    renamed = files.rename("/w/a/f", "/w/a/g")
    assert (renamed.path, renamed.target) == ("/w/a/f", "/w/a/g")
    assert not files.exists("/w/a/f") and files.read("/w/a/g") == b"hello"
    files.write("/w/a/h", b"other")
    with pytest.raises(Conflict) as exists:
        files.rename("/w/a/g", "/w/a/h")
    assert exists.value.code == "file_exists"
    files.rename("/w/a/g", "/w/a/h", replace=True)
    assert files.read("/w/a/h") == b"hello"
    with pytest.raises(Conflict) as onto_directory:
        files.rename("/w/a/h", "/w/a/b", replace=True)
    assert onto_directory.value.code == "not_a_file"
    sb.exec("ln -s /etc/hostname /w/link")
    link = files.stat("/w/link")
    assert link.type == "symlink" and link.link_target == "/etc/hostname"
    # A sandbox that is not there is not a file that is not there.
    with pytest.raises(NotFound) as gone:
        fy.sandboxes.ref("sb_0000000000000000").files.exists("/")
    assert gone.value.code == "sandbox_not_found"


def test_watch_yields_events_and_ends(sb: Sandbox) -> None:
    sb.files.mkdir("/watched")
    with sb.files.watch("/watched", timeout_s=30) as watch:
        events = iter(watch)
        assert next(events).type == "ready"
        sb.exec("touch /watched/one && mkdir /watched/two")
        seen = []
        for event in events:
            seen.append((event.type, event.name, event.is_dir))
            if event.name == "two":
                break
    assert ("created", "one", False) in seen and ("created", "two", True) in seen
    short = sb.files.watch("/watched", timeout_s=0.2)
    assert [event.type for event in short] == ["ready"]
    assert short.end is not None and short.end.reason == "timeout"
    with pytest.raises(Conflict):
        list(sb.files.watch("/watched/one"))


def _tree(root: Path) -> dict[str, bytes | str]:
    found: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        found[key] = f"-> {os.readlink(path)}" if path.is_symlink() else path.read_bytes() if path.is_file() else "dir"
    return found


def test_upload_and_download_a_directory(sb: Sandbox, tmp_path: Path) -> None:
    source = tmp_path / "source"
    (source / "sub" / "deeper").mkdir(parents=True)
    (source / "a.txt").write_bytes(b"alpha")
    (source / "sub" / "deeper" / "b.bin").write_bytes(os.urandom(70_000))
    (source / "sub" / "rel").symlink_to("deeper/b.bin")
    sb.files.upload_dir(source, "/data/in")
    assert sb.files.read("/data/in/sub/deeper/b.bin") == (source / "sub" / "deeper" / "b.bin").read_bytes()
    assert sb.files.stat("/data/in/sub/rel").link_target == "deeper/b.bin"
    target = tmp_path / "back"
    assert sb.files.download_dir("/data/in", target) >= 5
    assert _tree(target) == _tree(source)


@pytest.mark.parametrize(
    "plant",
    [
        "ln -s /etc/shadow /evil/escape",  # an absolute symlink
        "ln -s ../../../../../../etc /evil/up",  # a relative one that climbs out
    ],
)
def test_download_dir_refuses_entries_that_escape(sb: Sandbox, tmp_path: Path, plant: str) -> None:
    sb.exec(f"mkdir -p /evil && echo fine > /evil/fine && {plant}")
    target = tmp_path / "target"
    with pytest.raises(UnsafeArchive):
        sb.files.download_dir("/evil", target)
    assert list(target.iterdir()) == []  # checked whole before anything is written


def _crafted(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> bytes:
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        top = tarfile.TarInfo("evil")
        top.type = tarfile.DIRTYPE
        tar.addfile(top)
        info = tarfile.TarInfo(name)
        info.type, info.linkname = kind, link
        info.size = 1 if kind == tarfile.REGTYPE else 0
        tar.addfile(info, io.BytesIO(b"x") if kind == tarfile.REGTYPE else None)
    return archive.getvalue()


def _through_links_past_path_max() -> bytes:
    """CVE-2025-4517's shape: links to 247-character directory names, sixteen deep, so that the
    expanded path passes PATH_MAX and ``os.path.realpath`` (in tarfile's data filter before
    CPython 3.11.13) stops following them; then a link that climbs out through them, and a file
    written through it into ``outside``, beside the target."""
    archive = io.BytesIO()
    long_name, steps, path = "d" * 247, "abcdefghijklmnop", "evil"
    with tarfile.open(fileobj=archive, mode="w", format=tarfile.PAX_FORMAT) as tar:

        def add(name: str, kind: bytes, link: str = "", data: bytes = b"") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.size = kind, link, len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)

        add("evil", tarfile.DIRTYPE)
        for step in steps:
            add(f"{path}/{long_name}", tarfile.DIRTYPE)
            add(f"{path}/{step}", tarfile.SYMTYPE, long_name)
            path = f"{path}/{long_name}"
        climber = "/".join(steps) + "/" + "l" * 254
        add(f"evil/{climber}", tarfile.SYMTYPE, "../" * len(steps))
        add("evil/escape", tarfile.SYMTYPE, f"{climber}/..")
        add("evil/escape/outside", tarfile.REGTYPE, data=b"written outside the target\n")
    return archive.getvalue()


@pytest.mark.parametrize(
    "archive",
    [
        _through_links_past_path_max(),
        _crafted("evil/../../outside"),
        _crafted("/abs/olute"),
        _crafted("elsewhere/file"),
        _crafted("evil/null", tarfile.CHRTYPE),
        _crafted("evil/fifo", tarfile.FIFOTYPE),
        _crafted("evil/hard", tarfile.LNKTYPE, "/etc/passwd"),
    ],
    ids=["links-past-path-max", "dot-dot", "absolute", "outside-the-directory", "device", "fifo", "hard-link-out"],
)
def test_download_dir_refuses_what_the_engine_never_sends(sb: Sandbox, tmp_path: Path, monkeypatch, archive) -> None:
    """A server that sent such entries (or a tampered stream) is refused all the same."""
    monkeypatch.setattr(type(sb.files), "download_stream", lambda self, path: iter([archive]))
    with pytest.raises(UnsafeArchive):
        sb.files.download_dir("/evil", tmp_path / "t")
    assert list((tmp_path / "t").iterdir()) == [] and not (tmp_path / "outside").exists()


def test_async_files_and_user(stack: Stack, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with AsyncClient(stack.url, stack.teams[0].key) as fy:
            sandbox = await fy.sandboxes.create(template="base", size="tiny", ttl_s=120)
            try:
                await sandbox.exec(USERS)
                assert (await sandbox.exec("id -u", user="trainer")).stdout == "1000\n"
                files = sandbox.files
                await files.mkdir("/x/y")
                assert await files.exists("/x/y") and not await files.exists("/x/z")
                await files.write("/x/y/f", b"1")
                await files.rename("/x/y/f", "/x/y/g")
                assert (await files.stat("/x/y/g")).size == 1
                watch = files.watch("/x", timeout_s=30)
                events = watch.__aiter__()
                assert (await events.__anext__()).type == "ready"
                await files.mkdir("/x/new")
                assert (await events.__anext__()).name == "new"
                await watch.close()
                source = tmp_path / "src"
                (source / "d").mkdir(parents=True)
                (source / "d" / "f").write_bytes(b"async")
                await files.upload_dir(source, "/up")
                assert await files.download_dir("/up", tmp_path / "down") >= 2
                assert (tmp_path / "down" / "d" / "f").read_bytes() == b"async"
            finally:
                await sandbox.kill(wait=False)

    asyncio.run(scenario())


def test_cli_files_and_exec_user(cli, sb: Sandbox, tmp_path: Path) -> None:
    assert cli("exec", sb.id, "--", USERS).returncode == 0
    ran = cli("exec", "--user", "trainer", sb.id, "--", "id -u")
    assert ran.returncode == 0 and ran.stdout == "1000\n"
    assert cli("exec", "--user", "ghost", sb.id, "--", "true").returncode == 1
    assert cli("files", "mkdir", sb.id, "/c/d").returncode == 0
    assert cli("files", "write", sb.id, "/c/d/f", stdin="text").returncode == 0
    assert cli("files", "mv", sb.id, "/c/d/f", "/c/g").returncode == 0
    described = cli("files", "stat", sb.id, "/c/g")
    assert described.returncode == 0 and described.stdout.split()[1:3] == ["file", "4"]
    missing = cli("files", "stat", sb.id, "/c/d/f")
    assert missing.returncode == 1 and "file_not_found" in missing.stderr
    watched = cli("files", "watch", sb.id, "/c", "--timeout", "0.2")
    assert watched.returncode == 0 and json.loads(watched.stdout.splitlines()[0])["type"] == "ready"
    down = tmp_path / "down"
    assert cli("files", "download-dir", sb.id, "/c", str(down)).returncode == 0
    assert (down / "g").read_text() == "text"
    assert cli("files", "upload-dir", sb.id, str(down), "/copy").returncode == 0
    assert sb.files.read("/copy/g") == b"text"
