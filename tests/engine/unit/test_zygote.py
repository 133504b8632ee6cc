"""The zygote's request parsing, against the real binary: every malformed request is refused.

Nothing here reaches clone(): a request the zygote refuses changes nothing,
so these run without root.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes.engine import rootfs, spawner, zygote
from sandboxes.engine.native import build_init

SPEC = rootfs.RootfsSpec("/layers", ("base",), "/mnt/scratch", "/mnt/root", 1 << 20, "/dev-dir", "/empty")


@pytest.fixture(scope="module")
def binary_fd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    binary = build_init(tmp_path_factory.mktemp("native") / "forkyard-init", force=True)
    fd = spawner.sealed_copy(str(binary))
    yield fd
    os.close(fd)


@pytest.fixture
def running(binary_fd: int, tmp_path: Path) -> Iterator[zygote.Zygote]:
    program = tmp_path / "seccomp.bpf"
    program.write_bytes(b"\x06\x00\x00\x00\x00\x00\xff\x7f")  # one instruction: allow
    started = zygote.Zygote.start(binary_fd, spawner.kept_capability_mask(), str(program))
    yield started
    started.close()
    os.waitpid(started.pid, 0)


def ask(running: zygote.Zygote, message: bytes, fds: tuple[int, ...] = ()) -> zygote.Reply:
    running.socket.setblocking(True)
    running.socket.settimeout(5)
    try:
        running.socket.sendmsg([message], [zygote.fd_rights(fds)] if fds else [])
        return zygote.decode_reply(running.socket.recv(zygote.MAX_REPLY))
    finally:
        running.socket.setblocking(False)


def spawn_fields(**changes: object) -> list[object]:
    fields: dict[str, object] = {
        "op": "spawn",
        "token": 7,
        "hostname": "sb-test",
        "resolv": "nameserver 198.19.0.0\n",
        "uid_base": 1000065536,
        "uid_count": 65536,
        "layers_uid": 1000000000,
        "nofile": 1024,
        "cgroups": 0,
        "layers": 1,
        "layer": "/layers/base",
    }
    fields.update(changes)
    if fields["layers"] != 1 and "layer" not in changes:
        del fields["layer"]
    return list(fields.values())


def message(fields: list[object], plan: bytes | None = None) -> bytes:
    return zygote.encode_fields([str(field) for field in fields]) + (zygote.encoded_plan(SPEC) if plan is None else plan)


@pytest.fixture
def pipe_and_socket() -> Iterator[tuple[int, int]]:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    read_end, write_end = os.pipe()
    yield listener.fileno(), write_end
    listener.close()
    os.close(read_end)
    os.close(write_end)


def step_fields(step: rootfs.Step) -> bytes:
    values = [step.op, step.within, step.target, step.source, step.fstype, step.data, step.flags, step.mode, step.missing]
    return zygote.encode_fields([str(value) for value in values])


def plan_of(*steps: rootfs.Step) -> bytes:
    return zygote.encode_fields([str(len(steps))]) + b"".join(step_fields(step) for step in steps)


ROOT, PIVOT = rootfs.Step("enter-root", "/mnt/root"), rootfs.Step("pivot")

BAD_SPAWNS = {
    "token not a number": (spawn_fields(token="7x"), None),
    "empty hostname": (spawn_fields(hostname=""), None),
    "hostname over 64 bytes": (spawn_fields(hostname="h" * 65), None),
    "uid range past 2^32": (spawn_fields(uid_base=2**32 - 10), None),
    "uid_count zero": (spawn_fields(uid_count=0), None),
    "negative nofile": (spawn_fields(nofile=-1), None),
    "number overflow": (spawn_fields(uid_base="99999999999999999999999"), None),
    "too many cgroups": (spawn_fields(cgroups=17), None),
    "layers' range past 2^32": (spawn_fields(layers_uid=2**32 - 10), None),
    "cgroup count beyond the fields": (spawn_fields(cgroups=2), b"/a\0"),
    "relative cgroup path": (spawn_fields(cgroups=1), b"relative\0" + zygote.encoded_plan(SPEC)),
    "too many layers": (spawn_fields(layers=129), None),
    "relative layer path": (spawn_fields(layer="layers/base"), None),
    "layer count beyond the fields": (spawn_fields(layers=3), None),
    "relative attach-layers target": (spawn_fields(), plan_of(rootfs.Step("attach-layers", "lower"), ROOT, PIVOT)),
    "no plan": (spawn_fields(), b""),
    "step count beyond the fields": (spawn_fields(), plan_of(ROOT, PIVOT)[:-5]),
    "too many steps": (spawn_fields(), zygote.encode_fields(["129"])),
    "plan without pivot": (spawn_fields(), plan_of(ROOT)),
    "relative target before the root": (spawn_fields(), plan_of(rootfs.Step("mkdir", "tmp", mode=0o755), ROOT, PIVOT)),
    "unknown op": (spawn_fields(), plan_of(ROOT, rootfs.Step("format-disk", "/"), PIVOT)),
    "unknown missing policy": (spawn_fields(), plan_of(ROOT, rootfs.Step("mkdir", "tmp", missing="maybe"), PIVOT)),
    "mode beyond 07777": (spawn_fields(), plan_of(ROOT, rootfs.Step("mkdir", "tmp", mode=0o10000), PIVOT)),
    "absolute within": (spawn_fields(), plan_of(ROOT, rootfs.Step("mount", "proc", within="/proc"), PIVOT)),
    "relative chdir": (spawn_fields(), plan_of(rootfs.Step("chdir", "layers"), ROOT, PIVOT)),
    "relative bind source": (spawn_fields(), plan_of(ROOT, rootfs.Step("bind-read-only", "acpi", "proc", "empty"), PIVOT)),
    "step after pivot": (spawn_fields(), plan_of(ROOT, PIVOT, rootfs.Step("mkdir", "tmp"))),
    "mount options over a page": (spawn_fields(), plan_of(ROOT, rootfs.Step("mount", "/x", data="o" * 4096), PIVOT)),
    "trailing fields": (spawn_fields(), zygote.encoded_plan(SPEC) + b"extra\0"),
    "relative hosts target": (spawn_fields(), plan_of(rootfs.Step("hosts", "hosts", data="127.0.0.1 localhost\n"), ROOT, PIVOT)),
    "hosts in the new root": (spawn_fields(), plan_of(ROOT, rootfs.Step("hosts", "/mnt/x", data="127.0.0.1 localhost\n"), PIVOT)),
    "hosts without text": (spawn_fields(), plan_of(rootfs.Step("hosts", "/mnt/scratch/lower/hosts"), ROOT, PIVOT)),
}


@pytest.mark.parametrize("case", BAD_SPAWNS, ids=list(BAD_SPAWNS))
def test_malformed_spawn_requests_are_refused(running, pipe_and_socket, case):
    fields, plan = BAD_SPAWNS[case]
    reply = ask(running, message(fields, plan), pipe_and_socket)
    assert reply.pid == 0 and reply.error is not None, case
    assert reply.error["step"] == "parse request"
    # Still serving: the next well-formed question gets its answer.
    assert ask(running, b"ping\0").error["target"] == "ping"


def test_a_spawn_without_its_two_descriptors_is_refused(running, pipe_and_socket):
    assert ask(running, message(spawn_fields())).error["target"] == "file descriptors"
    listen_fd, pipe_fd = pipe_and_socket
    assert ask(running, message(spawn_fields()), (pipe_fd, listen_fd)).error["target"] == "file descriptors"


def test_a_second_config_is_refused(running, tmp_path):
    program = tmp_path / "p.bpf"
    program.write_bytes(b"\0" * 8)
    fd = os.open(program, os.O_RDONLY)
    try:
        reply = ask(running, b"config\x000\x00", (fd,))
    finally:
        os.close(fd)
    assert reply.error is not None and reply.error["step"] == "parse config"


def test_random_bytes_never_crash_it(running):
    generator = random.Random(1234)
    good = message(spawn_fields())
    for _ in range(300):
        noisy = bytearray(good)
        for _ in range(generator.randint(1, 8)):
            noisy[generator.randrange(len(noisy))] = generator.choice(b"\0/0123456789x")
        cut = bytes(noisy[: generator.randrange(1, len(noisy) + 1)])
        reply = ask(running, cut)  # no descriptors: never reaches clone()
        assert reply.error is not None and reply.pid == 0
    assert ask(running, b"\0" * 70000).error["errno"] in (90, 22)  # EMSGSIZE (truncated) or EINVAL


def test_it_exits_when_the_spawner_goes(binary_fd, tmp_path):
    program = tmp_path / "seccomp.bpf"
    program.write_bytes(b"\x06\x00\x00\x00\x00\x00\xff\x7f")
    started = zygote.Zygote.start(binary_fd, 0, str(program))
    started.close()
    _, status = os.waitpid(started.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
