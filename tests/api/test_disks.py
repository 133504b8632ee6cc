"""A sandbox's disk through the API: its size's by default, or ``disk_mib``; enforced by the host's quota, shown
in its metrics, and priced by the rate card's disk line beyond what its size includes."""

from __future__ import annotations

from decimal import Decimal

import pytest

from tests.support.stack import Stack, launch_members, wait_for_launch

pytestmark = pytest.mark.root

MEBIBYTE = 1 << 20


def _exec(api, sandbox: str, cmd: str, timeout_s: int = 60) -> dict:
    answer = api.post(f"/api/v1/sandboxes/{sandbox}/exec", json={"cmd": cmd, "timeout_s": timeout_s})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_tiny_sandbox_has_a_gibibyte_of_disk_beyond_its_memory(api):
    created = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 300})
    assert created.status_code == 201, created.text
    sandbox = created.json()
    assert (sandbox["memory_mib"], sandbox["disk_mib"]) == (128, 1024)
    try:
        # More than its memory, written by the sandbox itself: its memory limit is memory only.
        written = _exec(api, sandbox["id"], "dd if=/dev/zero of=/tmp/big bs=1M count=200 2>&1; echo rc=$?; wc -c < /tmp/big")
        assert "rc=0" in written["stdout"] and written["stdout"].split()[-1] == str(200 * MEBIBYTE), written
        assert not written["oom_killed"]
        metrics = api.get(f"/api/v1/sandboxes/{sandbox['id']}/metrics").json()
        assert metrics["disk_limit_bytes"] == 1024 * MEBIBYTE
        assert metrics["disk_used_bytes"] >= 200 * MEBIBYTE
        assert metrics["memory_limit_bytes"] == 128 * MEBIBYTE
    finally:
        api.delete(f"/api/v1/sandboxes/{sandbox['id']}")


def test_disk_mib_sets_the_quota_the_host_enforces(api):
    sandbox = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "disk_mib": 48, "ttl_s": 300}).json()
    try:
        assert sandbox["disk_mib"] == 48
        assert api.get(f"/api/v1/sandboxes/{sandbox['id']}").json()["disk_mib"] == 48
        filled = _exec(api, sandbox["id"], "dd if=/dev/zero of=/tmp/fill bs=1M count=100 conv=fsync 2>&1; echo rc=$?")
        assert "Disk quota exceeded" in filled["stdout"] and "rc=0" not in filled["stdout"], filled
        # The file API meets the same limit, and says so with a code.
        refused = api.put(f"/api/v1/sandboxes/{sandbox['id']}/files", params={"path": "/tmp/more"}, content=b"x" * (8 * MEBIBYTE))
        assert (refused.status_code, refused.json()["error"]["code"]) == (413, "too_large"), refused.text
        assert "disk is full" in refused.json()["error"]["message"]
        assert api.get(f"/api/v1/sandboxes/{sandbox['id']}/metrics").json()["disk_limit_bytes"] == 48 * MEBIBYTE
    finally:
        api.delete(f"/api/v1/sandboxes/{sandbox['id']}")


@pytest.mark.parametrize("disk_mib", [0, 15, 256 * 1024 + 1, "big"])
def test_a_disk_out_of_bounds_is_refused_with_its_field_named(api, disk_mib):
    refused = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "disk_mib": disk_mib})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["field"] == "disk_mib"


def test_a_launchs_members_get_its_disk(api):
    created = api.post("/api/v1/launches", json={"template": "base", "size": "tiny", "count": 2, "disk_mib": 64, "ttl_s": 300})
    assert created.status_code == 201, created.text
    try:
        wait_for_launch(api, created.json()["id"], {"ready"})
        for member in launch_members(api, created.json()["id"]):
            assert member["disk_mib"] == 64
            assert api.get(f"/api/v1/sandboxes/{member['id']}/metrics").json()["disk_limit_bytes"] == 64 * MEBIBYTE
    finally:
        api.delete(f"/api/v1/launches/{created.json()['id']}")


def test_disk_beyond_the_size_s_is_priced_by_the_rate_card(api, stack: Stack):
    """A tiny sandbox with 3 GiB of disk pays the tiny line and 2 GiB of the disk line, per hour."""
    sandbox = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "disk_mib": 3 * 1024, "ttl_s": 300}).json()
    try:
        out = stack.shell(
            "from billing.models import Price, UsagePeriod; "
            f"period = UsagePeriod.objects.get(sandbox_id={sandbox['id']!r}, ended_at__isnull=True); "
            "tiny = Price.objects.get(kind='running', size='tiny').amount; disk = Price.objects.get(kind='disk').amount; "
            "print(period.unit_price, tiny, disk)"
        )
        unit, tiny, disk = (Decimal(value) for value in out.strip().splitlines()[-1].split())
        assert unit == tiny + 2 * disk, (unit, tiny, disk)
    finally:
        api.delete(f"/api/v1/sandboxes/{sandbox['id']}")
