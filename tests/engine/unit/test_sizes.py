"""Sizes: the shared catalogue, and how a create's size, cpu and memory_mib become limits.

The engine here is never started: ``parse_create`` needs only the record of
the template, so these run without root.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes.engine import errors
from sandboxes.engine.cgroups import CgroupsV2
from sandboxes.engine.config import EngineConfig
from sandboxes.engine.engine import Engine
from sandboxes.engine.sizes import DEFAULT_SIZES, MEBIBYTE, Size, explicit_size
from sandboxes.engine.store import TemplateRecord

# More than any host has: accepted by its name (and its exact shape), never as an explicit shape.
HUGE = Size(cpu=4096, memory_mib=1 << 30, pids=100_000)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    config = EngineConfig(
        state_dir=tmp_path / "state",
        run_dir=tmp_path / "run",
        cgroup_root=tmp_path / "cgroup",
        cgroup_parent="/forkyard",  # absolute: nothing is read from /proc
        sizes={**DEFAULT_SIZES, "huge": HUGE},
    )
    config.state_dir.mkdir()
    engine = Engine(config, cgroups=CgroupsV2(config))
    engine.templates.put(TemplateRecord(name="base", layers=["sha256:base"]))
    yield engine
    engine.store.close()


def _parse(engine: Engine, **args):
    return engine.parse_create({"template": "base", **args})


def test_the_catalogue_is_shared_read_only_and_copied_into_each_config():
    with pytest.raises(TypeError):
        DEFAULT_SIZES["tiny"] = Size(cpu=8, memory_mib=8)
    config = EngineConfig()
    assert config.sizes == dict(DEFAULT_SIZES)
    config.sizes["mine"] = Size(cpu=1, memory_mib=64)
    assert "mine" not in DEFAULT_SIZES


def test_an_explicit_shape_gets_two_pids_per_mib_within_bounds():
    assert explicit_size(0.5, 96).pids == 192
    assert explicit_size(0.5, 16).pids == 64
    assert explicit_size(8, 1 << 20).pids == 16384
    # Its disk: twice its memory, within 1 and 64 GiB.
    assert explicit_size(0.5, 96).disk_bytes == 1024 * MEBIBYTE
    assert explicit_size(2, 2048).disk_bytes == 4096 * MEBIBYTE
    assert explicit_size(8, 1 << 20).disk_bytes == 64 * 1024 * MEBIBYTE


def test_a_size_alone_is_that_size(engine: Engine):
    request = _parse(engine, size="tiny")
    assert (request.size, request.shape_is_named_size) == ("tiny", True)
    assert (request.cpu, request.memory_mib, request.pids) == (1, 128, 256)
    assert _parse(engine).size == "default"


def test_cpu_and_memory_alone_are_an_explicit_shape(engine: Engine):
    request = _parse(engine, cpu=0.5, memory_mib=96)
    assert (request.size, request.shape_is_named_size) == ("", False)
    assert (request.cpu, request.memory_mib, request.pids, request.disk_bytes) == (0.5, 96, 192, 1024 * MEBIBYTE)


@pytest.mark.parametrize("cpu,memory_mib", [(1, 128), (1.0, 128), (1.0, 128.0)])
def test_a_size_with_its_own_shape_is_that_size(engine: Engine, cpu, memory_mib):
    request = _parse(engine, size="tiny", cpu=cpu, memory_mib=memory_mib)
    assert (request.size, request.shape_is_named_size) == ("tiny", True)
    assert (request.cpu, request.memory_mib, request.pids) == (1, 128, 256)


def test_a_size_with_another_shape_keeps_its_name_and_takes_the_shape(engine: Engine):
    request = _parse(engine, size="tiny", cpu=0.5, memory_mib=96)
    assert (request.size, request.shape_is_named_size) == ("tiny", False)
    assert (request.cpu, request.memory_mib, request.pids, request.disk_bytes) == (0.5, 96, 192, 1024 * MEBIBYTE)


def test_disk_mib_replaces_the_size_s_disk_and_leaves_its_warm_pool(engine: Engine):
    assert _parse(engine, size="tiny").disk_bytes == 1024 * MEBIBYTE
    request = _parse(engine, size="tiny", disk_mib=64)
    assert (request.disk_bytes, request.shape_is_named_size) == (64 * MEBIBYTE, False)  # not the pool's shape
    assert _parse(engine, size="tiny", disk_mib=1024).shape_is_named_size  # its own disk: the pool serves it
    for bad in (15, engine.config.max_disk_mib + 1, "1G", True):
        with pytest.raises(errors.InvalidRequest) as raised:
            _parse(engine, size="tiny", disk_mib=bad)
        assert raised.value.details["field"] == "disk_mib"


def test_a_size_this_engine_does_not_know_keeps_its_name_with_the_shape(engine: Engine):
    request = _parse(engine, size="small", cpu=1, memory_mib=512)
    assert (request.size, request.shape_is_named_size, request.pids) == ("small", False, 1024)


def test_a_named_shape_is_not_held_to_the_hosts_bounds_but_an_explicit_one_is(engine: Engine):
    request = _parse(engine, size="huge", cpu=HUGE.cpu, memory_mib=HUGE.memory_mib)
    assert (request.size, request.shape_is_named_size, request.pids) == ("huge", True, HUGE.pids)
    with pytest.raises(errors.InvalidSize) as raised:
        _parse(engine, cpu=HUGE.cpu, memory_mib=HUGE.memory_mib)
    assert raised.value.details["field"] == "cpu"


@pytest.mark.parametrize(
    "args,missing",
    [
        ({"cpu": 1}, "memory_mib"),
        ({"memory_mib": 128}, "cpu"),
        ({"size": "tiny", "cpu": 1}, "memory_mib"),
        ({"size": "tiny", "memory_mib": 128}, "cpu"),
    ],
)
def test_half_a_shape_is_refused_naming_the_missing_field(engine: Engine, args, missing):
    with pytest.raises(errors.InvalidSize) as raised:
        _parse(engine, **args)
    assert raised.value.details["field"] == missing
    assert missing in raised.value.message


@pytest.mark.parametrize(
    "args,field",
    [
        ({"size": 5, "cpu": 1, "memory_mib": 128}, "size"),
        ({"size": "x" * 65, "cpu": 1, "memory_mib": 128}, "size"),
        ({"size": "tiny", "cpu": True, "memory_mib": 128}, "cpu"),
        ({"size": "tiny", "cpu": 1, "memory_mib": 128.5}, "memory_mib"),
        ({"size": "enormous"}, "size"),
    ],
)
def test_bad_sizes_and_shapes_are_refused_naming_the_field(engine: Engine, args, field):
    with pytest.raises(errors.InvalidSize) as raised:
        _parse(engine, **args)
    assert raised.value.details["field"] == field
