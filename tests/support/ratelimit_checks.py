"""Independent checks on what a limiter admitted (helpers for the tests, not tests)."""

from __future__ import annotations

from collections.abc import Sequence

from qwenserve.tenancy import Tenant, TenantLimits


def tenant(name: str = "acme", *, rpm: int | None = None, tpm: int | None = None) -> Tenant:
    return Tenant(name, TenantLimits(requests_per_minute=rpm, tokens_per_minute=tpm))


def max_window_sum(admissions: Sequence[tuple[float, int]], window_s: float) -> tuple[int, float]:
    """The largest total cost of admissions inside any half-open interval (t - window_s, t].

    It suffices to look at intervals ending at an admission: moving an interval's end forward to
    its last admission keeps every admission it held. Returns (sum, end timestamp).
    """
    events = sorted(admissions)
    best, best_end = 0, 0.0
    start = 0
    running = 0
    for ts, cost in events:
        running += cost
        while events[start][0] <= ts - window_s:
            running -= events[start][1]
            start += 1
        if running > best:
            best, best_end = running, ts
    return best, best_end
