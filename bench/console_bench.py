"""The console with 32,752 sandboxes in the team: how long each page takes.

    sudo .venv/bin/python bench/console_bench.py [--backend embedded|postgres] [--rows 32752]

Starts the product the way the tests do, gives a team a finished launch of
--rows sandboxes (most running, some failed or destroyed, labelled by shard)
with a billed period each over the last day, signs in through the login form
as that team's owner, and times every console page through the HTTP server (uvicorn), as a
browser would load it: overview, the sandbox list (first page, next page,
filtered by state and by label), a sandbox, launches, a launch, usage (plotly
charts), the board, keys and policies. Reports p50/p95 of 20 loads each and
the page's size; writes bench/results/console-<backend>-<rows>-latest.json.

The pages page and aggregate in the database, so their time should not grow
with the team: the same run with --rows 1000 is the comparison.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine_bench import conclude, conditions, summary, write_report  # noqa: E402
from tests.support.stack import PRODUCTION_TIMING, Stack, Team  # noqa: E402

LOADS = 20
GOAL_P95_MS = 250.0

# Run by `manage.py shell` in the stack's environment: the rows a busy team has.
POPULATE = """
import random
from datetime import timedelta
from decimal import Decimal
from django.utils import timezone
from billing.models import UsagePeriod
from console.models import ApiKey, Team
from sandboxes.models import Launch, Sandbox

team = Team.objects.get(pk={team!r})
key = ApiKey.objects.filter(team=team).first()
now = timezone.now()
rows = {rows}
launch = Launch.objects.create(
    team=team, api_key=key, template="base", size="tiny", cpu=1, memory_mib=128, ttl_s=3600, count=rows,
    state=Launch.State.READY, labels={{"run": "bench"}},
)
random.seed(7)
sandboxes = []
for index in range(rows):
    roll = random.random()
    state = Sandbox.State.FAILED if roll < 0.05 else Sandbox.State.DESTROYED if roll < 0.10 else Sandbox.State.RUNNING
    created = now - timedelta(seconds=random.randint(60, 86_000))
    sandboxes.append(Sandbox(
        team=team, api_key=key, launch=launch, launch_index=index, template="base", size="tiny", cpu=1,
        memory_mib=128, ttl_s=3600, state=state, labels={{"launch": launch.id, "shard": str(index % 8)}},
        created_at=created, ready_at=created, engine_id=f"bench-{{index}}",
    ))
Sandbox.objects.bulk_create(sandboxes, batch_size=1000)
periods = []
for sandbox in sandboxes:
    started = sandbox.created_at
    ended = started + timedelta(seconds=random.randint(30, 3000))
    duration = int((ended - started).total_seconds() * 1000)
    periods.append(UsagePeriod(
        team=team, api_key=key, sandbox=sandbox, kind=UsagePeriod.Kind.RUNNING, size="tiny", labels=sandbox.labels,
        unit_price=Decimal("0.01"), started_at=started, started_ms=int(started.timestamp() * 1000), ended_at=ended,
        ended_ms=int(ended.timestamp() * 1000), duration_ms=duration,
        amount=(Decimal(duration) * Decimal("0.01") / 3_600_000).quantize(Decimal("0.00000001")),
    ))
UsagePeriod.objects.bulk_create(periods, batch_size=1000)
print(launch.id, sandboxes[rows // 2].id)
"""


def sign_in(stack: Stack, team: Team) -> httpx.Client:
    client = httpx.Client(base_url=stack.url, timeout=60, follow_redirects=True)
    form = client.get("/login/").text
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form)
    assert token, "no CSRF token on the login form"
    signed = client.post(
        "/login/",
        data={"username": team.username, "password": team.password, "csrfmiddlewaretoken": token.group(1)},
        headers={"Referer": f"{stack.url}/login/"},
    )
    assert signed.status_code == 200 and "/login/" not in str(signed.url), "could not sign in"
    return client


def time_page(client: httpx.Client, path: str) -> dict[str, Any]:
    for _ in range(2):
        warm = client.get(path)
        assert warm.status_code == 200, f"{path}: {warm.status_code}"
    times, size = [], 0
    for _ in range(LOADS):
        started = time.perf_counter()
        response = client.get(path)
        times.append((time.perf_counter() - started) * 1000)
        size = len(response.content)
    return summary(times) | {"bytes": size}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("embedded", "postgres"), default="embedded")
    parser.add_argument("--rows", type=int, default=32752)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("run as root: the product's engine creates real sandboxes", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="fy-consolebench-", dir="/tmp"))
    os.chmod(work, 0o755)
    stack = Stack(work / "stack", backend=args.backend, timing=PRODUCTION_TIMING)
    report: dict[str, Any] = conditions(backend=args.backend, rows=args.rows)
    try:
        stack.start()
        team = stack.new_team("Console bench")
        print(f"{args.backend}: {args.rows} sandboxes and their billed periods...", flush=True)
        started = time.perf_counter()
        launch_id, sandbox_id = stack.shell(POPULATE.format(team=team.team_id, rows=args.rows)).split()[-2:]
        report["populate_s"] = round(time.perf_counter() - started, 1)
        client = sign_in(stack, team)
        try:
            first = client.get("/sandboxes/").text
            following = re.search(r'<a rel="next" href="([^"]+)"', first)
            assert following and following.group(1).startswith("?"), "the sandbox list has no next page"
            pages = {
                "overview": "/",
                "sandboxes": "/sandboxes/",
                "sandboxes, next page": "/sandboxes/" + following.group(1).replace("&amp;", "&"),
                "sandboxes, failed": "/sandboxes/?state=failed",
                "sandboxes, label shard=3": "/sandboxes/?label=shard%3D3",
                "a sandbox": f"/sandboxes/{sandbox_id}/",
                "launches": "/launches/",
                f"a launch of {args.rows}": f"/launches/{launch_id}/",
                "usage (charts)": "/usage/",
                "board": f"/board/?launch={launch_id}",
                "keys": "/keys/",
                "policies": "/policies/",
            }
            report["pages"] = {}
            for name, path in pages.items():
                print(f"  {name}...", flush=True)
                report["pages"][name] = time_page(client, path)
        finally:
            client.close()
    finally:
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)
    conclude(report)
    slowest = max(page["p95"] for page in report["pages"].values())
    report["goal_p95_under_ms"] = GOAL_P95_MS
    report["goal_met"] = slowest < GOAL_P95_MS
    print(f"\n{args.rows} sandboxes in the team ({args.backend}); {LOADS} loads of each page")
    print(f"{'page':34} {'p50 (ms)':>9} {'p95 (ms)':>9} {'KiB':>7}")
    for name, page in report["pages"].items():
        print(f"{name:34} {page['p50']:>9} {page['p95']:>9} {page['bytes'] / 1024:>7.1f}")
    print(f"goal: every page p95 under {GOAL_P95_MS:g} ms: {'met' if report['goal_met'] else 'NOT met'} (slowest {slowest} ms)")
    write_report(f"console-{args.backend}-{args.rows}-latest.json", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
