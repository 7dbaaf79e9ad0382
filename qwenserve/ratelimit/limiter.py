"""The limiter interface both backends implement, and the pure pieces they share."""

from __future__ import annotations

import itertools
import secrets
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from qwenserve.ratelimit.admission import (
    Admission,
    LimitStatus,
    RateLimitExceeded,
    RequestTooLarge,
)
from qwenserve.ratelimit.window import RateLimits, Verdict, WindowUsage

if TYPE_CHECKING:
    from qwenserve.tenancy.tenants import Tenant


class RateLimiter(ABC):
    """Per-tenant requests-per-window and tokens-per-window limits over exact sliding windows.

    The router calls `admit()` before any prefill work with the request's cost (exact prompt
    tokens + output budget) and `settle()` once when the request ends, with what it really used.
    """

    backend: str = "abstract"

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        # Entry ids must be unique across router processes even if request ids repeat (retries).
        self._id_prefix = secrets.token_hex(4)
        self._id_counter = itertools.count()

    @abstractmethod
    async def admit(self, tenant: Tenant, cost_tokens: int, request_id: str) -> Admission:
        """Charge `cost_tokens` and one request to the tenant's window, all or nothing.

        Raises `RateLimitExceeded` (with `retry_after_s` and header values) when either limit
        would be exceeded, `RequestTooLarge` when the cost alone exceeds the tokens limit, and
        `RateLimiterUnavailable` when the backend is down and the limiter fails closed.
        """

    @abstractmethod
    async def settle(self, admission: Admission, actual_tokens: int) -> int:
        """Lower the request's charge to `actual_tokens`, in the window slot it was charged to.

        `actual_tokens` is what the request really consumed: prompt tokens plus generated tokens.
        The charge never grows, settling twice is harmless, and once the entry left the window
        there is nothing to refund. Never raises for backend failures (a lost refund
        only over-charges the tenant until the window passes). Returns the tokens refunded.
        """

    async def close(self) -> None:
        """Release connections. The in-process limiter holds none."""
        return None

    def _new_entry_id(self, request_id: str) -> str:
        return f"{request_id}#{self._id_prefix}{next(self._id_counter):x}"


def limits_of(tenant: Tenant) -> RateLimits:
    """The per-window limits configured for a tenant."""
    return RateLimits(requests=tenant.limits.requests_per_minute, tokens=tenant.limits.tokens_per_minute)


def validate_cost(cost_tokens: int) -> None:
    """A request costs at least one token (its prompt is never empty)."""
    if isinstance(cost_tokens, bool) or not isinstance(cost_tokens, int) or cost_tokens < 1:
        raise ValueError(f"cost_tokens must be a positive int, got {cost_tokens!r}")


def limit_status(limits: RateLimits, usage: WindowUsage, reset_s: float) -> LimitStatus:
    """Header values for a window holding `usage`, fully reset `reset_s` seconds from now."""
    return LimitStatus(
        limit_requests=limits.requests,
        remaining_requests=None if limits.requests is None else max(0, limits.requests - usage.requests),
        reset_requests_s=None if limits.requests is None else reset_s,
        limit_tokens=limits.tokens,
        remaining_tokens=None if limits.tokens is None else max(0, limits.tokens - usage.tokens),
        reset_tokens_s=None if limits.tokens is None else reset_s,
    )


def unknown_status(limits: RateLimits) -> LimitStatus:
    """Header values when the backend could not be asked: the limits, nothing else."""
    return LimitStatus(limits.requests, None, None, limits.tokens, None, None)


def rejection(
    tenant_id: str,
    verdict: Verdict,
    limits: RateLimits,
    usage: WindowUsage,
    cost_tokens: int,
    retry_after_s: float,
    status: LimitStatus,
    window_s: float,
) -> RateLimitExceeded:
    """The error for a rejected request, with a message that says which limit and by how much."""
    window = f"{window_s:g}s"
    if verdict.too_large:
        return RequestTooLarge(
            f"tenant {tenant_id!r}: this request needs {cost_tokens} tokens (prompt + output budget) "
            f"but the tenant may use at most {limits.tokens} tokens per {window}; "
            "lower max_tokens or shorten the prompt",
            tenant_id=tenant_id,
            status=status,
            retry_after_s=None,
            limited_by=("request_size",),
        )
    reasons = []
    limited_by: list[str] = []
    if verdict.over_requests:
        reasons.append(f"{usage.requests} of {limits.requests} requests used in the last {window}")
        limited_by.append("requests")
    if verdict.over_tokens:
        reasons.append(
            f"{usage.tokens} of {limits.tokens} tokens used in the last {window} "
            f"and this request needs {cost_tokens}"
        )
        limited_by.append("tokens")
    return RateLimitExceeded(
        f"tenant {tenant_id!r} is rate limited: {'; '.join(reasons)}; retry in {retry_after_s:.3f}s",
        tenant_id=tenant_id,
        status=status,
        retry_after_s=retry_after_s,
        limited_by=tuple(limited_by),
    )
