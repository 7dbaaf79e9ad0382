"""Decisions as OpenAI-style HTTP headers and lowercase gRPC metadata."""

from __future__ import annotations

import pytest

from qwenserve.ratelimit import (
    InProcessRateLimiter,
    LimitStatus,
    RateLimitExceeded,
    format_reset,
    grpc_rate_limit_metadata,
    rate_limit_headers,
)
from tests.support.ratelimit_checks import tenant


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.0004, "1ms"),
        (0.02, "20ms"),
        (0.999, "999ms"),
        (1, "1s"),
        (8.64, "8.64s"),
        (60, "1m0s"),
        (360, "6m0s"),
        (3723.5, "1h2m3.5s"),
        (-1, "0s"),
    ],
)
def test_reset_durations_are_written_like_openai(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


def test_admitted_request_headers() -> None:
    status = LimitStatus(60, 59, 60.0, 150000, 149000, 60.0)
    assert rate_limit_headers(status) == {
        "X-RateLimit-Limit-Requests": "60",
        "X-RateLimit-Remaining-Requests": "59",
        "X-RateLimit-Reset-Requests": "1m0s",
        "X-RateLimit-Limit-Tokens": "150000",
        "X-RateLimit-Remaining-Tokens": "149000",
        "X-RateLimit-Reset-Tokens": "1m0s",
    }


async def test_rejection_headers_carry_retry_after_rounded_up() -> None:
    now = [0.0]
    limiter = InProcessRateLimiter(window_s=10.0, clock=lambda: now[0])
    acme = tenant(rpm=5, tpm=1000)
    first = await limiter.admit(acme, 700, "a")
    assert rate_limit_headers(first)["X-RateLimit-Remaining-Tokens"] == "300"
    now[0] = 1.3
    await limiter.admit(acme, 200, "b")
    now[0] = 2.0
    with pytest.raises(RateLimitExceeded) as rejected:
        await limiter.admit(acme, 400, "c")
    headers = rate_limit_headers(rejected.value)
    # "a" leaves at 10.0: 8 s from now; the window is empty again when "b" leaves at 11.3.
    assert headers == {
        "Retry-After": "8",
        "retry-after-ms": "8000",
        "X-RateLimit-Limit-Requests": "5",
        "X-RateLimit-Remaining-Requests": "3",
        "X-RateLimit-Reset-Requests": "9.3s",
        "X-RateLimit-Limit-Tokens": "1000",
        "X-RateLimit-Remaining-Tokens": "100",
        "X-RateLimit-Reset-Tokens": "9.3s",
    }
    now[0] = 2.25
    with pytest.raises(RateLimitExceeded) as again:
        await limiter.admit(acme, 400, "c")
    assert rate_limit_headers(again.value)["Retry-After"] == "8"  # 7.75 s, rounded up
    assert rate_limit_headers(again.value)["retry-after-ms"] == "7750"


def test_grpc_metadata_is_the_same_values_with_lowercase_keys() -> None:
    status = LimitStatus(None, None, None, 1000, 0, 0.25)
    assert grpc_rate_limit_metadata(status) == (
        ("x-ratelimit-limit-tokens", "1000"),
        ("x-ratelimit-remaining-tokens", "0"),
        ("x-ratelimit-reset-tokens", "250ms"),
    )
