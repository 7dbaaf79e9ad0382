"""The Redis backend: one EVALSHA per decision, shared exactly by every router process.

When Redis fails (refused, timed out, errors), the decision follows the configured failure mode:
fail open (admit, marked `degraded`) or fail closed (`RateLimiterUnavailable`). After a failure
the backend is not asked again for `backend_retry_s`, so an outage costs each request nothing
instead of a timeout; the first decision after that probes Redis again.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

from redis.asyncio import Redis
from redis.exceptions import RedisError

from qwenserve.ratelimit import metrics
from qwenserve.ratelimit.admission import Admission, RateLimiterUnavailable
from qwenserve.ratelimit.limiter import (
    RateLimiter,
    limit_status,
    limits_of,
    rejection,
    unknown_status,
    validate_cost,
)
from qwenserve.ratelimit.redis_scripts import ADMIT, SETTLE
from qwenserve.ratelimit.window import RateLimits, Verdict, WindowUsage

if TYPE_CHECKING:
    from qwenserve.tenancy.tenants import Tenant

log = logging.getLogger(__name__)

BACKEND_FAILURES = (RedisError, OSError, TimeoutError)


class RedisRateLimiter(RateLimiter):
    """Sliding-log limits kept in Redis; see `redis_scripts.py` for the key layout."""

    backend = "redis"

    def __init__(
        self,
        client: Redis,
        *,
        window_s: float = 60.0,
        fail_open: bool = True,
        backend_retry_s: float = 1.0,
        key_prefix: str = "qwenserve:rl",
    ) -> None:
        super().__init__(window_s)
        self._client = client
        self._fail_open = fail_open
        # No asyncio timeout around calls: every step (pool wait, connect, reply) is already bounded
        # by the client's timeouts (redis_client.connect), and one cost more than the rest of our code.
        self._backend_retry_s = backend_retry_s
        self._key_prefix = key_prefix
        self._window_us = int(round(window_s * 1_000_000))
        self._ttl_ms = int(math.ceil(window_s * 1000)) + 1000
        self._admit_script = client.register_script(ADMIT)
        self._settle_script = client.register_script(SETTLE)
        self._down_until = 0.0
        self._down = False
        self._admitted = metrics.DECISIONS.labels("admitted", self.backend)
        self._decision_seconds = metrics.DECISION_SECONDS.labels(self.backend)
        kwargs = client.connection_pool.connection_kwargs
        self._where = f"redis at {kwargs.get('host', '?')}:{kwargs.get('port', '?')}"

    def _keys(self, tenant_id: str) -> list[str]:
        base = f"{self._key_prefix}:{{{tenant_id}}}"
        return [f"{base}:log", f"{base}:cost"]

    async def admit(self, tenant: Tenant, cost_tokens: int, request_id: str) -> Admission:
        """See `RateLimiter.admit`."""
        validate_cost(cost_tokens)
        limits = limits_of(tenant)
        if self._down and time.monotonic() < self._down_until:
            return self._fail(tenant.id, limits, cost_tokens, request_id, "still in back-off after an error")
        entry_id = self._new_entry_id(request_id)
        args = (
            cost_tokens,
            -1 if limits.requests is None else limits.requests,
            -1 if limits.tokens is None else limits.tokens,
            self._window_us,
            entry_id,
            self._ttl_ms,
        )
        started = time.perf_counter()
        try:
            reply = await self._admit_script(keys=self._keys(tenant.id), args=args)
        except BACKEND_FAILURES as exc:
            # A reply lost after the script ran leaves a charge behind: the safe direction.
            self._record_failure("admit", exc)
            return self._fail(tenant.id, limits, cost_tokens, request_id, _describe(exc))
        self._decision_seconds.observe(time.perf_counter() - started)
        if self._down:
            self._record_success()
        code, requests, tokens, now_us, reset_us, retry_us = map(int, reply.split())
        usage = WindowUsage(requests=requests, tokens=tokens)
        if code == 1:
            self._admitted.inc()
            return Admission(
                tenant_id=tenant.id,
                request_id=request_id,
                entry_id=entry_id,
                cost_tokens=cost_tokens,
                charged_at=now_us / 1_000_000,
                status=limit_status(limits, usage, self.window_s),
                backend=self.backend,
            )
        too_large = code == -1
        verdict = Verdict(
            over_requests=not too_large
            and limits.requests is not None
            and usage.requests + 1 > limits.requests,
            over_tokens=not too_large
            and limits.tokens is not None
            and usage.tokens + cost_tokens > limits.tokens,
            too_large=too_large,
        )
        status = limit_status(limits, usage, reset_us / 1_000_000)
        error = rejection(
            tenant.id, verdict, limits, usage, cost_tokens, retry_us / 1_000_000, status, self.window_s
        )
        metrics.DECISIONS.labels("too_large" if too_large else "rejected", self.backend).inc()
        for limit in error.limited_by:
            metrics.REJECTIONS.labels(tenant.id, limit).inc()
        raise error

    async def settle(self, admission: Admission, actual_tokens: int) -> int:
        """See `RateLimiter.settle`."""
        if admission.degraded or actual_tokens >= admission.cost_tokens:
            return 0
        if self._down and time.monotonic() < self._down_until:
            metrics.BACKEND_ERRORS.labels(self.backend, "settle").inc()
            return 0
        try:
            refunded = int(
                await self._settle_script(
                    keys=self._keys(admission.tenant_id), args=(admission.entry_id, max(0, actual_tokens))
                )
            )
        except BACKEND_FAILURES as exc:
            self._record_failure("settle", exc)
            return 0
        self._record_success()
        if refunded:
            metrics.REFUNDED_TOKENS.labels(self.backend).inc(refunded)
        return refunded

    async def close(self) -> None:
        """Close the Redis client and its connection pool."""
        await self._client.aclose()

    def _fail(
        self, tenant_id: str, limits: RateLimits, cost_tokens: int, request_id: str, reason: str
    ) -> Admission:
        if limits.tokens is not None and cost_tokens > limits.tokens:
            # Too large is knowable without Redis, and waiting would not help either way.
            verdict = Verdict(over_requests=False, over_tokens=False, too_large=True)
            usage = WindowUsage(requests=0, tokens=0)
            raise rejection(
                tenant_id, verdict, limits, usage, cost_tokens, 0.0, unknown_status(limits), self.window_s
            )
        if not self._fail_open:
            metrics.DECISIONS.labels("failed_closed", self.backend).inc()
            raise RateLimiterUnavailable(
                f"rate limiter backend ({self._where}) is unavailable: {reason}; "
                "requests are refused because the limiter is configured to fail closed"
            )
        metrics.DECISIONS.labels("failed_open", self.backend).inc()
        return Admission(
            tenant_id=tenant_id,
            request_id=request_id,
            entry_id="",
            cost_tokens=cost_tokens,
            charged_at=time.time(),
            status=unknown_status(limits),
            backend=self.backend,
            degraded=True,
        )

    def _record_failure(self, operation: str, exc: BaseException) -> None:
        metrics.BACKEND_ERRORS.labels(self.backend, operation).inc()
        self._down_until = time.monotonic() + self._backend_retry_s
        if not self._down:
            self._down = True
            mode = "open (admitting without limits)" if self._fail_open else "closed (refusing requests)"
            log.warning(
                "rate limiter: %s failed during %s: %s; failing %s, next try in %.1fs",
                self._where,
                operation,
                _describe(exc),
                mode,
                self._backend_retry_s,
            )

    def _record_success(self) -> None:
        if self._down:
            self._down = False
            log.warning("rate limiter: %s is reachable again; limits enforced", self._where)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
