"""One "router process" for the shared-budget test: admits from many coroutines, prints what it got.

Usage: python shared_budget_worker.py REDIS_URL WINDOW_S TOKENS_LIMIT CLIENTS DURATION_S SEED
Prints "ready", waits for a line on stdin, runs, then prints one JSON line:
{"admitted": [[charged_at, cost], ...], "rejected": n}.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time

from qwenserve.ratelimit import RateLimiterConfig, RateLimitExceeded, make_rate_limiter
from qwenserve.tenancy import Tenant, TenantLimits


async def run(url: str, window_s: float, limit: int, clients: int, duration_s: float, seed: int) -> dict:
    limiter = make_rate_limiter(RateLimiterConfig(redis_url=url, window_s=window_s, redis_timeout_s=1.0))
    acme = Tenant("shared", TenantLimits(tokens_per_minute=limit))
    admitted: list[tuple[float, int]] = []
    rejected = 0
    await limiter.admit(Tenant("warmup"), 1, "warmup")  # connect and load the script before the clock starts
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    deadline = time.monotonic() + duration_s

    async def client(i: int) -> None:
        nonlocal rejected
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < deadline:
            cost = rng.randint(20, 120)
            try:
                admission = await limiter.admit(acme, cost, f"p{seed}-{i}")
            except RateLimitExceeded:
                rejected += 1
                await asyncio.sleep(rng.uniform(0.002, 0.01))
                continue
            admitted.append((admission.charged_at, cost))

    await asyncio.gather(*(client(i) for i in range(clients)))
    await limiter.close()
    return {"admitted": admitted, "rejected": rejected}


if __name__ == "__main__":
    url, window, limit, clients, duration, seed = sys.argv[1:7]
    result = asyncio.run(run(url, float(window), int(limit), int(clients), float(duration), int(seed)))
    print(json.dumps(result), flush=True)
