"""Limiter configuration and the backend factory. The router fills it from its front door's flags
(`qwenserve/router/front_door.py`: `--redis-url`, `--ratelimit-window-s`, ...); nothing here reads the environment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from qwenserve.ratelimit.limiter import RateLimiter
from qwenserve.ratelimit.memory import InProcessRateLimiter
from qwenserve.ratelimit.redis_backend import RedisRateLimiter
from qwenserve.ratelimit.redis_client import connect

FailureMode = Literal["open", "closed"]


@dataclass(frozen=True)
class RateLimiterConfig:
    """How the router limits tenants. Without `redis_url` the limiter is in-process."""

    redis_url: str | None = None
    window_s: float = 60.0  # the "minute" of per-minute limits
    failure_mode: FailureMode = "open"  # when Redis is down: admit (open) or refuse (closed)
    redis_timeout_s: float = 0.25  # per connect / reply
    backend_retry_s: float = 1.0  # after a Redis error, apply the failure mode this long
    key_prefix: str = "qwenserve:rl"
    max_connections: int = 64

    def __post_init__(self) -> None:
        if self.failure_mode not in ("open", "closed"):
            raise ValueError(f"failure_mode must be 'open' or 'closed', got {self.failure_mode!r}")
        if self.window_s <= 0 or self.redis_timeout_s <= 0 or self.backend_retry_s < 0:
            raise ValueError("window_s and redis_timeout_s must be positive, backend_retry_s not negative")


def make_rate_limiter(config: RateLimiterConfig) -> RateLimiter:
    """The Redis limiter when a URL is configured, the in-process one otherwise."""
    if config.redis_url is None:
        return InProcessRateLimiter(window_s=config.window_s)
    client = connect(
        config.redis_url, timeout_s=config.redis_timeout_s, max_connections=config.max_connections
    )
    return RedisRateLimiter(
        client,
        window_s=config.window_s,
        fail_open=config.failure_mode == "open",
        backend_retry_s=config.backend_retry_s,
        key_prefix=config.key_prefix,
    )
