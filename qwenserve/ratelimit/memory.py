"""The in-process backend: exact sliding logs in a dict, for a single router process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from qwenserve.ratelimit import metrics
from qwenserve.ratelimit.admission import Admission
from qwenserve.ratelimit.limiter import (
    RateLimiter,
    limit_status,
    limits_of,
    rejection,
    validate_cost,
)
from qwenserve.ratelimit.window import SlidingLog, decide, seconds_until_fits

if TYPE_CHECKING:
    from qwenserve.tenancy.tenants import Tenant


class InProcessRateLimiter(RateLimiter):
    """Exact and asyncio-safe: a decision never awaits, so it cannot interleave with another.

    A lock also makes it safe to call from several threads. Windows are per process: several
    router replicas need the Redis backend to share one budget.
    """

    backend = "memory"

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(window_s)
        self._clock = clock
        self._logs: dict[str, SlidingLog] = {}
        self._lock = threading.Lock()
        self._admits = 0

    def _sweep(self, now: float) -> None:
        # Tenants that went quiet keep stale entries until touched; sweeping every few thousand
        # decisions keeps memory proportional to the tenants active within one window.
        for tenant_id in list(self._logs):
            log = self._logs[tenant_id]
            log.prune(now, self.window_s)
            if not log:
                del self._logs[tenant_id]

    async def admit(self, tenant: Tenant, cost_tokens: int, request_id: str) -> Admission:
        """See `RateLimiter.admit`."""
        validate_cost(cost_tokens)
        started = time.perf_counter()
        limits = limits_of(tenant)
        window = self.window_s
        with self._lock:
            now = self._clock()
            self._admits += 1
            if self._admits % 4096 == 0:
                self._sweep(now)
            log = self._logs.get(tenant.id)
            if log is None:
                log = self._logs[tenant.id] = SlidingLog()
            log.prune(now, window)
            usage = log.usage()
            verdict = decide(usage, cost_tokens, limits)
            if verdict.admitted:
                entry_id = self._new_entry_id(request_id)
                log.append(now, entry_id, cost_tokens)
                status = limit_status(limits, log.usage(), window)
            else:
                newest = log.newest_ts()
                reset = 0.0 if newest is None else max(0.0, newest + window - now)
                retry = seconds_until_fits(log.oldest_first(), usage, cost_tokens, limits, now, window)
                status = limit_status(limits, usage, reset)
        metrics.DECISION_SECONDS.labels(self.backend).observe(time.perf_counter() - started)
        if not verdict.admitted:
            error = rejection(tenant.id, verdict, limits, usage, cost_tokens, retry, status, window)
            metrics.DECISIONS.labels("too_large" if verdict.too_large else "rejected", self.backend).inc()
            for limit in error.limited_by:
                metrics.REJECTIONS.labels(tenant.id, limit).inc()
            raise error
        metrics.DECISIONS.labels("admitted", self.backend).inc()
        return Admission(
            tenant_id=tenant.id,
            request_id=request_id,
            entry_id=entry_id,
            cost_tokens=cost_tokens,
            charged_at=now,
            status=status,
            backend=self.backend,
        )

    async def settle(self, admission: Admission, actual_tokens: int) -> int:
        """See `RateLimiter.settle`."""
        if admission.degraded or actual_tokens >= admission.cost_tokens:
            return 0
        with self._lock:
            log = self._logs.get(admission.tenant_id)
            if log is None:
                return 0
            log.prune(self._clock(), self.window_s)
            refunded = log.settle(admission.entry_id, actual_tokens)
            if not log:
                # An idle tenant's empty log is dropped so the dict holds only active tenants.
                del self._logs[admission.tenant_id]
        if refunded:
            metrics.REFUNDED_TOKENS.labels(self.backend).inc(refunded)
        return refunded
