"""Greedy tokens equal transformers' for every model family, under every scheduling condition."""

from __future__ import annotations

import asyncio
import json

import pytest

from qwenserve.engine.sampling_params import SamplingParams
from tests.support.engine_checkpoints import random_prompts

FAMILIES = ["qwen3_gqa4", "qwen3_untied", "qwen2_bias", "qwen3_moe"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def expected_tokens(reference, name: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    return [reference(name, p, n)[0] for p in prompts]


@pytest.mark.parametrize("name", FAMILIES)
async def test_concurrent_requests_arriving_at_different_steps_match_transformers(name, make_engine, reference):
    engine = make_engine(name)
    prompts = random_prompts(6, 3, 60, seed=1)
    expected = expected_tokens(reference, name, prompts, 10)

    async def run(i: int, delay_tokens_of: asyncio.Event | None) -> list[int]:
        if delay_tokens_of is not None:
            await delay_tokens_of.wait()
        tokens: list[int] = []
        async for out in engine.generate(f"r{i}", prompts[i], GREEDY):
            tokens += out.new_token_ids
            if i == 0 and len(tokens) >= 3:
                started.set()  # later requests join a batch that is already decoding
        return tokens

    started = asyncio.Event()
    got = await asyncio.gather(*(run(i, started if i >= 3 else None) for i in range(6)))
    assert got == expected


@pytest.mark.parametrize("name", FAMILIES)
def test_chunked_prefill_under_small_token_budget_matches_transformers(name, make_engine, reference):
    engine = make_engine(name, max_num_batched_tokens=16)
    prompts = random_prompts(4, 20, 70, seed=2)
    assert engine.generate_sync(prompts, GREEDY) == expected_tokens(reference, name, prompts, 10)


@pytest.mark.parametrize("name", ["qwen3_gqa4", "qwen3_moe"])
def test_preempted_requests_resume_with_identical_tokens(name, make_engine, reference):
    # 12 blocks of 8 tokens: each request needs up to 5 blocks, so four cannot run together.
    engine = make_engine(name, num_kv_blocks=12, block_size=8, admission_watermark=0.0)
    prompts = random_prompts(4, 14, 20, seed=3)
    sampling = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert engine.generate_sync(prompts, sampling) == expected_tokens(reference, name, prompts, 16)
    assert engine.stats().preemptions > 0


def test_shared_prefixes_hit_the_cache_and_report_the_hit_rate(make_engine, reference):
    name = "qwen3_untied"
    engine = make_engine(name, block_size=8)
    prefix = random_prompts(1, 40, 40, seed=4)[0]
    tails = random_prompts(3, 5, 9, seed=5)
    first = prefix + tails[0]
    assert engine.generate_sync([first], GREEDY) == expected_tokens(reference, name, [first], 10)
    queried_before = engine.stats().prefix_cache_query_tokens
    others = [prefix + t for t in tails[1:]]
    outs = engine.generate_sync_outputs(others, GREEDY)
    assert [[t for o in r for t in o.new_token_ids] for r in outs] == expected_tokens(reference, name, others, 10)
    # 40 shared tokens = 5 full blocks of 8, hit by each later request.
    assert [r[-1].usage.cached_prompt_tokens for r in outs] == [40, 40]
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens == 80
    assert stats.prefix_cache_query_tokens == queried_before + sum(len(p) for p in others)
    assert stats.prefix_cache_hit_rate == pytest.approx(80 / stats.prefix_cache_query_tokens)


def test_identical_prompt_reuses_all_but_its_last_token(make_engine, reference):
    name = "qwen2_bias"
    engine = make_engine(name, block_size=8)
    prompt = random_prompts(1, 32, 32, seed=6)[0]
    expected = expected_tokens(reference, name, [prompt], 10)
    assert engine.generate_sync([prompt], GREEDY) == expected
    again = engine.generate_sync_outputs([prompt], GREEDY)[0]
    assert [t for o in again for t in o.new_token_ids] == expected[0]
    # The last prompt token is always recomputed, so of 4 full blocks only 3 can be reused.
    assert again[-1].usage.cached_prompt_tokens == 24


def test_cache_salt_isolates_tenants(make_engine):
    engine = make_engine("qwen3_gqa4", block_size=8)
    prompt = random_prompts(1, 33, 33, seed=7)[0]
    engine.generate_sync([prompt], GREEDY, cache_salt="tenant-a")
    other = engine.generate_sync_outputs([prompt], GREEDY, cache_salt="tenant-b")[0]
    same = engine.generate_sync_outputs([prompt], GREEDY, cache_salt="tenant-a")[0]
    assert other[-1].usage.cached_prompt_tokens == 0
    assert same[-1].usage.cached_prompt_tokens == 32


@pytest.mark.parametrize("name", ["qwen2_linear_4x", "qwen3_yarn_4x", "qwen3_moe_4x"])
def test_transformers_4x_configs_with_rope_scaling_match(name, make_engine, reference):
    engine = make_engine(name)
    prompts = random_prompts(3, 5, 150, seed=8)
    assert engine.generate_sync(prompts, GREEDY) == expected_tokens(reference, name, prompts, 10)


@pytest.mark.parametrize("name", ["qwen3_yarn_5x", "qwen2_linear_5x"])
def test_transformers_5x_rope_parameters_match(name, checkpoint, make_engine, reference):
    config = json.loads((checkpoint(name) / "config.json").read_text())
    assert "rope_parameters" in config and "rope_scaling" not in config  # written by the installed 5.x
    engine = make_engine(name)
    prompts = random_prompts(3, 5, 200, seed=11)  # past original_max_position_embeddings (128)
    assert engine.generate_sync(prompts, GREEDY) == expected_tokens(reference, name, prompts, 10)


def test_fcfs_policy_gives_the_same_tokens(make_engine, reference):
    name = "qwen3_gqa4"
    engine = make_engine(name, admission_policy="fcfs", max_num_batched_tokens=32)
    prompts = random_prompts(5, 3, 50, seed=9)
    assert engine.generate_sync(prompts, GREEDY) == expected_tokens(reference, name, prompts, 10)
