"""A checkpoint's `config.json`, read the same way by every stage: the router and tokenizer for the limits they
enforce, the engine (models/config.py) for the model's shape.

A multimodal checkpoint (Qwen3.5 as Qwen ships it: Qwen3_5ForConditionalGeneration) keeps its language model's
keys, max_position_embeddings and vocab_size among them, in `text_config`; a text-only one keeps them at the top
level. `language_model_config` gives the language model's keys either way. Imports neither torch nor grpc.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# transformers' default for Qwen configs that leave it out, and what the engine then serves at most.
DEFAULT_MAX_POSITION_EMBEDDINGS = 32768
# Keys of a multimodal config's top level that speak for its language model too (a quantized checkpoint's
# quantization_config covers its language model's linears).
_SHARED_KEYS = ("eos_token_id", "tie_word_embeddings", "quantization_config")


def read_config_json(folder: str | Path) -> dict[str, Any]:
    """The parsed `config.json` of a checkpoint folder; FileNotFoundError names the file when there is none."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a checkpoint folder needs a config.json")
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds {type(config).__name__}, not a JSON object")
    return config


def is_multimodal(config: dict[str, Any]) -> bool:
    """Whether the language model's keys are in `text_config` (a multimodal checkpoint's layout)."""
    return isinstance(config.get("text_config"), dict)


def language_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's keys: `text_config` with the top level's model_type, eos and tied embeddings when the
    checkpoint is multimodal, else the config itself."""
    if not is_multimodal(config):
        return config
    outer = {k: config[k] for k in _SHARED_KEYS if k in config}
    return {**config["text_config"], **outer, "model_type": config.get("model_type", "")}


@dataclass(frozen=True, slots=True)
class CheckpointLimits:
    """What every stage needs to know of a model before it serves it."""

    max_position_embeddings: int  # the longest sequence (prompt and output) the model's positions cover
    vocab_size: int | None  # the model's (padded) vocabulary; None when config.json does not say


def checkpoint_limits(folder: str | Path) -> CheckpointLimits:
    """The limits of the checkpoint in `folder`, from its language model's config."""
    config = language_model_config(read_config_json(folder))
    vocab = config.get("vocab_size")
    return CheckpointLimits(
        max_position_embeddings=int(config.get("max_position_embeddings") or DEFAULT_MAX_POSITION_EMBEDDINGS),
        vocab_size=int(vocab) if vocab else None,
    )


# config.json keys that decide what the model computes and the shape of its KV, not how its weights are stored: a
# model's bf16 checkpoint and its AWQ / GPTQ / FP8 copies agree on all of them.
ARCHITECTURE_KEYS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "max_position_embeddings", "tie_word_embeddings", "attention_bias", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "layer_types",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "attn_output_gate", "partial_rotary_factor", "shared_expert_intermediate_size",
    "sliding_window", "use_sliding_window", "max_window_layers",
)


def architecture_differences(folder: str | Path, other: str | Path) -> list[str]:
    """`key: a vs b` for each architecture key whose value differs between two checkpoints' language models (empty
    when one model's KV could be continued by the other's weights). The engines' fingerprints decide at each
    handoff; this is the early, readable check."""
    mine, theirs = (language_model_config(read_config_json(f)) for f in (folder, other))
    return [f"{key}: {mine.get(key)!r} vs {theirs.get(key)!r}" for key in ARCHITECTURE_KEYS
            if mine.get(key) != theirs.get(key)]
