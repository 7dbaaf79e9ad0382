"""Rate-limit decisions as HTTP headers (OpenAI's names and formats) or gRPC trailing metadata."""

from __future__ import annotations

import math

from qwenserve.ratelimit.admission import Admission, LimitStatus, RateLimitExceeded


def format_reset(seconds: float) -> str:
    """A duration the way OpenAI writes `x-ratelimit-reset-*`: "0s", "250ms", "1.5s", "6m0s", "1h2m3s".

    Rounded up to the millisecond, so a client that waits that long is never early.
    """
    ms = max(0, math.ceil(round(seconds * 1000, 6)))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    text = f"{secs}s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    if hours:
        text = f"{hours}h{text}"
    return text


def rate_limit_headers(decision: Admission | RateLimitExceeded | LimitStatus) -> dict[str, str]:
    """HTTP headers for an admitted request (on the response) or a rejection (on the 429).

    A rejection adds `Retry-After` (whole seconds, rounded up) and `retry-after-ms` (which the
    OpenAI clients prefer). Limits that are not configured, and values the limiter does not know
    (degraded mode), are left out rather than invented.
    """
    status = decision if isinstance(decision, LimitStatus) else decision.status
    headers: dict[str, str] = {}
    if isinstance(decision, RateLimitExceeded) and decision.retry_after_s is not None:
        retry = max(0.0, decision.retry_after_s)
        headers["Retry-After"] = str(math.ceil(round(retry, 6)))
        headers["retry-after-ms"] = str(math.ceil(round(retry * 1000, 6)))
    for name, limit, remaining, reset in (
        ("Requests", status.limit_requests, status.remaining_requests, status.reset_requests_s),
        ("Tokens", status.limit_tokens, status.remaining_tokens, status.reset_tokens_s),
    ):
        if limit is not None:
            headers[f"X-RateLimit-Limit-{name}"] = str(limit)
        if remaining is not None:
            headers[f"X-RateLimit-Remaining-{name}"] = str(remaining)
        if reset is not None:
            headers[f"X-RateLimit-Reset-{name}"] = format_reset(reset)
    return headers


def grpc_rate_limit_metadata(
    decision: Admission | RateLimitExceeded | LimitStatus,
) -> tuple[tuple[str, str], ...]:
    """The same values as gRPC metadata (keys must be lowercase there), e.g. for trailing metadata."""
    return tuple((name.lower(), value) for name, value in rate_limit_headers(decision).items())
