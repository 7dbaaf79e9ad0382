"""A Redis client tuned for the request path: short timeouts, no silent retries."""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff


def connect(url: str, *, timeout_s: float = 0.25, max_connections: int = 64) -> Redis:
    """An asyncio Redis client that fails within `timeout_s` instead of retrying with backoff.

    redis-py retries failed commands with exponential backoff by default, which would turn an
    outage into multi-second stalls on every request; the limiter has its own failure policy.
    The pool waits up to `timeout_s` for a free connection when all `max_connections` are busy
    (the plain pool would raise at once, which the limiter would count as an outage).
    The client connects lazily, so this never blocks.
    """
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout_s,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )
    return Redis.from_pool(pool)
