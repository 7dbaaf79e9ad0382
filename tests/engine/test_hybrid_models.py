"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): greedy tokens equal transformers' across
chunked prefill, batching, preemption and state-slot reuse, and resuming a cached prefix from a kept state. The
handoff between engines is tests/engine/test_hybrid_handoff.py's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.models import ModelConfig
from qwenserve.models.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_step
from qwenserve.models.ops import TORCH_OPS
from tests.support.engine_checkpoints import random_prompts

HYBRIDS = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# Up to 150 tokens: longer than any prefill chunk below, and than one chunk (64) of the chunked delta rule.
PROMPTS = random_prompts(4, 5, 150, seed=21)


def expected_tokens(reference, name: str, prompts: list[list[int]], n: int = 10) -> list[list[int]]:
    return [reference(name, p, n)[0] for p in prompts]


def assert_state_slots_released(engine) -> None:
    assert engine.wait_until_idle(timeout=30)
    assert engine.states.num_free == engine.states.num_slots


@pytest.mark.parametrize("budget", [16, 100])
@pytest.mark.parametrize("name", HYBRIDS)
def test_batched_requests_of_different_lengths_match_transformers_across_prefill_chunks(
        name, budget, make_engine, reference):
    engine = make_engine(name, max_num_batched_tokens=budget)
    if engine.kernels.cpu is not None:  # the decode rows' recurrent update runs in the C kernel
        assert engine.runner.model.ops.gated_delta_step == engine.kernels.cpu.gated_delta_step
    assert engine.generate_sync(PROMPTS, GREEDY) == expected_tokens(reference, name, PROMPTS)
    assert_state_slots_released(engine)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_the_portable_recurrent_update_gives_the_same_tokens(name, make_engine, reference):
    engine = make_engine(name, cpu_kernel=False)
    assert engine.runner.model.ops is TORCH_OPS
    assert engine.generate_sync(PROMPTS, GREEDY) == expected_tokens(reference, name, PROMPTS)


async def test_requests_joining_a_decoding_batch_match_transformers(make_engine, reference):
    import asyncio

    name = "qwen3_next"
    engine = make_engine(name, max_num_batched_tokens=32)
    started = asyncio.Event()

    async def run(i: int) -> list[int]:
        if i >= 2:
            await started.wait()  # joins while the first requests decode: decodes and prefill chunks share steps
        tokens: list[int] = []
        async for out in engine.generate(f"r{i}", PROMPTS[i], GREEDY):
            tokens += out.new_token_ids
            if len(tokens) >= 3:
                started.set()
        return tokens

    assert await asyncio.gather(*(run(i) for i in range(4))) == expected_tokens(reference, name, PROMPTS)


@pytest.mark.parametrize("name", HYBRIDS)
def test_preempted_requests_resume_with_identical_tokens(name, make_engine, reference):
    # 12 blocks of 8 tokens: each request needs up to 5 blocks, so four cannot run together. A snapshot at every
    # block: a preempted request may resume from one of its own.
    engine = make_engine(name, num_kv_blocks=12, block_size=8, admission_watermark=0.0, max_num_batched_tokens=32,
                         state_snapshot_tokens=8)
    prompts = random_prompts(4, 14, 20, seed=3)
    sampling = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert engine.generate_sync(prompts, sampling) == expected_tokens(reference, name, prompts, 16)
    assert engine.stats().preemptions > 0
    assert_state_slots_released(engine)


def test_state_slots_bound_the_running_batch_and_are_reused(make_engine, reference):
    name = "qwen3_5"
    engine = make_engine(name, max_num_seqs=2)
    assert engine.states.num_slots == 2
    assert engine.generate_sync(PROMPTS, GREEDY) == expected_tokens(reference, name, PROMPTS)
    assert_state_slots_released(engine)


def test_state_slots_take_at_most_half_the_memory_budget_and_then_bound_the_batch(make_engine, reference):
    name = "qwen3_5"
    probe = make_engine(name)
    per_slot = probe.runner.linear_state.nbytes // probe.states.num_slots
    budget = 5 * per_slot  # half of it holds two slots, not the eight --max-num-seqs asks for
    engine = make_engine(name, num_kv_blocks=None, kv_cache_memory_gb=budget / 2**30, max_num_seqs=8)
    assert engine.states.num_slots == 2
    kv_bytes = engine.runner.kv_cache.nbytes
    assert engine.runner.linear_state.nbytes + kv_bytes <= budget
    assert kv_bytes > budget - 2 * per_slot - kv_bytes / engine.pool.num_blocks  # the rest went to KV blocks
    short = random_prompts(3, 5, 30, seed=22)
    assert engine.generate_sync(short, GREEDY) == expected_tokens(reference, name, short)
    assert_state_slots_released(engine)


def test_one_token_prompt_starts_from_a_clean_state(make_engine, reference):
    name = "qwen3_5_moe"
    engine = make_engine(name)
    engine.generate_sync(PROMPTS[:2], GREEDY)  # leaves used slots behind
    assert engine.generate_sync([[7], [7, 8]], GREEDY) == expected_tokens(reference, name, [[7], [7, 8]])


def test_prefix_caching_is_off_without_snapshots_and_says_why(make_engine, reference, caplog):
    name = "qwen3_next"
    with caplog.at_level("INFO", logger="qwenserve.engine"):
        engine = make_engine(name, enable_prefix_caching=True, state_snapshot_tokens=0)
    assert "prefix caching is off for qwen3_next" in caplog.text and "--state-snapshot-tokens 0" in caplog.text
    assert engine.scheduler.snapshots is None
    prompt = PROMPTS[1]
    expected = expected_tokens(reference, name, [prompt])
    assert engine.generate_sync([prompt], GREEDY) == expected
    again = engine.generate_sync_outputs([prompt], GREEDY)[0]
    assert [t for o in again for t in o.new_token_ids] == expected[0]
    assert again[-1].usage.cached_prompt_tokens == 0
    assert engine.stats().prefix_cache_hit_tokens == 0


# A 100-token system prompt, then questions of different lengths.
SYSTEM = random_prompts(1, 100, 100, seed=41)[0]
QUESTIONS = [SYSTEM + q for q in random_prompts(3, 3, 40, seed=42)]


@pytest.mark.parametrize("name", HYBRIDS)
def test_a_shared_prefix_resumes_from_the_state_kept_at_its_last_boundary(name, make_engine, reference):
    # Snapshots every 32 tokens (4 blocks of 8): the 100-token prefix has boundaries at 32, 64 and 96.
    engine = make_engine(name, state_snapshot_tokens=32, max_num_batched_tokens=256)
    first = engine.generate_sync_outputs(QUESTIONS[:1], GREEDY)[0]
    assert first[-1].usage.cached_prompt_tokens == 0
    assert len(engine.scheduler.snapshots) >= 3
    later = engine.generate_sync_outputs(QUESTIONS[1:], GREEDY)
    assert [o[-1].usage.cached_prompt_tokens for o in later] == [96, 96]
    assert engine.scheduler.snapshots.restored == 2
    got = [[t for o in outs for t in o.new_token_ids] for outs in [first, *later]]
    assert got == expected_tokens(reference, name, QUESTIONS)
    assert_state_slots_released(engine)


def test_a_prefix_whose_snapshots_were_evicted_is_recomputed_exactly(make_engine, reference, monkeypatch):
    monkeypatch.setattr("qwenserve.engine.engine.MAX_STATE_SNAPSHOTS", 1)
    name = "qwen3_5"
    engine = make_engine(name, state_snapshot_tokens=32, max_num_batched_tokens=256)
    engine.generate_sync(QUESTIONS[:1], GREEDY)  # keeps only the last of its snapshots, at 96
    branch = SYSTEM[:70] + QUESTIONS[2][100:]  # its cached blocks reach 64, whose snapshot is gone
    outs = engine.generate_sync_outputs([branch], GREEDY)[0]
    assert outs[-1].usage.cached_prompt_tokens == 0
    assert [t for o in outs for t in o.new_token_ids] == expected_tokens(reference, name, [branch])[0]
    again = engine.generate_sync_outputs(QUESTIONS[1:2], GREEDY)[0]  # 96's snapshot was replaced by the branch's
    assert again[-1].usage.cached_prompt_tokens in (0, 32, 64)
    assert [t for o in again for t in o.new_token_ids] == expected_tokens(reference, name, QUESTIONS[1:2])[0]


def test_state_snapshots_are_reused_least_recently_used_first():
    from qwenserve.engine.state_snapshots import StateSnapshots
    from qwenserve.kv_layout import LinearState
    from qwenserve.models.linear_state import LinearStateCache

    storage = LinearStateCache(torch.zeros(1, 2, 3, 1), torch.zeros(1, 2, 1, 2, 2))

    def state(x: float) -> LinearState:
        return LinearState(torch.full((1, 3, 1), x), torch.full((1, 1, 2, 2), x))

    snapshots = StateSnapshots(storage, interval=16)
    snapshots.save(b"a", state(1.0))
    snapshots.save(b"b", state(2.0))
    assert float(snapshots.restore(b"a").recurrent[0, 0, 0, 0]) == 1.0  # now b is the least recently used
    snapshots.save(b"c", state(3.0))
    assert b"b" not in snapshots and b"a" in snapshots and b"c" in snapshots
    assert float(snapshots.restore(b"c").conv[0, 2, 0]) == 3.0 and float(snapshots.restore(b"a").conv[0, 0, 0]) == 1.0
    snapshots.save(b"a", state(9.0))  # already kept: not copied again
    assert float(snapshots.restore(b"a").conv[0, 0, 0]) == 1.0 and snapshots.saved == 3


def test_kv_cache_holds_only_the_full_attention_layers(make_engine):
    engine = make_engine("qwen3_5")  # full attention on 1 of 4 layers
    assert engine.runner.kv_cache.shape[0] == 1
    assert engine.kv_layout().num_layers == 1
    assert engine.runner.linear_state.recurrent.shape[:2] == (3, engine.states.num_slots)


def test_multimodal_checkpoint_serves_its_text_model_and_skips_vision_and_mtp(checkpoint, reference, tmp_path,
                                                                              caplog):
    """A Qwen3_5ForConditionalGeneration-style folder: text_config, the decoder under model.language_model., the
    vision encoder under model.visual. and multi-token-prediction weights under mtp. (both skipped)."""
    name = "qwen3_5"
    text = checkpoint(name)
    config = json.loads((text / "config.json").read_text())
    wrapped = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
               "text_config": {**config, "model_type": "qwen3_5_text"}, "vision_config": {"depth": 1},
               "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(wrapped))
    tensors = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
               for k, v in load_file(text / "model.safetensors").items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, tmp_path / "model.safetensors")
    assert ModelConfig.from_folder(tmp_path).weight_prefix == "model.language_model."
    with caplog.at_level("INFO", logger="qwenserve.engine"):
        engine = LLMEngine.from_pretrained(tmp_path, EngineConfig(num_kv_blocks=64, block_size=8, num_threads=2,
                                                                  dtype="float32"))
    try:
        assert "skipped 1 checkpoint tensors under model.visual." in caplog.text
        assert "skipped 1 checkpoint tensors under mtp." in caplog.text
        assert engine.generate_sync(PROMPTS[:2], GREEDY) == expected_tokens(reference, name, PROMPTS[:2])
    finally:
        engine.shutdown()


def test_config_reads_the_hybrid_fields():
    cfg = ModelConfig.from_dict({
        "model_type": "qwen3_next", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "rope_theta": 1e7,
        "partial_rotary_factor": 0.25, "num_experts": 4, "num_experts_per_tok": 2, "linear_num_key_heads": 1,
    })
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)  # full_attention_interval 4
    assert cfg.kv_layers == (3,) and cfg.linear_layers == (0, 1, 2) and cfg.is_hybrid
    assert cfg.partial_rotary_factor == 0.25 and cfg.attn_output_gate and cfg.zero_centered_norm
    assert cfg.norm_topk_prob and cfg.num_experts == 4
    assert ModelConfig.from_dict({**cfg.raw, "model_type": "qwen3_5_moe_text"}).model_type == "qwen3_5_moe"


def test_chunked_delta_rule_equals_the_token_by_token_rule():
    gen = torch.Generator().manual_seed(0)
    length, heads, dk, dv = 11, 3, 5, 4
    q, k = (torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(length, heads, dv, generator=gen)
    g = -torch.rand(length, heads, generator=gen)
    beta = torch.rand(length, heads, generator=gen)
    start = torch.randn(heads, dk, dv, generator=gen)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, start.clone(), chunk_size=4)
    states, slot = start.clone()[None], torch.tensor([0])
    stepwise = [recurrent_gated_delta_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1],
                                           beta[t : t + 1], states, slot)[0] for t in range(length)]
    torch.testing.assert_close(out, torch.stack(stepwise), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, states[0], rtol=1e-5, atol=1e-5)
