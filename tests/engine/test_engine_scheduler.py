"""The scheduler's step plans: short_first's prefill-only steps in a burst, bounded, and never under FCFS."""

from __future__ import annotations

import itertools
import time

from qwenserve.engine.block_pool import BlockPool
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.engine.scheduler import Scheduler, SchedulerLimits
from qwenserve.engine.sequence import Sequence

_serial = itertools.count(1)


def _seq(rid: str, n: int) -> Sequence:
    # Distinct tokens per request: no prefix-cache hit may shrink a prompt behind the test's back.
    first = 1000 * next(_serial)
    return Sequence(rid, n, list(range(first, first + n)), SamplingParams(), max_tokens=64, emit=lambda o: None,
                    arrival_time=time.monotonic())


def _scheduler(policy: str = "short_first", burst_steps: int = 2, budget: int = 64) -> Scheduler:
    limits = SchedulerLimits(max_num_batched_tokens=budget, max_num_seqs=32, admission_policy=policy,
                             burst_prefill_steps=burst_steps)
    return Scheduler(limits, BlockPool(num_blocks=256, block_size=16))


def _step(sched: Scheduler, seconds: float = 0.01) -> dict[str, int]:
    """Plan a step, then play the engine: count the tokens computed, report the step's length (`seconds`)
    and sample one token where due."""
    plan = sched.schedule()
    sched.on_step_computed(plan.scheduled)
    sched.observe_step(plan, seconds)
    for item in plan.scheduled:
        if item.seq.num_uncomputed_tokens == 0:
            item.seq.token_ids.append(7)
    return {item.seq.request_id: item.num_tokens for item in plan.scheduled}


def _decoding(sched: Scheduler, n: int) -> None:
    for i in range(n):
        sched.add(_seq(f"d{i}", 4))
    _step(sched)  # 4-token prompts: all prefilled in one step, each now decoding
    assert all(s.num_uncomputed_tokens == 1 for s in sched.running)


def test_a_burst_that_does_not_fit_beside_the_decodes_gets_prefill_only_steps_then_decodes_resume():
    sched = _scheduler(burst_steps=2)
    _decoding(sched, 8)
    for i in range(6):
        sched.add(_seq(f"p{i}", 40))  # 240 prompt tokens wait; a step has 64 - 8 decodes = 56 beside them
    plans = [_step(sched) for _ in range(8)]
    assert not any(r.startswith("d") for r in plans[0]) and sum(plans[0].values()) == 64
    assert not any(r.startswith("d") for r in plans[1]) and sum(plans[1].values()) == 64
    # Two prefill-only steps in a row at most: the decodes run in the third.
    assert all(plans[2].get(f"d{i}") == 1 for i in range(8))
    assert sched.num_prefill_only_steps >= 2
    # Every prompt got its first token within these steps, and the decodes were never left out twice running.
    assert all(s.num_output_tokens >= 1 for s in sched.running if s.request_id.startswith("p"))
    assert all(any(r.startswith("d") for r in plan) for plan in plans[2::3])


def test_a_prompt_that_fits_beside_the_decodes_shares_the_step_with_them():
    sched = _scheduler()
    _decoding(sched, 8)
    sched.add(_seq("p", 40))
    plan = _step(sched)
    assert plan["p"] == 40 and all(plan[f"d{i}"] == 1 for i in range(8))
    assert sched.num_prefill_only_steps == 0


def test_prefill_only_steps_stop_where_one_is_measured_too_long_for_the_decodes():
    sched = _scheduler(burst_steps=2)  # burst_max_stall_s 0.25 by default
    _decoding(sched, 8)
    for i in range(6):
        sched.add(_seq(f"p{i}", 40))
    first = _step(sched, seconds=0.5)  # the probe: a full prefill-only step takes 0.5 s here
    assert not any(r.startswith("d") for r in first)
    for _ in range(4):  # two such steps would stall the decodes 1 s: every later step carries them
        plan = _step(sched)
        assert all(plan[f"d{i}"] == 1 for i in range(8))
    assert sched.num_prefill_only_steps == 1


def test_fcfs_and_a_zero_limit_never_leave_decodes_out():
    for sched in (_scheduler(policy="fcfs"), _scheduler(burst_steps=0)):
        _decoding(sched, 8)
        for i in range(4):
            sched.add(_seq(f"p{i}", 40))
        for _ in range(4):
            plan = _step(sched)
            assert all(plan[f"d{i}"] == 1 for i in range(8))
        assert sched.num_prefill_only_steps == 0


def test_a_step_without_decodes_takes_the_larger_prefill_only_budget_and_one_with_decodes_does_not():
    limits = SchedulerLimits(max_num_batched_tokens=64, max_num_seqs=32, admission_policy="fcfs",
                             max_prefill_only_tokens=200)
    sched = Scheduler(limits, BlockPool(num_blocks=256, block_size=16))
    sched.add(_seq("long", 500))
    assert _step(sched) == {"long": 200}  # nothing decodes: the prompt's chunk is the larger budget
    assert _step(sched) == {"long": 200}
    sched.add(_seq("short", 4))
    assert _step(sched) == {"long": 100, "short": 4}  # the prompt's last 100 tokens, and the short one whole
    # Both decode now: a prompt arriving beside them gets what the decodes leave of the smaller budget.
    sched.add(_seq("next", 300))
    assert _step(sched) == {"long": 1, "short": 1, "next": 62}
    # Without the setting, every step has the one budget.
    plain = _scheduler(policy="fcfs")
    plain.add(_seq("long", 500))
    assert _step(plain) == {"long": 64}
