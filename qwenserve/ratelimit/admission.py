"""What a rate-limit decision returns: an Admission, or an error type the service edge maps once.

Mapping at the edge (the router): `RateLimitExceeded` (and its `RequestTooLarge`) -> HTTP 429 /
gRPC RESOURCE_EXHAUSTED; `RateLimiterUnavailable` -> HTTP 503 / gRPC UNAVAILABLE. Each carries a
`LimitStatus` for the headers (`qwenserve.ratelimit.headers`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LimitStatus:
    """The header values of one decision. `None`: not limited, or not known (limiter degraded)."""

    limit_requests: int | None
    remaining_requests: int | None
    reset_requests_s: float | None  # until the requests window is back to its initial state
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_tokens_s: float | None  # until the tokens window is back to its initial state


@dataclass(frozen=True, slots=True)
class Admission:
    """An admitted request. Pass it to `settle()` when the request ends to refund unused tokens."""

    tenant_id: str
    request_id: str
    entry_id: str  # the log entry charged; unique even when request ids repeat
    cost_tokens: int
    charged_at: float  # limiter clock, seconds (Redis: server epoch time; in-process: monotonic)
    status: LimitStatus
    backend: str
    degraded: bool = False  # admitted without a decision because the backend failed open


class RateLimitError(Exception):
    """Base class of the limiter's errors."""


class RateLimitExceeded(RateLimitError):
    """The request does not fit the tenant's window now; retry after `retry_after_s` seconds."""

    def __init__(
        self,
        message: str,
        *,
        tenant_id: str,
        status: LimitStatus,
        retry_after_s: float | None,
        limited_by: tuple[str, ...],
    ) -> None:
        super().__init__(message)
        self.tenant_id = tenant_id
        self.status = status
        self.retry_after_s = retry_after_s
        self.limited_by = limited_by  # ("requests",), ("tokens",), both, or ("request_size",)


class RequestTooLarge(RateLimitExceeded):
    """The request's cost alone exceeds the tenant's tokens limit: waiting will not help,
    only a smaller prompt or output budget will. `retry_after_s` is None."""


class RateLimiterUnavailable(RateLimitError):
    """The backend (Redis) failed and the limiter is configured to fail closed."""
