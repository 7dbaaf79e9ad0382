"""Token-level rate limits per tenant: requests and tokens per sliding window.

    limiter = make_rate_limiter(RateLimiterConfig(redis_url="redis://...", window_s=60.0))
    admission = await limiter.admit(tenant, prompt_tokens + max_tokens, request_id)  # may raise
    ...generate...
    await limiter.settle(admission, prompt_tokens + completion_tokens)

Two backends behind `RateLimiter`: `InProcessRateLimiter` (one process) and `RedisRateLimiter`
(atomic Lua, one round trip per decision, shared by every router replica).
"""

from qwenserve.ratelimit.admission import (
    Admission,
    LimitStatus,
    RateLimiterUnavailable,
    RateLimitExceeded,
    RequestTooLarge,
)
from qwenserve.ratelimit.config import RateLimiterConfig, make_rate_limiter
from qwenserve.ratelimit.headers import format_reset, grpc_rate_limit_metadata, rate_limit_headers
from qwenserve.ratelimit.limiter import RateLimiter
from qwenserve.ratelimit.memory import InProcessRateLimiter
from qwenserve.ratelimit.redis_backend import RedisRateLimiter

__all__ = [
    "Admission",
    "InProcessRateLimiter",
    "LimitStatus",
    "RateLimitExceeded",
    "RateLimiter",
    "RateLimiterConfig",
    "RateLimiterUnavailable",
    "RedisRateLimiter",
    "RequestTooLarge",
    "format_reset",
    "grpc_rate_limit_metadata",
    "make_rate_limiter",
    "rate_limit_headers",
]
