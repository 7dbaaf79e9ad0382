"""Faults inside the engine: a bad request is refused at intake, one request's failure ends only that
request, and a compute loop that cannot go on fails every caller at once instead of hanging them."""

from __future__ import annotations

import asyncio
import threading

import pytest

from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.errors import EngineDeadError
from qwenserve.engine.sampling_params import InvalidSamplingParams, SamplingParams
from qwenserve.request_limits import TokenOutsideVocabulary
from tests.support.engine_checkpoints import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_a_stop_token_id_outside_the_vocabulary_is_refused_and_the_engine_serves_on(make_engine):
    engine = make_engine("qwen3_gqa4")  # vocabulary of 1024
    bad = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=2, stop_token_ids=(4294967295,))
    with pytest.raises(TokenOutsideVocabulary, match="stop_token_ids: token id 4294967295 is outside the vocabulary"):
        engine.generate_sync([[1, 2, 3]], bad)
    assert engine.generate_sync([[1, 2, 3]], GREEDY)[0] and engine.failure is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", float("inf")), ("repetition_penalty", float("inf")), ("top_p", float("nan")),
     ("presence_penalty", float("nan")), ("top_k", 2**40), ("stop_token_ids", tuple(range(2000))),
     ("stop_token_ids", (-1,))],
)
def test_sampling_params_refuse_non_finite_and_unbounded_values(field, value):
    with pytest.raises(InvalidSamplingParams, match=field):
        SamplingParams(**{field: value})


def test_a_request_whose_sampling_fails_ends_with_an_error_and_its_batch_goes_on(make_engine, monkeypatch):
    engine = make_engine("qwen3_gqa4")
    prompts = random_prompts(3, 5, 12, seed=21)
    expected = engine.generate_sync(prompts, GREEDY)
    cursed = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, seed=666)
    real = engine.step.sampler

    def sampler(logits, rows):
        if any(r.params.seed == 666 for r in rows):
            raise IndexError("index 4294967295 is out of bounds")  # what a stop id past the vocabulary did
        return real(logits, rows)

    monkeypatch.setattr(engine.step, "sampler", sampler)
    outs = engine.generate_sync_outputs(prompts, [GREEDY, cursed, GREEDY])
    assert outs[1][-1].finish_reason == "error" and "IndexError" in outs[1][-1].error
    assert [[t for o in r for t in o.new_token_ids] for r in (outs[0], outs[2])] == [expected[0], expected[2]]
    assert engine.failure is None
    assert engine.generate_sync([prompts[1]], GREEDY) == [expected[1]]


async def test_a_dead_compute_loop_fails_every_request_refuses_new_ones_and_says_why(checkpoint):
    engine = LLMEngine.from_pretrained(checkpoint("qwen3_gqa4"), EngineConfig(num_kv_blocks=32, block_size=8,
                                                                              num_threads=1))
    heard: list[str] = []
    told = threading.Event()
    engine.on_failure(lambda reason: (heard.append(reason), told.set()))
    try:
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        stream = engine.generate("victim", [1, 2, 3], long)
        assert not (await stream.__anext__()).finished
        schedule = engine.scheduler.schedule

        def broken_schedule():
            if any(s.request_id == "trigger" for s in engine.scheduler.waiting):
                raise RuntimeError("scheduler state is corrupt")
            return schedule()

        engine.scheduler.schedule = broken_schedule  # the scheduler is the loop's own state: no step owns it
        trigger = engine.generate("trigger", [4, 5, 6], long)
        ends = await asyncio.wait_for(asyncio.gather(_drain(stream), _drain(trigger), return_exceptions=True), 30)
        for end in ends:
            assert isinstance(end, EngineDeadError) and "RuntimeError: scheduler state is corrupt" in str(end)
        assert told.wait(10) and heard == [engine.failure] and "compute loop failed" in heard[0]
        with pytest.raises(EngineDeadError):
            engine.generate_sync([[1, 2]], GREEDY)
        late: list[str] = []
        engine.on_failure(late.append)  # a listener that comes late still hears of it
        assert late == [engine.failure]
    finally:
        engine.shutdown()


async def _drain(stream) -> None:
    async for _ in stream:
        pass
