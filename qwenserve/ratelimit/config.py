"""Limiter configuration (flags with `QWENSERVE_*` environment fallbacks) and the backend factory."""

from __future__ import annotations

import os
from collections.abc import Mapping
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

    redis_url: str | None = None  # QWENSERVE_REDIS_URL
    window_s: float = 60.0  # QWENSERVE_RATELIMIT_WINDOW_S: the "minute" of per-minute limits
    failure_mode: FailureMode = "open"  # QWENSERVE_RATELIMIT_FAILURE_MODE: when Redis is down
    redis_timeout_s: float = 0.25  # QWENSERVE_REDIS_TIMEOUT_S: per connect / reply
    backend_retry_s: float = 1.0  # after a Redis error, apply the failure mode this long
    key_prefix: str = "qwenserve:rl"
    max_connections: int = 64

    def __post_init__(self) -> None:
        if self.failure_mode not in ("open", "closed"):
            raise ValueError(f"failure_mode must be 'open' or 'closed', got {self.failure_mode!r}")
        if self.window_s <= 0 or self.redis_timeout_s <= 0 or self.backend_retry_s < 0:
            raise ValueError("window_s and redis_timeout_s must be positive, backend_retry_s not negative")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> RateLimiterConfig:
        """Fill from `QWENSERVE_*` variables; explicit `overrides` (e.g. CLI flags) win when not None."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        if env.get("QWENSERVE_REDIS_URL"):
            values["redis_url"] = env["QWENSERVE_REDIS_URL"]
        if env.get("QWENSERVE_RATELIMIT_WINDOW_S"):
            values["window_s"] = float(env["QWENSERVE_RATELIMIT_WINDOW_S"])
        if env.get("QWENSERVE_RATELIMIT_FAILURE_MODE"):
            values["failure_mode"] = env["QWENSERVE_RATELIMIT_FAILURE_MODE"].strip().lower()
        if env.get("QWENSERVE_REDIS_TIMEOUT_S"):
            values["redis_timeout_s"] = float(env["QWENSERVE_REDIS_TIMEOUT_S"])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


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
