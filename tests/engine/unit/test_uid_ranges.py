"""Which uid range a sandbox gets, and when a range may be handed out again (no root needed)."""

from __future__ import annotations

import pytest

from sandboxes.engine.uid_ranges import RESERVED_HOST_UIDS, RangeRecord, UidRanges

BASE, COUNT = 1_000_000_000, 65536


def ranges(**options: float) -> UidRanges:
    return UidRanges(BASE, COUNT, **options)  # type: ignore[arg-type]


def test_range_zero_owns_the_layers_and_no_sandbox_gets_it():
    pool = ranges(cooldown_s=0)
    assert pool.claim("a", 0.0) == BASE + COUNT
    assert pool.claim("b", 0.0) == BASE + 2 * COUNT
    assert pool.index_of(BASE) is None


def test_every_range_fits_below_the_invalid_uid_and_misses_systemds_dynamic_users():
    pool = ranges()
    last = pool.host_uid(pool.last)
    assert last + COUNT - 1 <= 2**32 - 2 < pool.host_uid(pool.last + 1) + COUNT - 1
    handed = set()
    while (uid := pool.claim("x", 0.0)) is not None:
        handed.add(uid)
    assert len(handed) == pool.status()["ranges"] == pool.last - 2
    for low, high in RESERVED_HOST_UIDS:
        assert not any(uid <= high and low <= uid + COUNT - 1 for uid in handed)


def test_a_released_range_rests_before_it_is_handed_out_again():
    pool = ranges(cooldown_s=60)
    first = pool.claim("a", 100.0)
    assert first is not None
    assert pool.release(first, "a", 100.0)
    assert pool.claim("b", 159.0) != first
    assert pool.status(159.0)["cooling"] == 1
    assert pool.claim("c", 160.0) == first  # rested: the lowest free range again


def test_only_the_holder_releases_its_range():
    pool = ranges(cooldown_s=0)
    uid = pool.claim("a", 0.0)
    assert uid is not None
    assert not pool.release(uid, "someone-else", 0.0)
    assert pool.holder(uid) == "a"
    assert pool.release(uid, "a", 0.0) and not pool.release(uid, "a", 0.0)


def test_none_when_every_range_is_held_or_resting():
    pool = UidRanges(BASE, COUNT, ranges=2, cooldown_s=60)
    a, b = pool.claim("a", 0.0), pool.claim("b", 0.0)
    assert pool.claim("c", 0.0) is None
    assert a is not None and pool.release(a, "a", 0.0)
    assert pool.claim("c", 30.0) is None
    assert pool.claim("c", 60.0) == a and b is not None


@pytest.mark.parametrize(
    "record,state",
    [
        (RangeRecord("live", BASE + COUNT, live=True, cgroup_exists=True, ended_at=0.0), "held"),
        # Gone from the record's point of view, but its cgroup remains: something of it may still run.
        (RangeRecord("stuck", BASE + COUNT, live=False, cgroup_exists=True, ended_at=10.0), "held"),
        (RangeRecord("recent", BASE + COUNT, live=False, cgroup_exists=False, ended_at=990.0), "cooling"),
        (RangeRecord("long-gone", BASE + COUNT, live=False, cgroup_exists=False, ended_at=10.0), "free"),
    ],
)
def test_rebuilt_at_start_from_the_records_and_the_cgroups(record: RangeRecord, state: str):
    pool = ranges(cooldown_s=60)
    pool.rebuild([record, RangeRecord("legacy", BASE, live=True, cgroup_exists=True, ended_at=0.0)], now=1000.0)
    status = pool.status(1000.0)
    assert {key: status[key] for key in ("held", "cooling")} == {
        "held": int(state == "held"),
        "cooling": int(state == "cooling"),
    }
    handed = pool.claim("next", 1000.0)
    assert (handed == BASE + COUNT) == (state == "free")
    assert handed != BASE  # range 0 (a sandbox an older engine made) is never handed out


def test_a_range_named_by_a_live_record_and_a_tombstone_is_held():
    """Tombstones keep the range they had: one reused since (a later record) wins."""
    pool = ranges(cooldown_s=60)
    pool.rebuild(
        [
            RangeRecord("old", BASE + COUNT, live=False, cgroup_exists=False, ended_at=999.0),
            RangeRecord("new", BASE + COUNT, live=True, cgroup_exists=True, ended_at=0.0),
        ],
        now=1000.0,
    )
    assert pool.holder(BASE + COUNT) == "new"
    assert pool.status(1000.0)["cooling"] == 0
    assert pool.claim("next", 1000.0) == BASE + 2 * COUNT
