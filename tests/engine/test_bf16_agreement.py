"""The bf16 path (`--dtype auto` where the probe finds the bf16 panels faster) against transformers in bf16 on the CPU,
on a tiny model and on one of Qwen3-0.6B's shape (its width, heads and vocabulary; two layers, to keep it short).

The reference's top-1 at each position, and its lead over the top-2, come from transformers' bf16 hidden states
through the LM head in fp32, so a lead is not rounded to bf16's coarse steps. Teacher-forced: after every prefix of
the reference's greedy continuation, our next token is its top-1 wherever that lead is clear, and at 90% of all
positions. Random weights give nearly flat logits, where bf16's rounding decides the order of near ties: transformers'
own cached decode and its full forward pass disagree at about 2% of these positions. Free-running: our greedy
continuation is the reference's up to its first position that is not clear."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qwenserve.cpu_kernels import linear_probe, loader
from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.sampling_params import SamplingParams
from tests.engine.test_precision import probe_result
from tests.support.engine_checkpoints import write_checkpoint

# A lead of at least this many nats (logits of the top-1 over the top-2) is clear: bf16's rounding must not flip it.
# These random models' logits reach 30-60, where one bf16 step of a hidden value moves a logit by ~0.2; transformers'
# own two bf16 paths flip leads of 0.25.
CLEAR_MARGIN = 0.5
# Qwen3-0.6B's shape with two of its 28 layers.
QWEN3_06B_SHAPE = dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True)


def reference_bf16(folder: Path, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[list[int]],
                                                                            list[list[float]]]:
    """transformers in bf16: each prompt's greedy continuation of `n` tokens, and at each of its positions the top-1
    and its lead over the top-2 from one forward pass over prompt + continuation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    head = model.lm_head.weight.float()
    continuations, top1, leads = [], [], []
    with torch.inference_mode():
        for prompt in prompts:
            sequence = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                      max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                                      eos_token_id=None)
            continuations.append(sequence[0, len(prompt):].tolist())
            hidden = model.model(sequence).last_hidden_state[0, len(prompt) - 1 : len(prompt) + n - 1]
            best = (hidden.float() @ head.T).topk(2)
            top1.append(best.indices[:, 0].tolist())
            leads.append((best.values[:, 0] - best.values[:, 1]).tolist())
    return continuations, top1, leads


@pytest.fixture(scope="module")
def qwen3_06b_shape(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("qwen3-0.6b-shape"), QWEN3_06B_SHAPE)


@pytest.mark.parametrize("name", ["qwen3_gqa4", "qwen3_06b_shape"])
def test_the_bf16_engine_agrees_with_transformers_bf16(name: str, checkpoint, qwen3_06b_shape: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    kernels = loader.load()
    if kernels is None:
        pytest.skip("no CPU kernels here: auto is fp32")
    # As on a CPU with AMX: bf16 panels faster than fp32's, PyTorch's bf16 product from 4 rows, so both products run.
    monkeypatch.setattr(linear_probe, "measure", lambda *args: probe_result(2.0, 4))
    folder = qwen3_06b_shape if name == "qwen3_06b_shape" else checkpoint(name)
    prompts = [[(13 * i + 5 * j) % 997 + 2 for j in range(5 + 23 * i)] for i in range(3)]
    n = 16
    continuations, top1, leads = reference_bf16(folder, prompts, n)
    engine = LLMEngine.from_pretrained(folder, EngineConfig(device="cpu", block_size=4, num_kv_blocks=1024,
                                                            num_threads=2))
    try:
        assert engine.precision.labels() == {"activations": "bfloat16", "weights": "bfloat16", "kv": "bfloat16"}
        prefixes = [prompt + tokens[:j] for prompt, tokens in zip(prompts, continuations, strict=True)
                    for j in range(n)]
        nexts = engine.generate_sync(prefixes, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        free = engine.generate_sync(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    finally:
        engine.shutdown()
    pairs = [(token == nexts[i * n + j][0], leads[i][j]) for i in range(len(prompts)) for j, token in enumerate(top1[i])]
    flipped = [lead for same, lead in pairs if not same]
    assert all(lead < CLEAR_MARGIN for lead in flipped), f"clear positions flipped: {flipped}"
    assert sum(lead >= CLEAR_MARGIN for _, lead in pairs) >= len(pairs) // 2, "too few clear positions to test"
    assert len(pairs) - len(flipped) >= 0.9 * len(pairs), f"top-1 agreement {len(pairs) - len(flipped)}/{len(pairs)}"
    for i, tokens in enumerate(continuations):
        clear = next((j for j in range(n) if leads[i][j] < CLEAR_MARGIN or top1[i][j] != tokens[j]), n)
        assert free[i][:clear] == tokens[:clear], f"prompt {i}: greedy continuations part before position {clear}"
