"""Snapshots in the engine: a sandbox's changes become a layer; forks start from it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from sandboxes.engine import errors, faults
from sandboxes.engine.client import EngineClient
from sandboxes.engine.layers import tree_digest
from sandboxes.engine.snapshots import FLATTEN_AT
from sandboxes.engine.template_store import layer_directory_name
from sandboxes.engine.trees import IdShift
from tests.engine.engines import assert_whole, cpu_ticks, frozen, sandbox_processes, separate_engine, snapshot_host, wait_for
from tests.support.engine import EngineProcess

pytestmark = pytest.mark.root

HTTPD = {"name": "web", "command": "httpd -f -p 8080 -h /srv", "ready": {"tcp": 8080}}


def _name(prefix: str = "snap") -> str:
    return f"{prefix}-{os.urandom(4).hex()}"


def _create(engine: EngineClient, made: list[str], template: str = "base") -> str:
    sandbox = engine.create(template=template, size="tiny", ttl_s=600)["id"]
    made.append(sandbox)
    return sandbox


def _run(engine: EngineClient, sandbox: str, command: str) -> str:
    result = engine.exec(sandbox, command)
    assert result.exit_code == 0, (command, result)
    return result.stdout.decode()


def test_a_fork_has_the_changes_and_its_writes_stay_its_own(engine: EngineClient, made: list[str]) -> None:
    source = _create(engine, made)
    _run(
        engine,
        source,
        "mkdir -p /work/tree && cd /work/tree && for i in $(seq 1 2000); do echo file $i > f$i; done"
        " && rm -rf /etc && mkdir /etc && echo only > /etc/only && rm /bin/ls && ln -s /etc/only /work/link"
        " && mkfifo /work/fifo && chmod 4755 /work/tree/f1 && chown 1000:1000 /work/tree/f2",
    )
    name = _name()
    snapshot = engine.call("snapshots.create", sandbox=source, name=name)
    made.append(name)
    assert snapshot["kind"] == "snapshot" and snapshot["parent"] == "base"
    assert snapshot["layers"][0].startswith("sha256:") and len(snapshot["layers"]) == 2
    assert snapshot["files"] >= 2000 and snapshot["size_bytes"] > 2000 * 7
    assert engine.call("snapshots.create", sandbox=source, name=name)["layers"] == snapshot["layers"], "a replay"

    forks = [_create(engine, made, name) for _ in range(3)]
    for fork in forks:
        assert _run(engine, fork, "ls /work/tree | wc -l").strip() == "2000"
        assert _run(engine, fork, "cat /work/tree/f1999") == "file 1999\n"
        # A directory deleted and made again hides the template's (the fork's own /etc/hosts aside).
        assert _run(engine, fork, "ls /etc") == "hosts\nonly\n"
        assert _run(engine, fork, "cat /etc/hosts").endswith(f"\t{fork}\t# this sandbox's hostname (forkyard)\n")
        assert engine.exec(fork, "test -e /bin/ls").exit_code == 1, "a deleted file stays deleted"
        assert _run(engine, fork, "readlink /work/link; test -p /work/fifo && echo fifo") == "/etc/only\nfifo\n"
        assert _run(engine, fork, "stat -c '%a %u:%g' /work/tree/f1 /work/tree/f2") == "4755 0:0\n644 1000:1000\n"
    _run(engine, forks[0], "echo mine > /work/tree/f1 && echo new > /work/new")
    assert _run(engine, forks[1], "cat /work/tree/f1; ls /work") == "file 1\nfifo\nlink\ntree\n"
    assert _run(engine, source, "cat /work/tree/f1") == "file 1\n"
    later = _create(engine, made, name)
    assert engine.exec(later, "test -e /work/new").exit_code == 1


def test_the_layer_id_is_its_content(engine: EngineClient, made: list[str], engine_process: EngineProcess) -> None:
    source = _create(engine, made)
    _run(engine, source, "mkdir /data && echo same > /data/a && ln -s a /data/b")
    first = engine.call("snapshots.create", sandbox=source, name=_name())
    made.append(first["name"])
    layer = first["layers"][0]
    config = engine_process.config
    fd = os.open(config.layers_dir / layer_directory_name(layer), os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert tree_digest(fd, IdShift(config.uid_base, config.uid_count)).digest == layer
    finally:
        os.close(fd)
    other = _create(engine, made)
    _run(engine, other, "mkdir /data && echo same > /data/a && ln -s a /data/b")
    second = engine.call("snapshots.create", sandbox=other, name=_name())
    made.append(second["name"])
    assert second["layers"][0] == layer, "the same changes give the same layer"


def test_a_snapshot_of_a_running_sandbox_freezes_it_only_to_copy_what_changed(
    engine: EngineClient, made: list[str], engine_process: EngineProcess
) -> None:
    source = _create(engine, made)
    _run(engine, source, "dd if=/dev/urandom of=/big bs=1M count=64 2>/dev/null")
    events: list[dict] = []
    snapshot, _ = engine.stream("snapshots.create", {"sandbox": source, "name": _name()}, on_event=events.append)
    made.append(snapshot["name"])
    paused = [event for event in events if event.get("phase") == "paused"]
    # The frozen pass copied nothing: the pause is what changed meanwhile, not the 64 MiB.
    assert paused and paused[0]["copied_bytes"] >= 64 << 20 and paused[0]["recopied_bytes"] == 0
    assert engine.get(source)["state"] == "running"
    assert not frozen(engine_process, source), "left frozen"
    fork = _create(engine, made, snapshot["name"])
    assert _run(engine, fork, "md5sum /big").split()[0] == _run(engine, source, "md5sum /big").split()[0]


def test_services_start_in_every_fork_before_it_is_handed_over(engine: EngineClient, made: list[str]) -> None:
    source = _create(engine, made)
    _run(engine, source, "mkdir -p /srv && echo hello from the snapshot > /srv/index.html")
    snapshot = engine.call("snapshots.create", sandbox=source, name=_name(), services=[HTTPD])
    made.append(snapshot["name"])
    assert snapshot["services"][0]["ready"] == {"tcp": 8080}
    for _ in range(3):
        fork = _create(engine, made, snapshot["name"])
        # No retry: the create returned, so the service answers now.
        assert _run(engine, fork, "wget -qO- http://127.0.0.1:8080/") == "hello from the snapshot\n"


def test_a_service_that_never_answers_fails_the_create(engine: EngineClient, made: list[str]) -> None:
    source = _create(engine, made)
    broken = {"name": "late", "command": "sleep 600", "ready": {"tcp": 9}, "timeout_s": 0.5}
    snapshot = engine.call("snapshots.create", sandbox=source, name=_name(), services=[broken])
    made.append(snapshot["name"])
    before = {item["id"] for item in engine.list()}
    with pytest.raises(errors.ServiceNotReady) as raised:
        engine.create(template=snapshot["name"], size="tiny", ttl_s=60)
    assert raised.value.details["service"] == "late"
    assert {item["id"] for item in engine.list()} == before, "the failed fork is gone"


def test_a_service_marked_not_to_wait_for_is_started_but_does_not_hold_the_fork_back(
    engine: EngineClient, made: list[str]
) -> None:
    source = _create(engine, made)
    _run(engine, source, "mkdir -p /srv && echo served > /srv/index.html")
    # It listens only after a minute: a fork that waited for it would fail (its timeout is 1 s).
    late = {"name": "late", "command": "sleep 60; exec httpd -f -p 8081 -h /srv", "ready": {"tcp": 8081}, "timeout_s": 1, "wait": False}
    snapshot = engine.call("snapshots.create", sandbox=source, name=_name(), services=[HTTPD, late])
    made.append(snapshot["name"])
    assert [service.get("wait", True) for service in snapshot["services"]] == [True, False]
    assert "wait" not in snapshot["services"][0], "kept only when off"
    fork = _create(engine, made, snapshot["name"])
    assert engine.get(fork)["state"] == "running"
    assert _run(engine, fork, "wget -qO- http://127.0.0.1:8080/") == "served\n"
    # Started, not waited for: its command runs, its port not yet open.
    assert _run(engine, fork, "ps -o args | grep -c '^sleep 60' || true").strip() == "1"
    assert engine.call("ports.wait", id=fork, port=8081, timeout_s=0)["listening"] is False


@pytest.mark.parametrize(
    "services,field",
    [
        ("web", "services"),
        ([{"name": "Web!", "command": "x", "ready": {"tcp": 1}}], "services.0.name"),
        ([{"name": "w", "command": "", "ready": {"tcp": 1}}], "services.0.command"),
        ([{"name": "w", "command": "x", "ready": {"tcp": 70000}}], "services.0.ready.tcp"),
        ([{"name": "w", "command": "x", "ready": {"smtp": 25}}], "services.0.ready"),
        ([{"name": "w", "command": "x", "ready": {"http": {"port": 80, "path": "no-slash"}}}], "services.0.ready.http.path"),
        ([{"name": "w", "command": "x", "ready": {"tcp": 1}, "timeout_s": 0}], "services.0.timeout_s"),
        ([{"name": "w", "command": "x", "ready": {"tcp": 1}, "wait": "no"}], "services.0.wait"),
    ],
)
def test_bad_services_are_refused(engine: EngineClient, sandbox: str, services: object, field: str) -> None:
    with pytest.raises(errors.InvalidRequest) as raised:
        engine.call("snapshots.create", sandbox=sandbox, name=_name(), services=services)
    assert raised.value.details["field"] == field


def test_bad_snapshot_requests(engine: EngineClient, sandbox: str) -> None:
    with pytest.raises(errors.SandboxNotFound):
        engine.call("snapshots.create", sandbox="sb-nope", name=_name())
    with pytest.raises(errors.InvalidRequest):
        engine.call("snapshots.create", sandbox=sandbox, name="Bad Name")
    with pytest.raises(errors.TemplateExists):
        engine.call("snapshots.create", sandbox=sandbox, name="base")
    with pytest.raises(errors.TemplateNotFound):
        engine.create(template="snap-never-made", size="tiny")


def test_pause_stops_cpu_use(engine: EngineClient, sandbox: str, engine_process: EngineProcess) -> None:
    engine.exec(sandbox, "setsid sh -c 'while :; do :; done' >/dev/null 2>&1 &")
    (spinner,) = wait_for(
        lambda: [pid for pid, line in sandbox_processes(sandbox).items() if line == "sh -c while :; do :; done"], "the loop"
    )
    engine.call("pause", id=sandbox)
    try:
        assert frozen(engine_process, sandbox)
        ticks = cpu_ticks(spinner)
        time.sleep(0.5)  # not a measure: a frozen task runs nothing, however long we look
        assert cpu_ticks(spinner) == ticks, "a paused sandbox runs nothing"
    finally:
        engine.call("resume", id=sandbox)
    assert not frozen(engine_process, sandbox)
    wait_for(lambda: cpu_ticks(spinner) > ticks, "resumed, the loop to spin again")


def test_snapshots_of_snapshots_flatten_when_deep(engine: EngineClient, made: list[str]) -> None:
    """Each generation adds, changes and deletes; past FLATTEN_AT layers they merge into one."""
    template = "base"
    depths = []
    for generation in range(FLATTEN_AT + 2):
        sandbox = _create(engine, made, template)
        _run(
            engine,
            sandbox,
            f"mkdir -p /gen && echo {generation} > /gen/{generation} && echo {generation} > /gen/latest"
            f" && rm -f /gen/{generation - 1} && rm -rf /opt && mkdir /opt && touch /opt/{generation}",
        )
        snapshot = engine.call("snapshots.create", sandbox=sandbox, name=_name(f"gen{generation}"))
        made.append(snapshot["name"])
        assert snapshot["parent"] == template
        depths.append(len(snapshot["layers"]) - 1)
        template = snapshot["name"]
    # One more layer each generation, until one more would pass FLATTEN_AT: then one merged layer.
    assert depths == [*range(1, FLATTEN_AT + 1), 1, 2]
    fork = _create(engine, made, template)
    last = FLATTEN_AT + 1
    assert _run(engine, fork, "ls /gen; cat /gen/latest; ls /opt") == f"{last}\nlatest\n{last}\n{last}\n"
    assert engine.exec(fork, "test -e /bin/busybox").exit_code == 0, "the template still shows through"


def test_a_snapshot_holds_symlinks_not_what_they_point_to(engine: EngineClient, made: list[str], engine_process) -> None:
    source = _create(engine, made)
    _run(engine, source, "ln -s /etc/shadow /stolen && ln -s ../../../../../../etc /up && mkdir /d && ln -s / /d/root")
    snapshot = engine.call("snapshots.create", sandbox=source, name=_name())
    made.append(snapshot["name"])
    layer = engine_process.config.layers_dir / layer_directory_name(snapshot["layers"][0])
    assert os.readlink(layer / "stolen") == "/etc/shadow" and os.path.islink(layer / "up")
    assert sorted(os.listdir(layer)) == ["d", "stolen", "up"]
    fork = _create(engine, made, snapshot["name"])
    assert _run(engine, fork, "readlink /stolen; readlink /d/root") == "/etc/shadow\n/\n"


def test_a_snapshot_survives_an_engine_restart(work_dir: Path) -> None:
    with separate_engine(work_dir / f"snap-restart-{os.urandom(3).hex()}") as engine_process:
        with engine_process.client() as client:
            source = client.create(template="base", size="tiny", ttl_s=600)["id"]
            _run(client, source, "mkdir -p /srv && echo kept > /srv/index.html")
            snapshot = client.call("snapshots.create", sandbox=source, name="kept", services=[HTTPD])
            client.destroy(source)
        engine_process.kill()
        engine_process.start()
        with engine_process.client() as client:
            assert client.call("templates.get", name="kept")["layers"] == snapshot["layers"]
            fork = client.create(template="kept", size="tiny", ttl_s=60)["id"]
            assert _run(client, fork, "wget -qO- http://127.0.0.1:8080/") == "kept\n"
            client.destroy(fork)


@pytest.mark.parametrize("step", faults.SNAPSHOT_STEPS)
def test_a_crash_while_snapshotting_loses_nothing(work_dir: Path, step: str) -> None:
    with separate_engine(work_dir / f"snap-crash-{os.urandom(3).hex()}") as engine_process:
        with engine_process.client() as client:
            before = snapshot_host(engine_process)
            source = client.create(template="base", size="tiny", ttl_s=600)["id"]
            _run(client, source, "echo precious > /data")
        engine_process.stop()
        engine_process.start(crash_at=step)
        with engine_process.client(timeout_s=30) as client:
            with pytest.raises(errors.Unavailable):
                client.call("snapshots.create", sandbox=source, name="interrupted")
        assert engine_process.wait_exit() == 137
        engine_process.start()
        layers_dir = engine_process.config.layers_dir
        with engine_process.client() as client:
            recovery = client.info()["recovery"]
            assert recovery["adopted_ids"] == [source], "the sandbox is adopted, thawed if the crash froze it"
            assert recovery["broken"] == 0
            assert_whole(client, source)
            assert _run(client, source, "cat /data") == "precious\n"
            assert not [name for name in os.listdir(layers_dir) if name.startswith(".incoming-")]
            with pytest.raises(errors.TemplateNotFound):
                client.call("templates.get", name="interrupted")
            retried = client.call("snapshots.create", sandbox=source, name="interrupted")
            fork = client.create(template=retried["name"], size="tiny", ttl_s=60)["id"]
            assert _run(client, fork, "cat /data") == "precious\n"
            client.destroy(fork)
            client.destroy(source)
            client.call("templates.delete", name="interrupted")
        assert snapshot_host(engine_process).leaks_since(before) == {}


def test_a_snapshot_moves_to_another_host_checked_against_its_content(
    work_dir: Path, engine: EngineClient, made: list[str]
) -> None:
    source = _create(engine, made)
    _run(engine, source, "mkdir -p /srv/deep && echo moved > /srv/index.html && rm -rf /etc && mkdir /etc && touch /etc/x")
    snapshot = engine.call("snapshots.create", sandbox=source, name=_name(), services=[HTTPD])
    made.append(snapshot["name"])
    with separate_engine(work_dir / f"snap-move-{os.urandom(3).hex()}") as other_process:
        with other_process.client() as other:
            have = [layer for template in other.call("templates.list")["templates"] for layer in template["layers"]]
            result, chunks = engine.stream("snapshots.export", {"name": snapshot["name"], "have": have})
            archive = b"".join(chunks or [])
            assert archive, "the snapshot's own layer travels; the template's stays home"
            tampered = archive.replace(b"moved\n", b"MOVED\n")
            with pytest.raises(errors.InvalidRequest):
                other.call("snapshots.import", body=tampered)
            with pytest.raises(errors.TemplateNotFound):
                other.call("templates.get", name=snapshot["name"])
            imported = other.call("snapshots.import", body=archive)
            assert imported["layers"] == snapshot["layers"]
            fork = other.create(template=snapshot["name"], size="tiny", ttl_s=60)["id"]
            # Its /etc made again: x, and the fork's own hosts file.
            assert _run(other, fork, "wget -qO- http://127.0.0.1:8080/; ls /etc") == "moved\nhosts\nx\n"
            other.destroy(fork)


def test_deleting_a_snapshot_keeps_its_layer_until_the_last_fork_goes(
    engine: EngineClient, made: list[str], engine_process
) -> None:
    source = _create(engine, made)
    _run(engine, source, "echo unique-$RANDOM-$$ > /mark")
    snapshot = engine.call("snapshots.create", sandbox=source, name=_name())
    fork = _create(engine, made, snapshot["name"])
    layer = engine_process.config.layers_dir / layer_directory_name(snapshot["layers"][0])
    engine.call("templates.delete", name=snapshot["name"])
    assert layer.is_dir(), "a live fork still mounts it"
    assert _run(engine, fork, "cat /mark").startswith("unique-")
    engine.destroy(fork)
    assert not layer.exists(), "the last fork gone, the layer goes"


def test_fork_a_hundred_with_a_tree_and_a_service(engine: EngineClient, made: list[str]) -> None:
    source = _create(engine, made)
    _run(
        engine,
        source,
        "mkdir -p /srv/app && cd /srv/app && for d in $(seq 1 30); do mkdir m$d; for f in $(seq 1 100); do echo $d.$f > m$d/f$f; done; done"
        " && echo ready > /srv/index.html",
    )
    snapshot = engine.call("snapshots.create", sandbox=source, name=_name(), services=[HTTPD])
    made.append(snapshot["name"])
    assert snapshot["files"] >= 3000
    forks = [_create(engine, made, snapshot["name"]) for _ in range(100)]
    for index, fork in enumerate(forks):
        check = f"find /srv/app -type f | wc -l; cat /srv/app/m30/f100; wget -qO- http://127.0.0.1:8080/; echo {index} > /srv/app/m1/f1"
        assert _run(engine, fork, check) == "3000\n30.100\nready\n"
    for index, fork in enumerate(forks):
        assert _run(engine, fork, "cat /srv/app/m1/f1") == f"{index}\n", "each fork's write is its own"
    assert _run(engine, source, "cat /srv/app/m1/f1") == "1.1\n"
    for fork in forks:
        engine.destroy(fork)
        made.remove(fork)


def test_a_fork_is_creating_until_its_services_answer(engine: EngineClient, engine_process, made: list[str]) -> None:
    import threading

    source = _create(engine, made)
    _run(engine, source, "mkdir -p /srv && echo late > /srv/index.html")
    # The service waits for a sleep the test ends from the host: "creating" is
    # checked while it certainly has not answered.
    slow = {"name": "slow", "command": "sleep 641; exec httpd -f -p 8080 -h /srv", "ready": {"tcp": 8080}, "timeout_s": 300}
    snapshot = engine.call("snapshots.create", sandbox=source, name=_name(), services=[slow])
    made.append(snapshot["name"])
    created: dict = {}
    worker = threading.Thread(target=lambda: created.update(engine.create(template=snapshot["name"], size="tiny", ttl_s=60)))
    worker.start()
    try:
        with engine_process.client() as other:
            (fork,) = wait_for(
                lambda: [item["id"] for item in other.list() if item["template"] == snapshot["name"]], "the fork to be listed"
            )
            (gate,) = wait_for(
                lambda: [pid for pid, line in sandbox_processes(fork).items() if line == "sleep 641"], "the service to start"
            )
            assert [item["state"] for item in other.list() if item["id"] == fork] == ["creating"], "handed out too early"
            os.kill(gate, signal.SIGKILL)
    finally:
        worker.join(120)
    made.append(created["id"])
    assert created["state"] == "running"
    assert _run(engine, created["id"], "wget -qO- http://127.0.0.1:8080/") == "late\n"


def test_snapshots_that_changed_nothing_in_a_row_still_fork(engine: EngineClient, made: list[str]) -> None:
    """Each such snapshot's layer is the empty tree: one stack holds it once (overlayfs refuses a layer
    twice), and forks of the last one still see everything below it."""
    template = "base"
    _run(engine, source := _create(engine, made), "echo kept > /kept")
    names = []
    for _ in range(3):
        name = _name()
        snapshot = engine.call("snapshots.create", sandbox=source, name=name)
        made.append(name)
        names.append(name)
        assert len(snapshot["layers"]) == len(set(snapshot["layers"])), snapshot["layers"]
        source = _create(engine, made, name)
        template = name
    assert _run(engine, _create(engine, made, template), "cat /kept") == "kept\n"
    stacks = [engine.call("templates.get", name=name)["layers"] for name in names]
    assert len(stacks[2]) == len(stacks[1]) == 3 and stacks[1][0] == stacks[2][0], stacks
