"""Redis killed or hung mid-test: the failure mode decides, nothing hangs, and limits come back."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import REGISTRY

from qwenserve.ratelimit import (
    RateLimiterConfig,
    RateLimiterUnavailable,
    RateLimitExceeded,
    make_rate_limiter,
    rate_limit_headers,
)
from qwenserve.ratelimit.redis_client import connect
from qwenserve.tenancy import RedisUsageMeter, UsageMeterUnavailable, UsageRecord
from tests.support.ratelimit_checks import tenant

TIMEOUT_S = 0.2
RETRY_S = 0.3


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def config(url: str, mode: str) -> RateLimiterConfig:
    return RateLimiterConfig(
        redis_url=url, window_s=30.0, failure_mode=mode, redis_timeout_s=TIMEOUT_S, backend_retry_s=RETRY_S
    )


async def admit_after_recovery(limiter, acme, request_id: str):
    """Redis is back: within the back-off period plus a little, decisions come from Redis again."""
    deadline = time.monotonic() + RETRY_S + 2.0
    while True:
        admission = await limiter.admit(acme, 10, request_id)
        if not admission.degraded or time.monotonic() > deadline:
            return admission
        await asyncio.sleep(0.05)


async def test_killed_redis_fails_open_quickly_and_limits_return_after_restart(
    redis_server, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    limiter = make_rate_limiter(config(redis_url, "open"))
    acme = tenant(rpm=1, tpm=1000)
    await limiter.admit(acme, 10, "before")
    opened = counter("qwenserve_ratelimit_decisions_total", decision="failed_open", backend="redis")
    errors = counter("qwenserve_ratelimit_backend_errors_total", backend="redis", operation="admit")

    redis_server.kill()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="qwenserve.ratelimit.redis_backend"):
        outage = [await limiter.admit(acme, 10, f"during-{i}") for i in range(20)]
    assert time.monotonic() - started < 1.0
    assert all(a.degraded for a in outage)  # rpm=1 would have refused these: no limits while down
    assert await limiter.settle(outage[0], 1) == 0
    assert "failing open" in caplog.text and caplog.text.count("failed during admit") == 1
    assert (
        counter("qwenserve_ratelimit_decisions_total", decision="failed_open", backend="redis") == opened + 20
    )
    assert counter("qwenserve_ratelimit_backend_errors_total", backend="redis", operation="admit") > errors
    assert rate_limit_headers(outage[0]) == {
        "X-RateLimit-Limit-Requests": "1",
        "X-RateLimit-Limit-Tokens": "1000",
    }

    redis_server.start()  # empty: the old window is gone with the process
    recovered = await admit_after_recovery(limiter, acme, "after")
    assert not recovered.degraded
    with pytest.raises(RateLimitExceeded):
        await limiter.admit(acme, 10, "over-rpm-again")
    await limiter.close()


async def test_killed_redis_fails_closed_with_a_clear_error_and_recovers(
    redis_server, redis_url: str
) -> None:
    limiter = make_rate_limiter(config(redis_url, "closed"))
    acme = tenant(rpm=100, tpm=1000)
    admission = await limiter.admit(acme, 500, "before")
    closed = counter("qwenserve_ratelimit_decisions_total", decision="failed_closed", backend="redis")

    redis_server.kill()
    started = time.monotonic()
    for i in range(10):
        with pytest.raises(RateLimiterUnavailable) as unavailable:
            await limiter.admit(acme, 10, f"during-{i}")
    assert time.monotonic() - started < 1.0
    assert "unavailable" in str(unavailable.value) and "fail closed" in str(unavailable.value)
    assert await limiter.settle(admission, 100) == 0  # a refund lost to the outage never raises
    assert (
        counter("qwenserve_ratelimit_decisions_total", decision="failed_closed", backend="redis")
        == closed + 10
    )

    redis_server.start()
    deadline = time.monotonic() + RETRY_S + 2.0
    while True:
        try:
            recovered = await limiter.admit(acme, 10, "after")
            break
        except RateLimiterUnavailable:
            assert time.monotonic() < deadline, "the limiter did not recover after Redis restarted"
            await asyncio.sleep(0.05)
    assert not recovered.degraded and recovered.status.remaining_tokens == 990
    await limiter.close()


async def test_hung_redis_costs_at_most_the_timeout_then_nothing(redis_server, redis_url: str) -> None:
    limiter = make_rate_limiter(config(redis_url, "closed"))
    acme = tenant(tpm=1000)
    await limiter.admit(acme, 10, "before")
    redis_server.pause()  # accepts connections, never answers
    try:
        started = time.monotonic()
        with pytest.raises(RateLimiterUnavailable):
            await limiter.admit(acme, 10, "hung")
        first = time.monotonic() - started
        started = time.monotonic()
        with pytest.raises(RateLimiterUnavailable):
            await limiter.admit(acme, 10, "in-back-off")
        second = time.monotonic() - started
    finally:
        redis_server.resume()
    assert first < 2 * TIMEOUT_S + 0.2
    assert second < 0.05  # the back-off answers without waiting on Redis again
    await limiter.close()


async def test_request_too_large_is_still_refused_while_failing_open(redis_server, redis_url: str) -> None:
    limiter = make_rate_limiter(config(redis_url, "open"))
    redis_server.kill()
    with pytest.raises(RateLimitExceeded):
        await limiter.admit(tenant(tpm=100), 101, "huge")
    await limiter.close()


async def test_usage_metering_reports_an_outage_instead_of_hanging(redis_server, redis_url: str) -> None:
    meter = RedisUsageMeter(connect(redis_url, timeout_s=TIMEOUT_S))
    await meter.record("acme", UsageRecord(prompt_tokens=5, completion_tokens=7))
    redis_server.kill()
    started = time.monotonic()
    with pytest.raises(UsageMeterUnavailable):
        await meter.record("acme", UsageRecord(prompt_tokens=5, completion_tokens=7))
    assert time.monotonic() - started < 1.0
    await meter.close()
