"""The model's shape, read from a Hugging Face `config.json` as written by transformers 4.x or 5.x."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qwenserve.checkpoint_config import (
    DEFAULT_MAX_POSITION_EMBEDDINGS,
    is_multimodal,
    language_model_config,
    read_config_json,
)

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe")
# model_type as transformers writes it -> the family we serve: a text-only Qwen3.5 checkpoint says "qwen3_5_text".
MODEL_TYPE_ALIASES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
# Hybrid families: Gated DeltaNet (linear attention) layers with a gated full-attention layer every few layers.
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


class UnsupportedModelError(ValueError):
    """The checkpoint's `config.json` describes a model this engine cannot run."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding settings: `scaling_type` is "default", "linear" or "yarn"."""

    theta: float = 10000.0
    scaling_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the model code needs to know about a Qwen checkpoint, normalised across config versions."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope: RopeConfig
    # Mixture of experts (Qwen3-MoE); num_experts 0 means a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    # Hybrid models (Qwen3-Next, Qwen3.5): "linear_attention" or "full_attention" per layer; () means all full.
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    attn_output_gate: bool = False  # q_proj also yields a per-channel sigmoid gate on the attention output
    partial_rotary_factor: float = 1.0  # rope rotates only this leading fraction of each head
    zero_centered_norm: bool = False  # RMSNorm weights are stored as w, applied as (1 + w)
    shared_expert_intermediate_size: int = 0  # MoE with an always-on shared expert behind a sigmoid gate
    # Where the decoder's tensors live in the checkpoint: "model." or, in a multimodal checkpoint served as
    # text-only, "model.language_model.".
    weight_prefix: str = "model."
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_hybrid(self) -> bool:
        """Some layers are linear attention: they keep a per-sequence state instead of KV."""
        return "linear_attention" in self.layer_types

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep KV in the paged cache (the full-attention ones), in order."""
        if not self.layer_types:
            return tuple(range(self.num_layers))
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The linear-attention layers, in order (their index here is their slot in the state tensors)."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "linear_attention")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` uses the sparse expert MLP (same rule as transformers)."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Normalise a config dict: 4.x keys (`rope_theta`, `rope_scaling`, `num_experts`) and 5.x keys
        (`rope_parameters`, `num_local_experts`) give the same result."""
        model_type = cfg.get("model_type", "")
        weight_prefix = "model."
        if model_type in HYBRID_MODEL_TYPES and is_multimodal(cfg):
            # A multimodal checkpoint (Qwen3_5ForConditionalGeneration): its language model, served text-only.
            cfg = language_model_config(cfg)
            weight_prefix = "model.language_model."
        model_type = MODEL_TYPE_ALIASES.get(model_type, model_type)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; expected one of {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if cfg.get("use_sliding_window"):
            raise UnsupportedModelError("use_sliding_window=true is not supported; set it to false in config.json")
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        hybrid = model_type in HYBRID_MODEL_TYPES
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size", 0)),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or DEFAULT_MAX_POSITION_EMBEDDINGS),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Qwen3 has them only when the config says so.
            attention_bias=True if model_type == "qwen2" else bool(cfg.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe") or hybrid,
            rope=_parse_rope(cfg),
            num_experts=num_experts if model_type in ("qwen3_moe", "qwen3_next", "qwen3_5_moe") else 0,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0)),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0)),
            # Qwen3.5-MoE's router always renormalises its top-k (its config has no such key).
            norm_topk_prob=model_type == "qwen3_5_moe" or bool(cfg.get("norm_topk_prob", hybrid)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
            eos_token_ids=eos_ids,
            weight_prefix=weight_prefix,
            raw=cfg,
            **(_hybrid_fields(cfg) if hybrid else {}),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` (and the EOS ids of `generation_config.json` when present) from a checkpoint folder."""
        folder = Path(path)
        cfg = read_config_json(folder)
        gen_file = folder / "generation_config.json"
        if gen_file.is_file():
            gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
            ids = gen_eos if isinstance(gen_eos, list) else ([] if gen_eos is None else [gen_eos])
            own = cfg.get("eos_token_id")
            own = own if isinstance(own, list) else ([] if own is None else [own])
            cfg = {**cfg, "eos_token_id": list(dict.fromkeys([*own, *ids]))}
        return cls.from_dict(cfg)


def _hybrid_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields only Qwen3-Next / Qwen3.5 configs have, with transformers' defaults where a key is absent."""
    layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types")
    if not layer_types:
        interval = int(cfg.get("full_attention_interval") or 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if len(layer_types) != layers or set(layer_types) - {"linear_attention", "full_attention"}:
        raise UnsupportedModelError(
            f"layer_types must name linear_attention or full_attention for each of the {layers} layers")
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    return dict(
        layer_types=tuple(layer_types),
        linear_num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
        # transformers always gates these models' attention output; configs that say so say true.
        attn_output_gate=bool(cfg.get("attn_output_gate", True)),
        # transformers' default for these configs when neither place names it.
        partial_rotary_factor=float(partial or cfg.get("partial_rotary_factor") or 0.25),
        zero_centered_norm=True,
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
    )


def _parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if params and not isinstance(params, dict):
        raise UnsupportedModelError("rope_parameters / rope_scaling must be an object")
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ("default", "linear", "yarn"):
        raise UnsupportedModelError(f"rope type {kind!r} is not supported; use default, linear or yarn")
    if kind == "default":
        return RopeConfig(theta=theta)
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None and kind == "yarn" and original:
        factor = cfg.get("max_position_embeddings", 32768) / original
    return RopeConfig(
        theta=theta,
        scaling_type=kind,
        factor=float(factor if factor is not None else 1.0),
        original_max_position_embeddings=int(original or cfg.get("max_position_embeddings", 32768)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )
