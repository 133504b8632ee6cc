"""The file API: read, write, list, tar up and down, and every escape a sandbox can plant."""

from __future__ import annotations

import io
import os
import socket
import tarfile
import threading
from pathlib import Path

import pytest

from sandboxes.engine import errors
from sandboxes.engine.protocol import encode_json

pytestmark = pytest.mark.root


def test_write_then_read_then_seen_by_exec(engine, sandbox):
    data = os.urandom(300_000)
    assert engine.write_file(sandbox, "/data/blob.bin", data, make_parents=True)["bytes"] == len(data)
    assert engine.read_file(sandbox, "/data/blob.bin") == data
    assert engine.exec(sandbox, "wc -c < /data/blob.bin").stdout.strip() == str(len(data)).encode()


def test_a_program_written_runs_at_once(engine, sandbox):
    """The writer closes the file before it answers: running what was just written is never "Text file
    busy" (ETXTBSY, the kernel refusing to run a file something holds open to write)."""
    for round_number in range(100):
        script = f"#!/bin/sh\necho round {round_number}\n".encode()
        engine.write_file(sandbox, "/opt/run/step", script, mode=0o755, make_parents=True)
        result = engine.exec(sandbox, ["/opt/run/step"])
        assert (result.exit_code, result.stdout) == (0, f"round {round_number}\n".encode()), result


def test_written_files_belong_to_root_inside(engine, sandbox):
    engine.write_file(sandbox, "/tmp/owned", b"x", mode=0o600)
    assert engine.exec(sandbox, "stat -c '%u %g %a' /tmp/owned").stdout.strip() == b"0 0 600"
    engine.exec(sandbox, "echo more >> /tmp/owned")  # root inside can still write it
    assert engine.read_file(sandbox, "/tmp/owned") == b"xmore\n"


def test_list_shows_types_sizes_and_links(engine, sandbox):
    engine.exec(sandbox, "mkdir -p /w/sub && echo hi > /w/file && ln -s /etc/passwd /w/link && mkfifo /w/pipe")
    listing = engine.list_files(sandbox, "/w")
    entries = {entry["name"]: entry for entry in listing["entries"]}
    assert entries["file"]["type"] == "file" and entries["file"]["size"] == 3
    assert entries["sub"]["type"] == "directory"
    assert entries["link"]["type"] == "symlink" and entries["link"]["link_target"] == "/etc/passwd"
    assert entries["pipe"]["type"] == "fifo"


def test_hostile_file_names_are_listed_safely(engine, sandbox):
    engine.exec(sandbox, "mkdir /names && cd /names && touch \"$(printf 'new\\nline')\" \"$(printf 'bad\\377byte')\" ' spaced '")
    names = {entry["name"] for entry in engine.list_files(sandbox, "/names")["entries"]}
    assert "new\nline" in names
    assert " spaced " in names
    assert "bad\ufffdbyte" in names


def test_absolute_symlink_to_host_file_is_resolved_inside_the_sandbox(engine, sandbox, tmp_path):
    secret = tmp_path / "host-secret"
    secret.write_text("the host's secret")
    engine.exec(sandbox, f"mkdir -p {tmp_path} && echo sandbox-copy > {secret} && ln -s {secret} /tmp/escape")
    # Resolved inside: the sandbox's own file, never the host's.
    assert engine.read_file(sandbox, "/tmp/escape") == b"sandbox-copy\n"
    engine.exec(sandbox, f"rm {secret}")
    with pytest.raises(errors.FileNotFound):
        engine.read_file(sandbox, "/tmp/escape")
    assert secret.read_text() == "the host's secret"


def test_dotdot_cannot_climb_out_of_the_sandbox(engine, sandbox):
    host_passwd = Path("/etc/passwd").read_bytes()
    inside = engine.read_file(sandbox, "/../../../../etc/passwd")
    assert inside != host_passwd
    assert inside.startswith(b"root:x:0:0:root:/root:/bin/sh")


def test_relative_symlink_with_dotdots_stays_inside(engine, sandbox):
    engine.exec(sandbox, "ln -s ../../../../../../etc /tmp/up")
    assert engine.read_file(sandbox, "/tmp/up/passwd").startswith(b"root:x:0:0:root:/root:/bin/sh")


def test_write_through_planted_symlink_cannot_touch_the_host(engine, sandbox, tmp_path):
    target = tmp_path / "victim"
    target.write_text("untouched")
    # The same path exists inside, so the links resolve (inside) and writes succeed.
    engine.exec(sandbox, f"mkdir -p {tmp_path} && ln -s {target} /tmp/trap && ln -s {tmp_path} /tmp/dirtrap")
    engine.write_file(sandbox, "/tmp/trap", b"overwritten?")
    engine.write_file(sandbox, "/tmp/dirtrap/victim", b"overwritten?", make_parents=True)
    assert target.read_text() == "untouched"
    # The writes landed inside the sandbox, where the links point there.
    assert engine.exec(sandbox, f"cat {target}").stdout == b"overwritten?"


def test_magic_links_are_refused(engine, sandbox):
    engine.exec(sandbox, "ln -s /proc/self/root /tmp/magic")
    with pytest.raises(errors.EngineError) as raised:
        engine.read_file(sandbox, "/tmp/magic/etc/hostname")
    assert raised.value.code in {"invalid_path", "file_not_found"}
    with pytest.raises(errors.InvalidPath):
        engine.read_file(sandbox, "/proc/1/environ")  # other mounts are not files of the sandbox


def test_fifo_does_not_hang_the_engine(engine, sandbox):
    engine.exec(sandbox, "mkfifo /tmp/fifo")
    with pytest.raises(errors.NotAFile):
        engine.read_file(sandbox, "/tmp/fifo")
    with pytest.raises(errors.NotAFile):
        engine.write_file(sandbox, "/tmp/fifo", b"x")


def test_directory_download_is_a_tar_of_the_tree(engine, sandbox):
    engine.exec(
        sandbox, "mkdir -p /proj/src && echo 'print(1)' > /proj/src/a.py && ln -s src/a.py /proj/link && mkfifo /proj/fifo"
    )
    archive = tarfile.open(fileobj=io.BytesIO(b"".join(engine.download(sandbox, "/proj"))))
    members = {member.name: member for member in archive.getmembers()}
    assert members["proj/src/a.py"].isfile()
    assert archive.extractfile("proj/src/a.py").read() == b"print(1)\n"
    assert members["proj/link"].issym() and members["proj/link"].linkname == "src/a.py"
    assert "proj/fifo" not in members


def test_download_follows_no_symlinked_directory_out_of_the_tree(engine, sandbox):
    engine.exec(sandbox, "mkdir -p /d && ln -s / /d/root && ln -s /etc /d/etc")
    archive = tarfile.open(fileobj=io.BytesIO(b"".join(engine.download(sandbox, "/d"))))
    names = archive.getnames()
    assert set(names) == {"d", "d/root", "d/etc"}


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            archive.addfile(info, io.BytesIO(data) if data is not None else None)
    return buffer.getvalue()


def test_tar_upload_unpacks_files_dirs_and_links(engine, sandbox):
    directory = tarfile.TarInfo("pkg")
    directory.type = tarfile.DIRTYPE
    directory.mode = 0o755
    script = tarfile.TarInfo("pkg/run.sh")
    script.mode = 0o755
    link = tarfile.TarInfo("pkg/latest")
    link.type = tarfile.SYMTYPE
    link.linkname = "run.sh"
    counts = engine.upload(sandbox, "/opt", _tar([(directory, None), (script, b"#!/bin/sh\necho ran\n"), (link, None)]))
    assert counts["files"] == 1 and counts["symlinks"] == 1
    assert engine.exec(sandbox, "/opt/pkg/latest").stdout == b"ran\n"


def test_tar_upload_cannot_escape_with_dotdot_or_a_symlink_parent(engine, sandbox, tmp_path):
    escape = tarfile.TarInfo(f"../../../../{tmp_path}/dotdot")
    parent = tarfile.TarInfo("evil")
    parent.type = tarfile.SYMTYPE
    parent.linkname = str(tmp_path)
    through = tarfile.TarInfo("evil/through-link")
    device = tarfile.TarInfo("dev-node")
    device.type = tarfile.CHRTYPE
    device.devmajor, device.devminor = 1, 3
    engine.exec(sandbox, f"mkdir -p {tmp_path}")
    counts = engine.upload(sandbox, "/up", _tar([(escape, b"x"), (parent, None), (through, b"y"), (device, None)]))
    assert counts["skipped"] == 2  # the '..' member and the device
    assert {error["reason"] for error in counts["errors"]} == {"'..' in the name", "devices and FIFOs are not accepted"}
    assert list(tmp_path.iterdir()) == []
    # The symlinked parent resolved inside the sandbox.
    assert engine.exec(sandbox, f"cat {tmp_path}/through-link").stdout == b"y"


def test_tar_member_that_resolves_nowhere_is_reported_and_the_rest_unpacked(engine, sandbox):
    dangling = tarfile.TarInfo("dangling")
    dangling.type = tarfile.SYMTYPE
    dangling.linkname = "/does/not/exist"
    lost = tarfile.TarInfo("dangling/file")
    kept = tarfile.TarInfo("kept")
    counts = engine.upload(sandbox, "/partial", _tar([(dangling, None), (lost, b"a"), (kept, b"b")]))
    assert counts["skipped"] == 1 and counts["errors"][0]["name"] == "dangling/file"
    assert engine.read_file(sandbox, "/partial/kept") == b"b"


def test_file_errors_have_stable_codes(engine, sandbox):
    with pytest.raises(errors.FileNotFound):
        engine.read_file(sandbox, "/no/such/file")
    with pytest.raises(errors.NotAFile):
        engine.read_file(sandbox, "/etc")
    with pytest.raises(errors.InvalidPath):
        engine.read_file(sandbox, "bad\0path")
    with pytest.raises(errors.InvalidPath):
        engine.call("files.read", id=sandbox, path="")
    with pytest.raises(errors.InvalidRequest):
        engine.call("files.read", id=sandbox, path=7)
    with pytest.raises(errors.NotADirectory):
        engine.list_files(sandbox, "/etc/passwd")
    with pytest.raises(errors.SandboxNotFound):
        engine.read_file("sb-nosuchsandbox", "/etc/passwd")


def test_oversized_read_is_refused(engine_process, sandbox):
    with engine_process.client() as client:
        client.exec(sandbox, "truncate -s 2G /tmp/huge")
        with pytest.raises(errors.TooLarge):
            client.read_file(sandbox, "/tmp/huge")
        assert client.exec(sandbox, "echo still fine").stdout == b"still fine\n"


def test_writes_never_reach_the_template_layer(engine_process, engine, sandbox):
    engine.exec(sandbox, "echo changed > /etc/os-release && rm /bin/ls")
    other = engine.create(template="base", size="tiny")["id"]
    try:
        assert b"forkyard base" in engine.read_file(other, "/etc/os-release")
        assert engine.exec(other, "ls /").exit_code == 0
    finally:
        engine.destroy(other)


# --- downloads of trees that change under them: each ends, with a tar or an error -----------------------


def _download_or_error(engine_process, sandbox: str, path: str, timeout_s: float = 120.0) -> bytes | errors.EngineError:
    """One download in a thread; the timeout is the failure signal ("it hung"), not a speed check."""
    outcome: list[bytes | errors.EngineError] = []

    def run() -> None:
        with engine_process.client(timeout_s=timeout_s) as client:
            try:
                outcome.append(b"".join(client.download(sandbox, path)))
            except errors.EngineError as error:
                outcome.append(error)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout_s)
    assert not worker.is_alive() and outcome, f"the download of {path} never ended"
    return outcome[0]


@pytest.fixture
def probed(engine, sandbox, probe_binary: Path) -> str:
    engine.write_file(sandbox, "/probe", probe_binary.read_bytes(), mode=0o755)
    return sandbox


def test_a_tree_renamed_and_made_again_while_it_is_downloaded(engine_process, engine, probed):
    started = engine.exec(probed, "setsid /probe churn /t </dev/null >/tmp/churn.out 2>&1 & sleep 0.2; cat /tmp/churn.out")
    assert b"RESULT OK" in started.stdout, started
    endings = {"tar": 0, "error": 0}
    for _ in range(20):
        outcome = _download_or_error(engine_process, probed, "/t")
        if isinstance(outcome, errors.EngineError):
            endings["error"] += 1
            continue
        endings["tar"] += 1
        # Whatever the walk saw, it is a whole archive: every member and its content.
        with tarfile.open(fileobj=io.BytesIO(outcome)) as archive:
            for member in archive.getmembers():
                if member.isfile():
                    content = archive.extractfile(member).read()
                    assert len(content) == member.size
    assert sum(endings.values()) == 20, endings


def test_a_tree_too_deep_to_walk_ends_with_an_error_that_says_so(engine_process, engine, probed):
    nested = engine.exec(probed, ["/probe", "nest", "/n", "400"])
    assert b"RESULT OK" in nested.stdout, nested
    outcome = _download_or_error(engine_process, probed, "/n")
    assert isinstance(outcome, errors.TooLarge), outcome
    assert "256 deep" in outcome.message


def test_downloads_a_caller_stopped_reading_hold_up_no_other(engine_process, engine, sandbox):
    """A caller that stops reading a stream holds none of the engine's threads:
    more of them than the engine has threads, and another download still ends."""
    engine.exec(sandbox, "mkdir -p /big && head -c 32000000 /dev/urandom > /big/blob")
    stalled = []
    for _ in range(min(32, (os.cpu_count() or 1) + 4) + 2):  # asyncio's default thread pool, and then some
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        connection.connect(str(engine_process.config.socket_path))
        connection.sendall(encode_json({"op": "files.download", "args": {"id": sandbox, "path": "/big"}}))
        stalled.append(connection)  # and never read again
    try:
        engine.exec(sandbox, "echo small > /small")
        outcome = _download_or_error(engine_process, sandbox, "/small", timeout_s=60)
        assert isinstance(outcome, bytes), outcome
        assert tarfile.open(fileobj=io.BytesIO(outcome)).extractfile("small").read() == b"small\n"
    finally:
        for connection in stalled:
            connection.close()
