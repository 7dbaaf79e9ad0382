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


# -- the prefill:decode balance: a latency miss is charged to the stage whose load explains it -----------------


def test_ttft_missed_while_decode_is_idle_grows_prefill_and_the_itl_miss_beside_it_only_holds_decode() -> None:
    # A prompt flood: prefill's queue is long; decode streams a few short answers, and its ITL suffers from the
    # shared cores.
    prefill = StageSignals(pods=1, waiting=6, latency=3.0)
    decode = StageSignals(pods=1, running=2, kv_usage=0.05, latency=0.2)
    prefill, decode = autoscaler.charge_latency(prefill, decode, PREFILL, DECODE)
    assert prefill.latency_charged_to is None and decode.latency_charged_to == "prefill"
    assert decide(1, prefill, PREFILL, (), now=0).replicas == 2
    assert decide(1, decode, DECODE, (), now=0).replicas == 1
    # It holds: an idle-looking decode stage with a missed ITL does not shrink either.
    held = decide(3, decode, DECODE, ((0.0, 3),), now=1000)
    assert held.replicas == 3 and "charged to prefill" in held.reason


def test_itl_missed_while_prefill_is_idle_grows_decode_and_not_prefill() -> None:
    # Many long answers to short prompts: decode is loaded, prefill's TTFT suffers beside it with nothing queued.
    prefill = StageSignals(pods=1, waiting=0, running=1, latency=2.5)
    decode = StageSignals(pods=1, running=20, kv_usage=0.3, latency=0.09)
    prefill, decode = autoscaler.charge_latency(prefill, decode, PREFILL, DECODE)
    assert prefill.latency_charged_to == "decode" and decode.latency_charged_to is None
    assert decide(1, prefill, PREFILL, (), now=0).replicas == 1
    assert decide(1, decode, DECODE, (), now=0).replicas == 2


def test_a_miss_stays_with_its_stage_when_that_stage_has_a_queue_or_is_the_busier() -> None:
    # Something queued for prefill: its TTFT miss is its own, however busy decode is.
    queued = StageSignals(pods=2, waiting=1, latency=3.0)
    busy_decode = StageSignals(pods=1, running=30, latency=0.01)
    assert autoscaler.charge_latency(queued, busy_decode, PREFILL, DECODE)[0].latency_charged_to is None
    # Both idle (e.g. the latency of a slow model): each miss stays where it was, as without the balance.
    prefill, decode = autoscaler.charge_latency(StageSignals(pods=1, latency=3.0), StageSignals(pods=1, latency=1.0),
                                                PREFILL, DECODE)
    assert prefill.latency_charged_to is None and decode.latency_charged_to is None
    # Latency within the target is never charged anywhere.
    prefill, decode = autoscaler.charge_latency(StageSignals(pods=1, latency=0.5), StageSignals(pods=1, running=30),
                                                PREFILL, DECODE)
    assert prefill.latency_charged_to is None


def test_load_share_is_the_busiest_signal_per_replica_against_its_target() -> None:
    assert autoscaler.load_share(StageSignals(pods=2, waiting=4), PREFILL) == 0.5
    assert autoscaler.load_share(StageSignals(pods=2, running=32, kv_usage=0.3), DECODE) == 0.5
    assert autoscaler.load_share(StageSignals(pods=1, kv_usage=0.75), DECODE) == 1.0
    assert autoscaler.load_share(StageSignals(pods=0, held=2), PREFILL) == 0.5  # held requests at zero pods


def test_busy_share_is_the_time_spent_stepping_between_two_scrapes_per_pod() -> None:
    text = ("# TYPE qwenserve_engine_step_seconds histogram\n"
            'qwenserve_engine_step_seconds_bucket{le="0.1"} 3\nqwenserve_engine_step_seconds_bucket{le="+Inf"} 4\n'
            "qwenserve_engine_step_seconds_sum 12.5\nqwenserve_engine_step_seconds_count 4\n")
    assert autoscaler.parse_metrics(text).busy_seconds == 12.5
    pods = [autoscaler.PodMetrics(busy_seconds=14.0, pod="a"), autoscaler.PodMetrics(busy_seconds=5.0, pod="b"),
            autoscaler.PodMetrics(busy_seconds=3.0, pod="new")]
    # a: 4 of 5 s stepping; b: restarted (its sum went down), left out; new: not seen before, left out.
    assert autoscaler.busy_share(pods, {"a": 10.0, "b": 9.0}, seconds=5.0) == pytest.approx(0.8)
    assert autoscaler.busy_share(pods, {}, seconds=5.0) == 0.0


def test_a_stage_stepping_all_the_time_is_the_loaded_one_though_nothing_waits() -> None:
    # A prompt flood that prefill keeps up with: no queue at the scrape, but its engine never rests.
    prefill = StageSignals(pods=1, running=1, busy=0.95, latency=3.0)
    decode = StageSignals(pods=1, running=1, busy=0.2, latency=0.2)
    prefill, decode = autoscaler.charge_latency(prefill, decode, PREFILL, DECODE)
    assert prefill.latency_charged_to is None and decode.latency_charged_to == "prefill"
