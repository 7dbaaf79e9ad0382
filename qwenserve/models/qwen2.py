"""Qwen2 / Qwen2.5: the Qwen3 block without q/k norm and with q/k/v biases (ModelConfig sets both)."""

from __future__ import annotations

from qwenserve.models.qwen3 import QwenForCausalLM


class Qwen2ForCausalLM(QwenForCausalLM):
    """Qwen2 / Qwen2.5 dense decoder; the differences from Qwen3 are flags of ModelConfig."""
