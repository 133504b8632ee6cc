"""Preview URLs' request rate: a busybox httpd in a sandbox, loaded at its preview URL.

    sudo .venv/bin/python bench/ports_bench.py [--backend embedded|postgres] [--seconds 10] [--connections 32]

Starts the whole product the way the tests do (engine, worker, uvicorn for
HTTP), makes one tiny sandbox, starts ``httpd`` in it serving a small page,
exposes the port ``public`` and then ``key``, and loads each preview URL with
wrk (keep-alive connections to the web server; each request is its own
connection into the sandbox through the engine's ``ports.connect`` relay):
requests per second, latency quantiles (wrk's), and the web server's and the
engine's CPU per request.  For scale, the same page straight from inside the
sandbox is not measured here (no device reaches it from the host: that is the
point).  Prints a table; writes bench/results/ports-<backend>-latest.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.api_bench import wrk  # noqa: E402
from bench.engine_bench import conditions, cpu_seconds, write_report  # noqa: E402
from tests.support.ports import HTTP_PORT, serve_in  # noqa: E402
from tests.support.stack import PRODUCTION_TIMING, Stack  # noqa: E402

WRK_SCRIPT = """
wrk.headers["Host"] = "%s"
%s
wrk.path = "/index.html"
"""


def load(stack: Stack, work: Path, url: str, key: str | None, connections: int, seconds: int) -> dict[str, Any]:
    host = urlsplit(url).netloc
    script = work / f"preview-{'key' if key else 'public'}.lua"
    header = f'wrk.headers["X-Forkyard-Key"] = "{key}"' if key else ""
    script.write_text(WRK_SCRIPT % (host, header))
    wrk(stack.url, script, connections, 2)  # warm
    assert stack.engine is not None and stack.web_pid
    before = {"web": cpu_seconds(stack.web_pid), "engine": cpu_seconds(stack.engine.pid)}
    result = wrk(stack.url, script, connections, seconds)
    after = {"web": cpu_seconds(stack.web_pid), "engine": cpu_seconds(stack.engine.pid)}
    result["cpu_ms_per_request"] = {
        name: round((after[name] - before[name]) * 1000 / max(result["requests"], 1), 3) for name in before
    }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--backend", choices=("embedded", "postgres"), default=os.environ.get("FORKYARD_TEST_BACKEND", "embedded")
    )
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--connections", type=int, default=32)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("run as root: the product creates real sandboxes", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="fy-portsbench-", dir="/tmp"))
    os.chmod(work, 0o755)
    os.environ["FORKYARD_TEST_BACKEND"] = args.backend
    stack = Stack(work / "stack", backend=args.backend, timing=PRODUCTION_TIMING)
    report: dict[str, Any] = conditions(backend=args.backend, connections=args.connections, seconds=args.seconds)
    try:
        stack.start()
        stack.set_limits(stack.teams[0], requests_per_second=100000)
        with stack.client() as api:
            sandbox = api.post("/api/v1/sandboxes", json={"template": "base", "size": "tiny", "ttl_s": 600}).json()["id"]
            serve_in(api, sandbox)
            for auth in ("public", "key"):
                exposed = api.post(f"/api/v1/sandboxes/{sandbox}/ports", json={"port": HTTP_PORT, "auth": auth}).json()
                print(f"{auth}: wrk, {args.connections} connections, {args.seconds} s ...", flush=True)
                key = stack.teams[0].key if auth == "key" else None
                report[auth] = load(stack, work, exposed["url"], key, args.connections, args.seconds)
                time.sleep(1)
    finally:
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'auth':8} {'req/s':>9} {'p50 ms':>8} {'p90 ms':>8} {'web ms/req':>11} {'engine ms/req':>14}")
    for auth in ("public", "key"):
        row = report[auth]
        cpu = row["cpu_ms_per_request"]
        latency = row["latency_ms"]
        print(
            f"{auth:8} {row['per_second']:>9} {latency.get('p50', 0):>8} {latency.get('p90', 0):>8}"
            f" {cpu['web']:>11} {cpu['engine']:>14}"
        )
    write_report(f"ports-{args.backend}-latest.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
