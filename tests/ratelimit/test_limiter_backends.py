"""Behaviour both backends must share: exactness under concurrency, refunds, sliding, rejections."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable

import pytest

from qwenserve.ratelimit import (
    RateLimiter,
    RateLimiterConfig,
    RateLimitExceeded,
    RequestTooLarge,
    make_rate_limiter,
    rate_limit_headers,
)
from tests.support.ratelimit_checks import max_window_sum, tenant

MakeLimiter = Callable[..., RateLimiter]


@pytest.fixture(params=["memory", "redis"])
async def make_limiter(request: pytest.FixtureRequest) -> AsyncIterator[MakeLimiter]:
    """Builds limiters of the parametrised backend; closes them after the test."""
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    made: list[RateLimiter] = []

    def make(window_s: float) -> RateLimiter:
        limiter = make_rate_limiter(RateLimiterConfig(redis_url=url, window_s=window_s, redis_timeout_s=1.0))
        assert limiter.backend == request.param
        made.append(limiter)
        return limiter

    yield make
    for limiter in made:
        await limiter.close()


async def _hammer(
    limiter: RateLimiter, acme, clients: int, duration_s: float, refund_share: float
) -> tuple[list[tuple[float, int]], int]:
    """`clients` coroutines admit random costs until the deadline; some settle below their cost.

    Returns (charged_at, tokens finally charged) per admission and the number of rejections.
    """
    admitted: list[tuple[float, int]] = []
    rejections = 0
    deadline = time.monotonic() + duration_s

    async def client(i: int) -> None:
        nonlocal rejections
        rng = random.Random(i)
        n = 0
        while time.monotonic() < deadline:
            cost = rng.randint(20, 120)
            n += 1
            try:
                admission = await limiter.admit(acme, cost, f"c{i}-{n}")
            except RateLimitExceeded:
                rejections += 1
                await asyncio.sleep(rng.uniform(0.002, 0.01))
                continue
            net = cost
            if rng.random() < refund_share:
                actual = rng.randint(cost // 2, cost)
                net -= await limiter.settle(admission, actual)
                assert net == actual
            admitted.append((admission.charged_at, net))
            await asyncio.sleep(0)

    await asyncio.gather(*(client(i) for i in range(clients)))
    return admitted, rejections


async def test_32_concurrent_clients_never_exceed_tokens_per_window(make_limiter: MakeLimiter) -> None:
    window_s, limit = 0.5, 1000
    limiter = make_limiter(window_s)
    admitted, rejections = await _hammer(
        limiter, tenant(tpm=limit), clients=32, duration_s=1.6, refund_share=0.3
    )
    worst, at = max_window_sum(admitted, window_s)
    assert worst <= limit, f"{worst} tokens admitted in the {window_s}s window ending at {at}"
    # Hammered from 32 clients, the window must also fill up: the limiter is not over-strict.
    assert worst >= 0.6 * limit
    assert rejections > 0
    assert sum(cost for _, cost in admitted) > 2 * limit  # several windows' worth went through


async def test_burst_inside_one_window_admits_at_most_the_limit(make_limiter: MakeLimiter) -> None:
    # No timestamps needed: the whole burst lies inside one 30-second window.
    limiter = make_limiter(30.0)
    acme = tenant(tpm=5000)
    admitted: list[int] = []

    async def client(i: int) -> None:
        rng = random.Random(100 + i)
        misses = 0
        while misses < 3:
            cost = rng.randint(20, 120)
            try:
                await limiter.admit(acme, cost, f"b{i}")
                admitted.append(cost)
            except RateLimitExceeded:
                misses += 1

    await asyncio.gather(*(client(i) for i in range(32)))
    assert 5000 - 120 < sum(admitted) <= 5000


async def test_requests_per_window_counts_requests_not_tokens(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter(30.0)
    acme = tenant(rpm=3, tpm=10_000)
    for i in range(3):
        await limiter.admit(acme, 1, f"r{i}")
    with pytest.raises(RateLimitExceeded) as rejected:
        await limiter.admit(acme, 1, "r3")
    assert rejected.value.limited_by == ("requests",)
    assert rejected.value.status.remaining_requests == 0
    assert rejected.value.status.remaining_tokens == 10_000 - 3
    assert "3 of 3 requests" in str(rejected.value)


async def test_early_stop_refunds_unused_output_budget(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter(30.0)
    acme = tenant(tpm=1000)
    # 100 prompt tokens + 700 output budget; the model stops after 50 tokens.
    admission = await limiter.admit(acme, 800, "long")
    assert admission.status.remaining_tokens == 200
    with pytest.raises(RateLimitExceeded):
        await limiter.admit(acme, 500, "blocked")
    assert await limiter.settle(admission, 100 + 50) == 650
    second = await limiter.admit(acme, 500, "now-fits")
    assert second.status.remaining_tokens == 1000 - 150 - 500
    # Settling twice, or above what is charged, refunds nothing more and never charges more.
    assert await limiter.settle(admission, 150) == 0
    assert await limiter.settle(admission, 900) == 0
    assert await limiter.settle(second, 500) == 0
    third = await limiter.admit(acme, 350, "exactly-fills")
    assert third.status.remaining_tokens == 0


async def test_refund_stays_in_the_slot_it_was_charged_to(make_limiter: MakeLimiter) -> None:
    window_s = 1.0
    limiter = make_limiter(window_s)
    acme = tenant(tpm=1000)
    first = await limiter.admit(acme, 800, "first")
    await limiter.settle(first, 150)
    await asyncio.sleep(0.2)
    await limiter.admit(acme, 850, "second")  # 150 + 850 = the limit
    with pytest.raises(RateLimitExceeded) as rejected:
        await limiter.admit(acme, 100, "third")
    # The 150 tokens still charged to "first" free up when "first" leaves the window, not later.
    retry = rejected.value.retry_after_s
    assert retry is not None and 0.5 < retry <= 0.8 + 0.05
    await asyncio.sleep(retry + 0.02)
    third = await limiter.admit(acme, 100, "third-again")
    assert third.charged_at >= first.charged_at + window_s


async def test_refund_after_the_window_moved_on_is_a_no_op(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter(0.3)
    acme = tenant(tpm=1000)
    admission = await limiter.admit(acme, 900, "old")
    await asyncio.sleep(0.35)
    fresh = await limiter.admit(acme, 1000, "fresh")
    assert await limiter.settle(admission, 0) == 0
    assert fresh.status.remaining_tokens == 0
    with pytest.raises(RateLimitExceeded):
        await limiter.admit(acme, 1, "still-full")


async def test_blocked_tenant_is_admitted_once_the_window_slides(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter(0.6)
    acme = tenant(rpm=100, tpm=300)
    await limiter.admit(acme, 200, "a")
    await asyncio.sleep(0.2)
    await limiter.admit(acme, 100, "b")
    with pytest.raises(RateLimitExceeded) as rejected:
        await limiter.admit(acme, 150, "c")
    retry = rejected.value.retry_after_s
    assert retry is not None and 0.25 < retry <= 0.4  # "a" (200 tokens) leaves at +0.6 s
    await asyncio.sleep(max(0.0, retry - 0.1))
    with pytest.raises(RateLimitExceeded):
        await limiter.admit(acme, 150, "c-too-early")
    await asyncio.sleep(0.15)
    admission = await limiter.admit(acme, 150, "c-after-slide")
    assert admission.status.remaining_tokens == 300 - 100 - 150


async def test_request_larger_than_the_whole_budget_is_too_large(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter(30.0)
    with pytest.raises(RequestTooLarge) as rejected:
        await limiter.admit(tenant(tpm=1000), 1001, "huge")
    assert rejected.value.retry_after_s is None
    assert "lower max_tokens" in str(rejected.value)
    assert "Retry-After" not in rate_limit_headers(rejected.value)


async def test_tenants_have_separate_windows(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter(30.0)
    await limiter.admit(tenant("acme", tpm=100), 100, "a")
    with pytest.raises(RateLimitExceeded):
        await limiter.admit(tenant("acme", tpm=100), 1, "a2")
    await limiter.admit(tenant("globex", tpm=100), 100, "g")


async def test_unlimited_tenant_is_always_admitted_with_no_limit_headers(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter(30.0)
    for i in range(50):
        admission = await limiter.admit(tenant("free"), 10_000, f"u{i}")
    assert rate_limit_headers(admission) == {}


async def test_cost_must_be_a_positive_token_count(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter(30.0)
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError):
            await limiter.admit(tenant(tpm=100), bad, "bad")  # type: ignore[arg-type]
