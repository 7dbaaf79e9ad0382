"""Model families the engine runs, one file each; `model_class` maps a config to its implementation."""

from __future__ import annotations

from qwenserve.models.config import ModelConfig, RopeConfig, UnsupportedModelError
from qwenserve.models.qwen2 import Qwen2ForCausalLM
from qwenserve.models.qwen3 import Qwen3ForCausalLM, QwenForCausalLM
from qwenserve.models.qwen3_moe import Qwen3MoeForCausalLM
from qwenserve.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3NextForCausalLM

MODEL_CLASSES: dict[str, type[QwenForCausalLM]] = {
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    "qwen3_5": Qwen3_5ForCausalLM,
    "qwen3_5_moe": Qwen3_5ForCausalLM,
}

__all__ = ["MODEL_CLASSES", "ModelConfig", "QwenForCausalLM", "RopeConfig", "UnsupportedModelError", "model_class"]


def model_class(cfg: ModelConfig) -> type[QwenForCausalLM]:
    """The implementation for `cfg.model_type`."""
    try:
        return MODEL_CLASSES[cfg.model_type]
    except KeyError:
        raise UnsupportedModelError(f"no implementation for model_type {cfg.model_type!r}") from None
