"""The report's arithmetic on hand-made records whose answers are known."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from qwenserve.loadgen.stats import RequestRecord, Slo, percentile, split_chunk_gap, summarize


def test_percentile_matches_numpy_linear_interpolation() -> None:
    rng = random.Random(3)
    for n in (1, 2, 7, 100, 1001):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 99.9, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def _rec(i: int, ttft: float, itl: float, n: int, error: str | None = None) -> RequestRecord:
    r = RequestRecord(index=i, start=float(i), prompt_tokens_sent=10 + i, max_tokens=n, error=error)
    if error is None:
        r.ttft = ttft
        r.itls = [itl] * (n - 1)
        r.e2e = ttft + itl * (n - 1)
        r.output_tokens = n
        r.usage_completion_tokens = n
        r.usage_prompt_tokens = 10 + i
        r.usage_cached_tokens = i
    return r


def test_summary_counts_tokens_errors_and_goodput() -> None:
    records = [
        _rec(0, 0.100, 0.010, 5),   # meets TTFT<=200ms and ITL<=20ms
        _rec(1, 0.300, 0.010, 5),   # TTFT too slow
        _rec(2, 0.150, 0.030, 3),   # ITL too slow
        _rec(3, 0.050, 0.005, 11),  # meets
        _rec(4, 0, 0, 0, error="grpc:UNAVAILABLE"),
        _rec(5, 0, 0, 0, error="http:429"),
        _rec(6, 0, 0, 0, error="http:429"),
    ]
    s = summarize(records, Slo(ttft_ms=200, itl_ms=20), duration_s=4.0)
    assert (s.requests, s.successes) == (7, 4)
    assert s.errors == {"grpc:UNAVAILABLE": 1, "http:429": 2}
    assert s.output_tokens == 5 + 5 + 3 + 11
    assert s.input_tokens == 10 + 11 + 12 + 13  # successes only, as the server counted them
    assert s.cached_tokens == 0 + 1 + 2 + 3
    assert s.good == 2 and s.goodput == pytest.approx(0.5)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(24 / 4.0)
    assert s.ttft_ms.p50 == pytest.approx(125.0)  # median of 50, 100, 150, 300
    assert s.ttft_ms.max == pytest.approx(300.0)
    itls = [10.0] * 4 + [10.0] * 4 + [30.0] * 2 + [5.0] * 10
    assert s.itl_ms.count == 20
    assert s.itl_ms.mean == pytest.approx(sum(itls) / 20)
    assert s.itl_ms.p99 == pytest.approx(float(np.percentile(itls, 99)))
    assert s.tpot_ms.max == pytest.approx(30.0)


def test_only_the_bounds_given_count_for_goodput() -> None:
    records = [_rec(0, 0.100, 0.050, 4), _rec(1, 0.900, 0.001, 4)]
    assert summarize(records, Slo(ttft_ms=200)).good == 1
    assert summarize(records, Slo(itl_ms=10)).good == 1
    assert summarize(records, Slo()).good == 2


def test_default_duration_runs_from_first_send_to_last_completion() -> None:
    records = [_rec(0, 0.1, 0.1, 3), _rec(2, 0.5, 0.5, 3)]  # ends at 0.3 and at 2 + 1.5
    assert summarize(records).duration_s == pytest.approx(3.5)


def test_a_chunk_of_k_tokens_counts_k_equal_gaps() -> None:
    assert split_chunk_gap(0.09, 3) == pytest.approx([0.03, 0.03, 0.03])
    assert split_chunk_gap(0.5, 0) == []
    r = _rec(0, 0.2, 0.0, 1)
    assert r.tpot is None  # one token: no inter-token time
