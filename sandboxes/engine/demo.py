"""A short demonstration of the engine: launch sandboxes, run a command in each, tear down.

python -m sandboxes.engine.demo [--count 100] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from .client import DEFAULT_SOCKET, AsyncEngineClient


async def run(count: int, concurrency: int, socket_path: str) -> int:
    clients = [AsyncEngineClient(socket_path) for _ in range(concurrency)]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(count):
        queue.put_nowait(index)
    ready_ms: list[float] = []
    exec_ms: list[float] = []
    outputs: list[str] = []

    async def worker(client: AsyncEngineClient) -> None:
        while not queue.empty():
            index = queue.get_nowait()
            started = time.perf_counter()
            sandbox = await client.create(template="base", size="tiny", ttl_s=120, labels={"demo": "engine"})
            result = await client.exec(sandbox["id"], f"echo sandbox {index} is $(hostname), running $(uname -sr)")
            ready_ms.append((time.perf_counter() - started) * 1000)
            exec_ms.append(result.duration_ms)
            outputs.append(result.stdout.decode().strip())
            await client.destroy(sandbox["id"])

    started = time.perf_counter()
    await asyncio.gather(*(worker(client) for client in clients))
    elapsed = time.perf_counter() - started
    for client in clients:
        await client.close()
    for line in outputs[:3]:
        print(f"  {line}")
    print(f"  ... and {len(outputs) - 3} more")
    print(f"{count} sandboxes created, used and destroyed in {elapsed:.2f} s ({count / elapsed:.0f}/s, {concurrency} at a time)")
    print(f"create to first exec: p50 {statistics.median(ready_ms):.1f} ms; exec inside: p50 {statistics.median(exec_ms):.2f} ms")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--socket", default=str(DEFAULT_SOCKET))
    args = parser.parse_args()
    return asyncio.run(run(args.count, args.concurrency, args.socket))


if __name__ == "__main__":
    raise SystemExit(main())
