"""The sliding window: pure decisions over a log of admissions, and the in-process log itself.

Why a log and not sub-window buckets: a bucketed window (e.g. 60 one-second slots) either
over-admits at slot edges or must be pessimistic there; a log of (timestamp, cost) entries is
exact. The rule "admit only if the entries in (now - W, now] plus this request fit" guarantees
that *every* interval of length W holds at most the limit: take any interval and its last
admission at time t; every other entry of that interval lies in (t - W, t], which was checked
when t was admitted. Refunds only lower costs, so they keep the guarantee.

The log's size is bounded by the requests admitted in one window (at most requests-per-minute,
or tokens-per-minute when only tokens are limited, as every cost is at least one token); a
running token total makes each decision O(expired entries), amortised O(1).

Redis runs the same rules in Lua (`redis_scripts.py`); keep the two in step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RateLimits:
    """Per-window limits of one tenant; `None` means that dimension is not limited."""

    requests: int | None
    tokens: int | None


@dataclass(frozen=True, slots=True)
class WindowUsage:
    """What the live part of a tenant's window holds right now."""

    requests: int
    tokens: int


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of one decision: which limits (if any) the request would break."""

    over_requests: bool
    over_tokens: bool
    too_large: bool  # the cost alone exceeds the tokens limit: waiting never helps

    @property
    def admitted(self) -> bool:
        """True when the request fits both limits."""
        return not (self.over_requests or self.over_tokens or self.too_large)


def decide(usage: WindowUsage, cost_tokens: int, limits: RateLimits) -> Verdict:
    """Decide, all or nothing, whether a request of `cost_tokens` fits both limits."""
    too_large = limits.tokens is not None and cost_tokens > limits.tokens
    over_requests = limits.requests is not None and usage.requests + 1 > limits.requests
    over_tokens = limits.tokens is not None and usage.tokens + cost_tokens > limits.tokens
    return Verdict(over_requests=over_requests, over_tokens=over_tokens, too_large=too_large)


def seconds_until_fits(
    entries_oldest_first: Iterable[tuple[float, int]],
    usage: WindowUsage,
    cost_tokens: int,
    limits: RateLimits,
    now: float,
    window_s: float,
) -> float:
    """How long until enough of the oldest entries leave the window for this request to fit.

    An entry stamped `ts` stops counting at `ts + window_s`. This is the earliest moment the
    request could be admitted if nothing else is admitted meanwhile (a refund may make it earlier).
    """
    need_requests = 0 if limits.requests is None else usage.requests + 1 - limits.requests
    need_tokens = 0 if limits.tokens is None else usage.tokens + cost_tokens - limits.tokens
    freed_requests = 0
    freed_tokens = 0
    for ts, cost in entries_oldest_first:
        if freed_requests >= need_requests and freed_tokens >= need_tokens:
            break
        freed_requests += 1
        freed_tokens += cost
        if freed_requests >= need_requests and freed_tokens >= need_tokens:
            return max(0.0, ts + window_s - now)
    if freed_requests >= need_requests and freed_tokens >= need_tokens:
        return 0.0
    # Only reachable when the cost alone exceeds the limit; the caller reports that separately.
    return window_s


@dataclass(slots=True)
class LogEntry:
    """One admitted request: when it was charged, and what it still costs after refunds."""

    ts: float
    entry_id: str
    cost: int


class SlidingLog:
    """The in-process log of one tenant's admissions inside the window, with running totals."""

    def __init__(self) -> None:
        self._entries: deque[LogEntry] = deque()
        self._by_id: dict[str, LogEntry] = {}
        self._tokens = 0

    def prune(self, now: float, window_s: float) -> None:
        """Forget entries that left the window (ts <= now - window_s)."""
        cutoff = now - window_s
        entries = self._entries
        while entries and entries[0].ts <= cutoff:
            entry = entries.popleft()
            del self._by_id[entry.entry_id]
            self._tokens -= entry.cost

    def usage(self) -> WindowUsage:
        """Requests and tokens currently in the window (call `prune` first)."""
        return WindowUsage(requests=len(self._entries), tokens=self._tokens)

    def oldest_first(self) -> Iterable[tuple[float, int]]:
        """(timestamp, cost) of each live entry, oldest first."""
        return ((e.ts, e.cost) for e in self._entries)

    def newest_ts(self) -> float | None:
        """Timestamp of the most recent entry, or None when the log is empty."""
        return self._entries[-1].ts if self._entries else None

    def append(self, ts: float, entry_id: str, cost: int) -> None:
        """Charge an admitted request. Timestamps must not decrease (a monotonic clock)."""
        entry = LogEntry(ts=ts, entry_id=entry_id, cost=cost)
        self._entries.append(entry)
        self._by_id[entry_id] = entry
        self._tokens += cost

    def settle(self, entry_id: str, actual_tokens: int) -> int:
        """Lower the entry's charge to `actual_tokens` if it is still in the log; returns the refund.

        Setting (not subtracting) makes a repeated settle harmless, and a charge never grows.
        """
        entry = self._by_id.get(entry_id)
        if entry is None:
            return 0
        refund = max(0, entry.cost - max(0, actual_tokens))
        entry.cost -= refund
        self._tokens -= refund
        return refund

    def __len__(self) -> int:
        return len(self._entries)
