"""Tiny random Qwen checkpoints written to disk, and transformers' greedy reference for them."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

# Shapes the engine tests run on: small enough for 2 CPU cores, varied enough to catch layout bugs.
SPECS: dict[str, dict[str, Any]] = {
    # GQA ratio 4 and head_dim (32) != hidden / heads (16); tied embeddings. A vocabulary of 1024 rows (a
    # multiple of 16) packs the tied LM head for the CPU kernels, the embeddings then read from the panels;
    # the families below keep 1000 rows, so their LM heads take the unpacked path.
    "qwen3_gqa4": dict(
        model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, vocab_size=1024, tie_word_embeddings=True,
    ),
    # Three layers, GQA ratio 3, untied LM head.
    "qwen3_untied": dict(
        model_type="qwen3", hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, head_dim=16, vocab_size=1000, tie_word_embeddings=False,
    ),
    # Qwen2: q/k/v biases, no q/k norm.
    "qwen2_bias": dict(
        model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False,
    ),
    # The same shapes with rope scaling as transformers 5.x writes it (`rope_parameters`, theta inside).
    "qwen3_yarn_5x": dict(
        model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, vocab_size=1000, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                         "rope_theta": 1000000.0},
    ),
    "qwen2_linear_5x": dict(
        model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
    ),
    # Qwen3-MoE: 8 experts top-2, renormalised; layer 1 dense (mlp_only_layers), layers 0 and 2 sparse.
    "qwen3_moe": dict(
        model_type="qwen3_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1000,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
        tie_word_embeddings=False,
    ),
}

# Hybrid linear-attention families (Gated DeltaNet layers + gated full attention), 4 layers each. Two value heads
# per key head; rope on a quarter of each head (the configs' default partial_rotary_factor).
_HYBRID = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=1000, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, tie_word_embeddings=False,
)
_HYBRID_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
SPECS.update({
    # Qwen3-Next: full attention every 2nd layer, MoE with a shared expert except on layer 2 (mlp_only_layers).
    "qwen3_next": dict(model_type="qwen3_next", full_attention_interval=2, mlp_only_layers=[2], **_HYBRID,
                       **_HYBRID_MOE),
    # Qwen3.5 (text): dense MLP, full attention on the 4th layer only.
    "qwen3_5": dict(model_type="qwen3_5_text", full_attention_interval=4, **_HYBRID),
    # Qwen3.5-MoE (text): every layer MoE with a shared expert, full attention every 2nd layer.
    "qwen3_5_moe": dict(model_type="qwen3_5_moe_text", full_attention_interval=2, **_HYBRID, **_HYBRID_MOE),
})


def _hf_config(spec: dict[str, Any]) -> Any:
    from transformers import Qwen2Config, Qwen3Config, Qwen3MoeConfig, Qwen3NextConfig
    from transformers.models.qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig, "qwen3_next": Qwen3NextConfig,
           "qwen3_5_text": Qwen3_5TextConfig, "qwen3_5_moe_text": Qwen3_5MoeTextConfig}[spec["model_type"]]
    kwargs = {k: v for k, v in spec.items() if k != "model_type"}
    return cls(max_position_embeddings=512, rms_norm_eps=1e-6, **kwargs)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with unit-scale activations, so logits are well separated and greedy ties do not occur."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(2.0 * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def write_checkpoint(folder: Path, spec: dict[str, Any], seed: int = 0, config_override: dict | None = None) -> Path:
    """Save a random model with transformers' save_pretrained; `config_override` replaces config.json
    with a hand-written one (e.g. 4.x style) describing the same weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_hf_config(spec))
    randomize(model, seed)
    model.save_pretrained(folder)
    if config_override is not None:
        (folder / "config.json").write_text(json.dumps(config_override, indent=2))
    return folder


def load_reference(folder: Path) -> Any:
    """The same checkpoint through transformers, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def reference_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the logits behind each ([max_new_tokens, vocab])."""
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, torch.cat(out.logits, dim=0).float()


def random_prompts(count: int, low: int, high: int, seed: int, vocab: int = 1000) -> list[list[int]]:
    """`count` prompts of random ids with lengths uniform in [low, high]."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]
