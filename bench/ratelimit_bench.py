"""Rate-limiter decisions/s and latency: Redis limiter vs a bare EVALSHA, plus the in-process limiter.

    .venv/bin/python bench/ratelimit_bench.py [--redis-url URL] [--ops 8000] [--concurrency 1 8 32]

Without --redis-url it starts its own redis-server on a free port. The baseline is measured in the
same run, from the same asyncio client and connection pool, at the same concurrency: EVALSHA of
`return 1`. Targets (issue 5): limiter >= 50% of the bare decisions/s, <= 0.5 ms p50 added.
Runs alternate baseline / limiter and report the median of --repeats, to spread noise evenly.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable

import redis

from qwenserve.ratelimit import InProcessRateLimiter, RedisRateLimiter
from qwenserve.ratelimit.redis_client import connect
from qwenserve.tenancy import Tenant, TenantLimits

TENANTS = [
    Tenant(f"t{i}", TenantLimits(requests_per_minute=10**9, tokens_per_minute=10**12)) for i in range(64)
]


def start_redis() -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="ratelimit-bench-")
    proc = subprocess.Popen(
        [
            shutil.which("redis-server") or "/usr/bin/redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            workdir,
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.02)
    client.close()
    return proc, f"redis://127.0.0.1:{port}/0"


async def measure(
    op: Callable[[int], Awaitable[object]], ops: int, concurrency: int
) -> tuple[float, list[float]]:
    """Run `ops` calls of `op` from `concurrency` coroutines; returns (ops/s, latencies in seconds)."""
    latencies: list[float] = []
    counter = iter(range(ops))

    async def worker() -> None:
        for i in counter:
            started = time.perf_counter()
            await op(i)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ops / (time.perf_counter() - started), latencies


def p(latencies: list[float], q: float) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def run(url: str, ops: int, concurrencies: list[int], repeats: int) -> None:
    client = connect(url, timeout_s=2.0, max_connections=max(concurrencies) + 8)
    bare = client.register_script("return 1")
    limiter = RedisRateLimiter(client, window_s=60.0)
    memory = InProcessRateLimiter(window_s=60.0)
    await bare()
    await limiter.admit(TENANTS[0], 1, "warmup")
    admissions = []

    async def bare_op(i: int) -> object:
        return await bare()

    async def admit_op(i: int) -> object:
        admission = await limiter.admit(TENANTS[i % len(TENANTS)], 500, f"req-{i}")
        if len(admissions) < ops:
            admissions.append(admission)
        return admission

    async def settle_op(i: int) -> object:
        return await limiter.settle(admissions[i % len(admissions)], 200)

    async def memory_op(i: int) -> object:
        return await memory.admit(TENANTS[i % len(TENANTS)], 500, f"req-{i}")

    print(f"redis {url}; {ops} decisions per run, median of {repeats} runs, 64 tenants, 60 s window")
    print(
        f"{'conc':>4} | {'bare EVALSHA/s':>14} {'p50 ms':>7} | {'limiter admit/s':>15} {'p50 ms':>7} {'p99 ms':>7}"
        f" | {'ratio':>5} {'added p50 ms':>12} | {'settle/s':>8} | {'in-process/s':>12} {'p50 ms':>7}"
    )
    for concurrency in concurrencies:
        rows: dict[str, list[tuple[float, float, float]]] = {
            "bare": [],
            "admit": [],
            "settle": [],
            "memory": [],
        }
        for _ in range(repeats):
            for name, op in (
                ("bare", bare_op),
                ("admit", admit_op),
                ("settle", settle_op),
                ("memory", memory_op),
            ):
                admissions_needed = name == "settle" and not admissions
                if admissions_needed:
                    continue
                rate, lat = await measure(op, ops, concurrency)
                rows[name].append((rate, p(lat, 0.5), p(lat, 0.99)))
            admissions.clear()
        med = {
            name: tuple(statistics.median(r[k] for r in runs) for k in range(3))
            for name, runs in rows.items()
        }
        b, a, s, m = med["bare"], med["admit"], med["settle"], med["memory"]
        print(
            f"{concurrency:>4} | {b[0]:>14.0f} {b[1]:>7.3f} | {a[0]:>15.0f} {a[1]:>7.3f} {a[2]:>7.3f}"
            f" | {a[0] / b[0]:>5.2f} {a[1] - b[1]:>12.3f} | {s[0]:>8.0f} | {m[0]:>12.0f} {m[1]:>7.3f}"
        )
    await limiter.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--redis-url")
    parser.add_argument("--ops", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    proc = None
    url = args.redis_url
    if url is None:
        proc, url = start_redis()
    try:
        asyncio.run(run(url, args.ops, args.concurrency, args.repeats))
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
