"""Logprobs against transformers, seeded sampling reproducibility, resume, and the sampler's filters."""

from __future__ import annotations

import pytest
import torch

from qwenserve.engine.sampler import Sampler, SamplingRow
from qwenserve.engine.sampling_params import SamplingParams
from tests.support.engine_checkpoints import random_prompts

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)


def tokens_of(outputs) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def test_logprobs_match_log_softmax_of_reference_logits(make_engine, reference):
    name = "qwen3_untied"
    engine = make_engine(name)
    prompts = random_prompts(3, 4, 30, seed=11)
    sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=5)
    for prompt, outs in zip(prompts, engine.generate_sync_outputs(prompts, sampling), strict=True):
        ref_tokens, ref_logits = reference(name, prompt, 8)
        ref_lp = torch.log_softmax(ref_logits, dim=-1)
        lps = [lp for o in outs for lp in o.logprobs]
        assert [lp.token_id for lp in lps] == ref_tokens
        for step, lp in enumerate(lps):
            assert lp.logprob == pytest.approx(ref_lp[step, lp.token_id].item(), abs=1e-4)
            top_values, top_ids = ref_lp[step].topk(5)
            assert [t for t, _ in lp.top] == top_ids.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top_values.tolist(), abs=1e-4)


def test_seeded_sampling_is_reproducible_across_runs_and_batch_compositions(make_engine):
    engine = make_engine("qwen3_gqa4")
    prompt = random_prompts(1, 20, 20, seed=12)[0]
    alone = engine.generate_sync([prompt], SEEDED)[0]
    again = engine.generate_sync([prompt], SEEDED)[0]
    crowd = random_prompts(5, 3, 40, seed=13)
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = engine.generate_sync([*crowd[:2], prompt, *crowd[2:]], [unseeded, SEEDED, SEEDED, unseeded, SEEDED, unseeded])
    assert alone == again == mixed[2]
    other_seed = engine.generate_sync([prompt], SamplingParams(**{**_fields(SEEDED), "seed": 99}))[0]
    assert other_seed != alone  # the seed matters (12 draws from a wide distribution)


def test_resumed_request_continues_identically(make_engine):
    engine = make_engine("qwen3_moe")
    prompt = random_prompts(1, 25, 25, seed=14)[0]
    full = engine.generate_sync([prompt], SEEDED)[0]
    resumed = engine.generate_sync_outputs([prompt], SEEDED, resume_token_ids=full[:5])[0]
    assert full[:5] + tokens_of(resumed) == full
    assert resumed[-1].usage.completion_tokens == 12 and resumed[-1].finish_reason == "length"


def test_penalties_and_min_tokens_and_stop_ids(make_engine, reference):
    engine = make_engine("qwen2_bias")
    prompt = random_prompts(1, 10, 10, seed=15)[0]
    plain = reference("qwen2_bias", prompt, 10)[0]
    # Stop on the 4th greedy token: output ends with it, reason "stop".
    stop = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(plain[3],), ignore_eos=True)
    outs = engine.generate_sync_outputs([prompt], stop)[0]
    assert tokens_of(outs) == plain[: plain.index(plain[3]) + 1] and outs[-1].finish_reason == "stop"
    # min_tokens masks the stop id until 6 tokens exist.
    late = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=6, stop_token_ids=(plain[0],), ignore_eos=True)
    got = engine.generate_sync([prompt], late)[0]
    assert plain[0] not in got[:6] and len(got) >= 6
    # A huge repetition penalty forbids every prompt and earlier output token under greedy decoding.
    rep = SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1e6, ignore_eos=True)
    got = engine.generate_sync([prompt], rep)[0]
    for i, t in enumerate(got):
        assert t not in prompt and t not in got[:i]


def test_sampler_filters_restrict_the_support():
    sampler = Sampler(seed=0)
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(200, 1)
    def draw(**kw) -> set[int]:
        rows = [SamplingRow(SamplingParams(temperature=1.0, **kw), [], [0] * i) for i in range(200)]
        return set(sampler(logits, rows)[0])
    assert draw(top_k=2) == {0, 1}
    # softmax: 0.64, 0.23, 0.09, ... -> nucleus 0.8 keeps the first two
    assert draw(top_p=0.8) == {0, 1}
    assert draw(min_p=0.3) == {0, 1}
    assert draw(top_k=1) == {0}
    assert len(draw()) >= 4
    # presence penalty on token 0 (already generated) moves greedy to token 1
    row = SamplingRow(SamplingParams(temperature=0.0, presence_penalty=2.0), [], [0])
    assert sampler(logits[:1], [row])[0] == [1]


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__slots__}


def test_prompt_logprobs_match_transformers_across_chunks_and_skip_the_prefix_cache(make_engine, checkpoint):
    from tests.support.engine_checkpoints import load_reference

    name = "qwen3_untied"
    engine = make_engine(name, max_num_batched_tokens=16)  # a 61-token prompt takes four chunks
    prompt, other = random_prompts(2, 61, 61, seed=21)
    with torch.inference_mode():
        ref = torch.log_softmax(load_reference(checkpoint(name))(torch.tensor([prompt])).logits[0], dim=-1)
    scored = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for _ in range(2):  # the second time every full block of the prompt is in the prefix cache
        outs, _unscored = engine.generate_sync_outputs([prompt, other], [scored, plain])
        firsts = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
        assert len(firsts) == 1 and outs[0].prompt_logprobs is firsts[0]  # once, with the first token
        entries = firsts[0]
        assert [e.token_id for e in entries] == prompt[1:]
        for position, entry in enumerate(entries):
            row = ref[position]
            assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
            assert entry.rank == int((row > row[entry.token_id]).sum()) + 1
            assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
        assert outs[-1].usage.cached_prompt_tokens == 0


def test_prompt_logprobs_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
