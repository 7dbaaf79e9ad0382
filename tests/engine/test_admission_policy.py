"""Admission policies: the sliding watermark's arithmetic on a recorded series, its holding and its reset, and
priority tiers with aging under a synthetic overload (the scheduler itself, no model)."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from qwenserve.engine.admission_policy import SlidingWatermark, WatermarkSettings, percentile, request_score
from qwenserve.engine.block_pool import BlockPool
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.engine.scheduler import Scheduler, SchedulerLimits
from qwenserve.engine.sequence import Sequence

_serial = itertools.count(1)


def _seq(rid: str, prompt: int, max_tokens: int = 16, priority: int = 0, waited_s: float = 0.0) -> Sequence:
    first = 1000 * next(_serial)  # distinct tokens: no prefix-cache hit shrinks a prompt
    return Sequence(rid, prompt, list(range(first, first + prompt)), SamplingParams(), max_tokens=max_tokens,
                    emit=lambda o: None, arrival_time=time.monotonic() - waited_s, priority=priority)


def _scheduler(policy: str, budget: int = 64, max_seqs: int = 32, **limits: object) -> Scheduler:
    return Scheduler(SchedulerLimits(max_num_batched_tokens=budget, max_num_seqs=max_seqs, admission_policy=policy,
                                     **limits), BlockPool(num_blocks=512, block_size=16))


def _admitted(sched: Scheduler) -> list[str]:
    plan = sched.schedule()
    sched.on_step_computed(plan.scheduled)
    for item in plan.scheduled:
        if item.seq.num_uncomputed_tokens == 0:
            item.seq.token_ids.append(7)
    return [item.seq.request_id for item in plan.scheduled]


def test_the_watermark_is_the_percentile_of_the_last_window_of_scores() -> None:
    rng = np.random.default_rng(3)
    recorded = [(int(p), int(m)) for p, m in zip(rng.integers(5, 3000, 200), rng.integers(1, 500, 200), strict=True)]
    policy = SlidingWatermark(2.0, settings=WatermarkSettings(window=48, percentile=90))
    now = time.monotonic()
    for i, (prompt, out) in enumerate(recorded):
        policy.on_arrival(_seq(f"r{i}", prompt, out), None, now)
    scores = [0.8 * p + 1.2 * m for p, m in recorded[-48:]]
    assert policy.watermark == pytest.approx(np.percentile(scores, 90))
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(np.percentile([1, 2, 3, 4], 50))
    assert request_score(_seq("x", 100, 10)) == 0.8 * 100 + 1.2 * 10


def test_a_held_requests_score_decays_and_an_idle_queue_forgets_the_window() -> None:
    policy = SlidingWatermark(60.0, settings=WatermarkSettings(window=8, percentile=50, decay=0.5, reset_idle_s=3))
    now = time.monotonic()
    for i in range(8):
        policy.on_arrival(_seq(f"s{i}", 10, 10), None, now)  # score 20 each: the watermark is 20
    big = _seq("big", 100, 10)  # score 92
    assert policy.held(big, now)
    big.arrival_time = now - 3  # 92 x 0.5^3 = 11.5: under the watermark after three seconds of waiting
    assert not policy.held(big, now)
    policy.on_arrival(_seq("after-idle", 200, 10), queue_was_empty_since=now - 4, now=now)
    assert list(policy.scores) == [0.8 * 200 + 1.2 * 10] and policy.resets == 1


def test_the_watermark_holds_expensive_requests_while_cheaper_ones_wait_and_never_idles_for_them() -> None:
    sched = _scheduler("watermark", budget=64, watermark=WatermarkSettings(window=16, percentile=50, decay=1.0))
    for i in range(10):
        sched.add(_seq(f"chat{i}", 8, 8))  # score 16
    sched.add(_seq("doc", 60, 100))  # score 168: above the watermark (16)
    for i in range(10, 14):
        sched.add(_seq(f"chat{i}", 8, 8))
    first = _admitted(sched)
    assert "doc" not in first and set(first) == {f"chat{i}" for i in range(8)}  # 8 x 8 tokens fill the step
    second = _admitted(sched)
    assert "doc" not in second and {f"chat{i}" for i in range(8, 14)} <= set(second)
    # Nothing cheaper waits and no prompt is being prefilled: the held request runs rather than the engine idling.
    assert "doc" in _admitted(sched)


@pytest.mark.parametrize("policy", ["fcfs", "short_first", "watermark"])
def test_a_high_tier_is_admitted_first_in_an_overload_and_a_low_tier_ages_into_its_turn(policy: str) -> None:
    sched = _scheduler(policy, budget=32, max_seqs=4, priority_aging_s=5.0)
    # The overload: twelve requests for four seats, low tier (2) first in arrival order.
    for i in range(6):
        sched.add(_seq(f"low{i}", 8, priority=2))
    for i in range(6):
        sched.add(_seq(f"high{i}", 8, priority=0))
    assert set(_admitted(sched)) == {f"high{i}" for i in range(4)}
    # A low-tier request that has waited two aging periods competes as tier 0, and it arrived first.
    for seq in list(sched.running):
        sched.finish(seq)
    old = next(s for s in sched.waiting if s.request_id == "low0")
    old.arrival_time = time.monotonic() - 10.5
    admitted = _admitted(sched)
    assert "low0" in admitted and {"high4", "high5"} <= set(admitted) and len(admitted) == 4


@pytest.mark.parametrize("policy", ["fcfs", "short_first", "watermark"])
def test_waiting_past_the_queue_delay_does_not_jump_a_tier_but_goes_first_within_one(policy: str) -> None:
    # A slow engine: the free tier's flood has waited past max_queue_delay_s (2 s), well inside its aging (30 s),
    # when the paid requests come. Urgency is the policy's own anti-starvation: it must not put them behind it.
    sched = _scheduler(policy, budget=64, max_seqs=4, priority_aging_s=30.0, max_queue_delay_s=2.0)
    for i in range(4):
        sched.add(_seq(f"free{i}", 8, priority=2, waited_s=3.0))
    for i in range(2):
        sched.add(_seq(f"paid{i}", 8, priority=0))
    assert _admitted(sched)[:2] == ["paid0", "paid1"]
    # Within a tier the urgent one goes first, even where the policy would put a shorter prompt before it.
    same = _scheduler(policy, budget=64, max_seqs=1, priority_aging_s=30.0, max_queue_delay_s=2.0)
    same.add(_seq("fresh-short", 4, priority=0))
    same.add(_seq("waited-long", 24, priority=0, waited_s=3.0))
    assert _admitted(same) == ["waited-long"]
