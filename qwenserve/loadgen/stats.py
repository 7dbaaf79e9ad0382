"""The arithmetic of a load report: percentiles, throughput, goodput under an SLO. Pure functions only.

Definitions (the ones vLLM's benchmark_serving and genai-perf use, so numbers compare):
- TTFT: from sending the request to receiving the first generated token.
- Inter-token latency (ITL): the gap between two consecutive streamed chunks that carry tokens, divided
  evenly among the tokens of the later chunk (a chunk of k tokens after a gap g counts k gaps of g/k).
- TPOT: a request's mean ITL, (e2e - ttft) / (output_tokens - 1).
- Goodput: requests per second that succeeded AND met the SLO: TTFT <= ttft_ms and TPOT <= itl_ms
  (the per-request mean, as DistServe defines it; a single slow step does not fail a request).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(slots=True)
class RequestRecord:
    """What one request did, as the client saw it. Times in seconds; `start` is relative to the run's start.

    error is None for a success; otherwise a short type such as "grpc:UNAVAILABLE", "http:429",
    "connect", "timeout", "finish:error", or "incomplete" (still running when the run stopped)."""

    index: int
    start: float
    prompt_tokens_sent: int  # what the load generator asked for
    max_tokens: int
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0  # tokens counted in the stream
    usage_prompt_tokens: int | None = None  # the server's usage, when it reports one
    usage_completion_tokens: int | None = None
    usage_cached_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    error_message: str = ""
    group: str = ""  # the mix component it came from ("short", "long", ...)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def input_tokens(self) -> int:
        """Prompt tokens as the server counted them when it said so, else as sent."""
        return self.usage_prompt_tokens if self.usage_prompt_tokens is not None else self.prompt_tokens_sent


@dataclass(frozen=True, slots=True)
class Slo:
    """A service-level objective per request; None disables that bound."""

    ttft_ms: float | None = None
    itl_ms: float | None = None

    def met_by(self, rec: RequestRecord) -> bool:
        """A successful request meets the SLO when its TTFT and its mean ITL are within bounds."""
        if not rec.ok or rec.ttft is None:
            return False
        if self.ttft_ms is not None and rec.ttft * 1000.0 > self.ttft_ms:
            return False
        tpot = rec.tpot
        return not (self.itl_ms is not None and tpot is not None and tpot * 1000.0 > self.itl_ms)


@dataclass(frozen=True, slots=True)
class Distribution:
    """Summary of a latency sample, in milliseconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    def as_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "p50": self.p50, "p90": self.p90, "p99": self.p99,
                "max": self.max}


@dataclass(frozen=True, slots=True)
class Summary:
    """The numbers of one run (one rate of a sweep)."""

    requests: int
    successes: int
    errors: dict[str, int]
    duration_s: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    usage_completion_tokens: int
    request_throughput: float  # successful requests / s
    input_throughput: float  # prompt tokens of successful requests / s
    output_throughput: float  # generated tokens (all requests) / s
    ttft_ms: Distribution
    itl_ms: Distribution
    tpot_ms: Distribution
    e2e_ms: Distribution
    slo: Slo
    good: int
    goodput: float  # requests / s meeting the SLO

    def as_dict(self) -> dict[str, object]:
        return {
            "requests": self.requests, "successes": self.successes, "errors": dict(self.errors),
            "duration_s": self.duration_s, "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens, "usage_completion_tokens": self.usage_completion_tokens,
            "request_throughput": self.request_throughput, "input_throughput": self.input_throughput,
            "output_throughput": self.output_throughput,
            "ttft_ms": self.ttft_ms.as_dict(), "itl_ms": self.itl_ms.as_dict(), "tpot_ms": self.tpot_ms.as_dict(),
            "e2e_ms": self.e2e_ms.as_dict(),
            "slo": {"ttft_ms": self.slo.ttft_ms, "itl_ms": self.slo.itl_ms},
            "good": self.good, "goodput": self.goodput,
        }


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default);
    NaN for an empty sample."""
    if not values:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(seconds: Sequence[float]) -> Distribution:
    """Mean, p50, p90, p99 and max of a sample given in seconds, reported in milliseconds."""
    ms = [s * 1000.0 for s in seconds]
    if not ms:
        return Distribution(0, math.nan, math.nan, math.nan, math.nan, math.nan)
    return Distribution(len(ms), sum(ms) / len(ms), percentile(ms, 50), percentile(ms, 90), percentile(ms, 99),
                        max(ms))


def run_duration(records: Sequence[RequestRecord]) -> float:
    """From the first send to the last completion (or the last send, if nothing completed)."""
    if not records:
        return 0.0
    first = min(r.start for r in records)
    last = max(r.start + (r.e2e or 0.0) for r in records)
    return max(last - first, 0.0)


def summarize(records: Sequence[RequestRecord], slo: Slo = Slo(), duration_s: float | None = None) -> Summary:
    """All the report's numbers from the per-request records. `duration_s` defaults to run_duration()."""
    duration = run_duration(records) if duration_s is None else duration_s
    ok = [r for r in records if r.ok]
    errors = Counter(r.error for r in records if r.error is not None)
    good = sum(slo.met_by(r) for r in ok)
    input_tokens = sum(r.input_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in records)

    def rate(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    return Summary(
        requests=len(records),
        successes=len(ok),
        errors=dict(sorted(errors.items())),
        duration_s=duration,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cached_tokens=sum(r.usage_cached_tokens or 0 for r in ok),
        usage_completion_tokens=sum(r.usage_completion_tokens or 0 for r in records),
        request_throughput=rate(len(ok)),
        input_throughput=rate(input_tokens),
        output_throughput=rate(output_tokens),
        ttft_ms=distribution([r.ttft for r in ok if r.ttft is not None]),
        itl_ms=distribution([x for r in ok for x in r.itls]),
        tpot_ms=distribution([t for r in ok if (t := r.tpot) is not None]),
        e2e_ms=distribution([r.e2e for r in ok if r.e2e is not None]),
        slo=slo,
        good=good,
        goodput=rate(good),
    )


def split_chunk_gap(gap: float, tokens: int) -> list[float]:
    """A chunk of `tokens` tokens that arrived `gap` seconds after the previous one: `tokens` ITL samples."""
    if tokens <= 0:
        return []
    return [gap / tokens] * tokens


def by_group(records: Sequence[RequestRecord]) -> dict[str, list[RequestRecord]]:
    """Records per mix component, in first-seen order."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(r.group, []).append(r)
    return groups
