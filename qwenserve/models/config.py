"""The model's shape, read from a Hugging Face `config.json` as written by transformers 4.x or 5.x."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe")


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
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

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
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Qwen3 has them only when the config says so.
            attention_bias=True if model_type == "qwen2" else bool(cfg.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            rope=_parse_rope(cfg),
            num_experts=num_experts if model_type == "qwen3_moe" else 0,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0)),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
            eos_token_ids=eos_ids,
            raw=cfg,
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` (and the EOS ids of `generation_config.json` when present) from a checkpoint folder."""
        folder = Path(path)
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} not found: a checkpoint folder needs a config.json")
        cfg = json.loads(config_file.read_text())
        gen_file = folder / "generation_config.json"
        if gen_file.is_file():
            gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
            ids = gen_eos if isinstance(gen_eos, list) else ([] if gen_eos is None else [gen_eos])
            own = cfg.get("eos_token_id")
            own = own if isinstance(own, list) else ([] if own is None else [own])
            cfg = {**cfg, "eos_token_id": list(dict.fromkeys([*own, *ids]))}
        return cls.from_dict(cfg)


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
