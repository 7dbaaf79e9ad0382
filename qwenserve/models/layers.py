"""Layers shared by the Qwen families: RMSNorm, rotary embeddings (default / linear / YaRN), SwiGLU MLP."""

from __future__ import annotations

import math

import torch
from torch import nn

from qwenserve.models.config import RopeConfig
from qwenserve.models.ops import TORCH_OPS, Ops


class RMSNorm(nn.Module):
    """Root-mean-square norm (torch_forms.rms_norm, or `ops.rms_norm`), computed in fp32 like the reference so
    low-precision runs match it. `zero_centered` (Qwen3-Next, Qwen3.5): the checkpoint stores w and the scale is
    (1 + w), applied in fp32."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32, zero_centered: bool = False,
                 ops: Ops | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.zero_centered = zero_centered
        self.norm = (ops or TORCH_OPS).rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise over the last dimension."""
        return self.norm(x, self.weight, self.eps, self.zero_centered)


def rope_inverse_frequencies(head_dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale for a rope configuration (YaRN as in the YaRN paper)."""
    base = rope.theta
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    pos_freqs = base**exponents
    if rope.scaling_type == "default":
        return 1.0 / pos_freqs, 1.0
    if rope.scaling_type == "linear":
        return 1.0 / pos_freqs / rope.factor, 1.0
    factor = rope.factor

    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale_of(factor, rope.mscale) / mscale_of(factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale_of(factor)
    original = rope.original_max_position_embeddings or 4096

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position, shared by every layer."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq, scale = rope_inverse_frequencies(head_dim, rope)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", (angles.cos() * scale).to(dtype), persistent=False)
        self.register_buffer("sin", (angles.sin() * scale).to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for `positions`, shaped [num_tokens, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matrix at load time."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(2 * intermediate, hidden, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(hidden, intermediate, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to [num_tokens, hidden]."""
        return self.ops.linear(self.ops.silu_mul(self.ops.linear(x, self.gate_up_proj), self.intermediate),
                               self.down_proj)

    def checkpoint_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> the view of our fused parameter it fills."""
        i = self.intermediate
        return {
            f"{prefix}.gate_proj.weight": self.gate_up_proj.data[:i],
            f"{prefix}.up_proj.weight": self.gate_up_proj.data[i:],
            f"{prefix}.down_proj.weight": self.down_proj.data,
        }
