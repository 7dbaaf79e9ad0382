"""The pure sliding-window rules, the in-process log, and the checker the concurrency tests rely on."""

from __future__ import annotations

import pytest

from qwenserve.ratelimit import InProcessRateLimiter, RateLimitExceeded
from qwenserve.ratelimit.window import RateLimits, SlidingLog, WindowUsage, decide, seconds_until_fits
from tests.support.ratelimit_checks import max_window_sum, tenant


def test_decision_is_all_or_nothing_over_both_limits() -> None:
    limits = RateLimits(requests=3, tokens=100)
    assert decide(WindowUsage(2, 60), 40, limits).admitted
    over_tokens = decide(WindowUsage(2, 61), 40, limits)
    assert (over_tokens.admitted, over_tokens.over_tokens, over_tokens.over_requests) == (False, True, False)
    over_requests = decide(WindowUsage(3, 0), 1, limits)
    assert (over_requests.admitted, over_requests.over_requests, over_requests.over_tokens) == (
        False,
        True,
        False,
    )
    too_large = decide(WindowUsage(0, 0), 101, limits)
    assert too_large.too_large and not too_large.admitted


def test_unlimited_dimensions_never_reject() -> None:
    assert decide(WindowUsage(10**9, 10**12), 10**6, RateLimits(requests=None, tokens=None)).admitted


def test_retry_after_waits_for_just_enough_of_the_oldest_entries_to_expire() -> None:
    entries = [(10.0, 30), (11.0, 30), (12.0, 30)]  # window 5 s, tokens 100, now = 13
    usage = WindowUsage(3, 90)
    # Needs 20 tokens freed: the first entry (30) expires at 15.0.
    assert seconds_until_fits(entries, usage, 30, RateLimits(None, 100), now=13.0, window_s=5.0) == 2.0
    # Needs 50 freed: the first two, the second expires at 16.0.
    assert seconds_until_fits(entries, usage, 60, RateLimits(None, 100), now=13.0, window_s=5.0) == 3.0
    # Requests: 3 of 2 allowed + this one -> two must expire.
    assert seconds_until_fits(entries, usage, 1, RateLimits(2, None), now=13.0, window_s=5.0) == 3.0


def test_log_expires_entries_at_exactly_one_window_and_settles_in_place() -> None:
    log = SlidingLog()
    log.append(1.0, "a", 50)
    log.append(2.0, "b", 70)
    log.prune(now=5.9, window_s=5.0)
    assert log.usage() == WindowUsage(2, 120)
    assert log.settle("b", 20) == 50
    assert log.settle("b", 60) == 0  # a charge never grows again
    assert log.settle("b", 0) == 20  # and never refunds more than is still charged
    assert log.usage() == WindowUsage(2, 50)
    log.prune(now=6.0, window_s=5.0)  # "a" stamped 1.0 stops counting at 6.0
    assert log.usage() == WindowUsage(1, 0)
    assert log.settle("a", 10) == 0


async def test_in_process_limiter_is_exact_on_a_controlled_clock() -> None:
    now = [100.0]
    limiter = InProcessRateLimiter(window_s=10.0, clock=lambda: now[0])
    acme = tenant(tpm=100)
    await limiter.admit(acme, 60, "r1")
    now[0] = 105.0
    await limiter.admit(acme, 40, "r2")
    now[0] = 109.999
    with pytest.raises(RateLimitExceeded) as rejected:
        await limiter.admit(acme, 1, "r3")
    assert rejected.value.retry_after_s == pytest.approx(0.001)
    now[0] = 110.0  # r1 leaves the window
    await limiter.admit(acme, 60, "r4")
    with pytest.raises(RateLimitExceeded):
        await limiter.admit(acme, 1, "r5")


def test_window_checker_detects_an_over_admission() -> None:
    admitted = [(0.0, 60), (0.5, 40), (1.2, 60)]
    assert max_window_sum(admitted, window_s=1.0)[0] == 100
    # The same admissions with 1.2 moved to 0.9 put 160 tokens into one 1-second window.
    assert max_window_sum([(0.0, 60), (0.5, 40), (0.9, 60)], window_s=1.0)[0] == 160
    # The interval is half-open: an entry exactly one window old no longer counts.
    assert max_window_sum([(0.0, 60), (1.0, 60)], window_s=1.0)[0] == 60
