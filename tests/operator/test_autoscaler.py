"""Autoscaler decisions: pure functions over many metric situations."""

from __future__ import annotations

import pytest

from qwenserve_operator import autoscaler
from qwenserve_operator.autoscaler import Policy, StageSignals, decide, keep_ratio, recommend

PREFILL = Policy(min_replicas=1, max_replicas=8, latency_target=1.0, target_queue_depth=4,
                 stabilization_seconds=300, max_step=4)
DECODE = Policy(min_replicas=1, max_replicas=8, latency_target=0.05, target_queue_depth=4, target_running=32,
                target_kv_usage=0.75, stabilization_seconds=300, max_step=4)

TEXT = """\
# HELP qwenserve_engine_waiting_requests Requests waiting.
# TYPE qwenserve_engine_waiting_requests gauge
qwenserve_engine_waiting_requests{model="q"} 3
qwenserve_engine_waiting_requests{model="r"} 2
# TYPE qwenserve_engine_running_requests gauge
qwenserve_engine_running_requests 7
# TYPE qwenserve_kv_blocks_usage_ratio gauge
qwenserve_kv_blocks_usage_ratio{pool="a"} 0.4
qwenserve_kv_blocks_usage_ratio{pool="b"} 0.9
# TYPE qwenserve_router_ttft_seconds histogram
qwenserve_router_ttft_seconds_bucket{le="0.1"} 10
qwenserve_router_ttft_seconds_bucket{le="0.5"} 60
qwenserve_router_ttft_seconds_bucket{le="1.0"} 90
qwenserve_router_ttft_seconds_bucket{le="+Inf"} 100
qwenserve_router_ttft_seconds_sum 40
qwenserve_router_ttft_seconds_count 100
# TYPE qwenserve_unrelated_total counter
qwenserve_unrelated_total 5
"""


def test_parse_metrics_sums_gauges_takes_the_busiest_kv_pool_and_reads_buckets() -> None:
    pod = autoscaler.parse_metrics(TEXT)
    assert pod.gauges == {autoscaler.WAITING: 5, autoscaler.RUNNING: 7, autoscaler.KV_USAGE: 0.9}
    assert pod.histograms[autoscaler.TTFT] == {0.1: 10, 0.5: 60, 1.0: 90, float("inf"): 100}


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    buckets = {0.1: 10, 0.5: 60, 1.0: 90, float("inf"): 100}
    assert autoscaler.histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (50 - 10) / 50)
    assert autoscaler.histogram_quantile(0.9, buckets) == pytest.approx(1.0)
    assert autoscaler.histogram_quantile(0.99, buckets) == 1.0  # in +Inf: the highest finite bound
    assert autoscaler.histogram_quantile(0.9, {}) is None
    assert autoscaler.histogram_quantile(0.9, {1.0: 0, float("inf"): 0}) is None


def test_latency_is_measured_over_the_last_interval_only() -> None:
    before = {0.5: 1000, 2.0: 1000, float("inf"): 1000}  # a long, fast history
    now = {0.5: 1000, 2.0: 1100, float("inf"): 1100}  # the last 100 requests were all slow
    delta = autoscaler.histogram_delta(now, before)
    assert autoscaler.histogram_quantile(0.9, delta) > 1.0
    assert autoscaler.histogram_delta(now, None) == {}  # the first scrape has no interval
    restarted = {0.5: 5, 2.0: 5, float("inf"): 5}
    assert autoscaler.histogram_delta(restarted, before) == restarted


def test_merge_histograms_adds_the_router_replicas() -> None:
    pods = [autoscaler.parse_metrics(TEXT), autoscaler.parse_metrics(TEXT)]
    assert autoscaler.merge_histograms(pods, autoscaler.TTFT)[1.0] == 180


def test_stage_signals_sum_pods() -> None:
    pods = [autoscaler.parse_metrics(TEXT), autoscaler.PodMetrics(gauges={autoscaler.KV_USAGE: 0.2})]
    signals = autoscaler.stage_signals(pods, latency=0.3)
    assert signals == StageSignals(pods=2, waiting=5, running=7, kv_usage=0.9, latency=0.3)


def test_scale_up_on_a_ttft_breach_even_with_an_empty_queue() -> None:
    decision = decide(2, StageSignals(pods=2, waiting=0, latency=1.5), PREFILL, (), now=0)
    assert decision.replicas == 3 and decision.reason.startswith("scale up") and "breach" in decision.reason


def test_a_large_ttft_breach_grows_in_proportion() -> None:
    assert decide(2, StageSignals(pods=2, latency=10.0), PREFILL, (), now=0).replicas == 4  # capped at 2x


def test_scale_up_on_queue_depth() -> None:
    decision = decide(1, StageSignals(pods=1, waiting=14), PREFILL, (), now=0)
    assert decision.replicas == 4 and "14 waiting" in decision.reason


def test_scale_up_is_limited_per_step_and_by_max() -> None:
    assert decide(1, StageSignals(pods=1, waiting=400), PREFILL, (), now=0).replicas == 5  # 1 + maxScaleUpStep
    assert decide(6, StageSignals(pods=6, waiting=400), PREFILL, (), now=0).replicas == 8  # maxReplicas


def test_decode_scales_on_kv_usage_running_requests_and_itl() -> None:
    assert decide(2, StageSignals(pods=2, kv_usage=0.95), DECODE, (), now=0).replicas == 3
    assert decide(2, StageSignals(pods=2, running=150), DECODE, (), now=0).replicas == 5
    assert decide(2, StageSignals(pods=2, latency=0.08), DECODE, (), now=0).replicas == 4
    assert decide(2, StageSignals(pods=2, running=60, kv_usage=0.5, latency=0.01), DECODE, (), now=0).replicas == 2


def test_scale_down_waits_for_the_stabilisation_window() -> None:
    busy = StageSignals(pods=4, waiting=16)
    idle = StageSignals(pods=4, waiting=0)
    history = decide(4, busy, PREFILL, (), now=0).history
    held = decide(4, idle, PREFILL, history, now=100)
    assert held.replicas == 4 and held.reason.startswith("hold")
    after = decide(4, idle, PREFILL, held.history, now=301)
    assert after.replicas == 1 and after.reason.startswith("scale down")


def test_flapping_load_does_not_flap_replicas() -> None:
    history: tuple = ()
    replicas = 4
    seen = []
    for t in range(0, 290, 10):
        signals = StageSignals(pods=replicas, waiting=16 if t % 20 == 0 else 0)
        decision = decide(replicas, signals, PREFILL, history, now=t)
        replicas, history = decision.replicas, decision.history
        seen.append(replicas)
    assert set(seen) == {4}


def test_latency_near_the_target_holds_the_stage() -> None:
    decision = decide(3, StageSignals(pods=3, waiting=0, latency=0.9), PREFILL, ((0, 1),), now=1000)
    assert decision.replicas == 3


def test_bounds_are_respected_even_without_load() -> None:
    policy = Policy(min_replicas=2, max_replicas=3, latency_target=1, target_queue_depth=4,
                    stabilization_seconds=0)
    assert decide(1, StageSignals(pods=1), policy, (), now=0).replicas == 2
    assert decide(6, StageSignals(pods=6, waiting=100), policy, (), now=0).replicas == 3
    assert decide(2, StageSignals(pods=2), policy, (), now=0).replicas == 2


@pytest.mark.parametrize(("prefill", "decode", "expected"), [
    (1, 8, (2, 8)),  # 1/8 < 0.25: prefill raised
    (8, 1, (8, 2)),  # 8/1 > 4: decode raised
    (2, 2, (2, 2)),  # inside: untouched
    (1, 40, (4, 40)),  # prefill raised only up to its max
])
def test_ratio_is_kept_by_raising_the_smaller_side(prefill, decode, expected) -> None:
    assert keep_ratio(prefill, decode, 0.25, 4.0, prefill_max=4, decode_max=40) == expected


def test_recommend_reports_the_winning_signal() -> None:
    rec = recommend(2, StageSignals(pods=2, waiting=1, kv_usage=0.99), DECODE)
    assert rec.replicas == 3 and "KV usage" in rec.reason


def test_policy_from_a_defaulted_spec(make_spec) -> None:
    spec = make_spec(slo={"ttftSeconds": 0.7}, stages={"decode": {"autoscaling": {"maxReplicas": 9}}})
    assert Policy.from_spec(spec, "prefill").latency_target == 0.7
    decode = Policy.from_spec(spec, "decode")
    assert decode.max_replicas == 9 and decode.target_kv_usage == 0.75
    assert decode.latency_target == spec["slo"]["interTokenLatencySeconds"]


ZERO = Policy(min_replicas=0, max_replicas=4, latency_target=0.05, target_queue_depth=4, target_running=32,
              target_kv_usage=0.75, stabilization_seconds=60, max_step=4)


def test_an_idle_stage_with_min_zero_goes_to_zero_after_the_window_and_never_while_busy() -> None:
    idle = StageSignals(pods=1)
    first = decide(1, StageSignals(pods=1, running=1), ZERO, (), now=0)
    assert first.replicas == 1  # one stream running: a stage never goes to zero under work
    held = decide(1, idle, ZERO, first.history, now=30)
    assert held.replicas == 1 and held.reason.startswith("hold")
    gone = decide(1, idle, ZERO, held.history, now=61)
    assert gone.replicas == 0 and gone.reason.startswith("scale down")


def test_a_request_held_by_the_router_brings_a_stage_back_from_zero_at_once() -> None:
    decision = decide(0, StageSignals(pods=0, held=2), ZERO, (), now=0)
    assert decision.replicas == 1 and "held" in decision.reason
    assert decide(0, StageSignals(pods=0), ZERO, (), now=0).replicas == 0


def test_held_requests_are_read_from_the_routers_metrics_by_stage() -> None:
    text = ('# TYPE qwenserve_router_held_requests gauge\n'
            'qwenserve_router_held_requests{model="a",worker_stage="decode"} 2\n'
            'qwenserve_router_held_requests{model="b",worker_stage="decode"} 1\n')
    routers = [autoscaler.parse_metrics(text), autoscaler.parse_metrics(text)]
    assert autoscaler.held_requests(routers, "decode") == 6 and autoscaler.held_requests(routers, "prefill") == 0
