"""Layers shared by the Qwen families: linear products, RMSNorm, rotary embeddings (default / linear / YaRN),
SwiGLU MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from qwenserve import cpu_kernels, progress
from qwenserve.models.config import RopeConfig

# The weights pack_linear_weights packs: every matrix a token's hidden state is multiplied by.
PACKED_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear on a weight [n, k]; or on a weight packed by pack_linear_weights ([n/16, k, 16], a third
    dimension), through cpu_kernels.linear_packed. Unpacked fp32 on CPU (row counts not a multiple of 16) goes to
    cpu_kernels.linear_nt where the kernels load (here 1.3-2x the BLAS up to 64 rows, 0.75-1.05x at 512;
    QWENSERVE_CPU_KERNEL=0 gives the BLAS back). `out`, if given, is a buffer for a 2-D packed product (the
    logits: fresh memory of that size would be faulted in page by page at every step); other paths allocate."""
    if weight.dim() == 3:
        y = cpu_kernels.linear_packed(x.reshape(-1, x.shape[-1]).contiguous(), weight,
                                      out if x.dim() == 2 else None)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y.add_(bias)
    if (x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and weight.dtype == torch.float32
            and weight.is_contiguous() and cpu_kernels.available()):
        y = cpu_kernels.linear_nt(x.contiguous(), weight)
        return y if bias is None else y.add_(bias)
    return F.linear(x, weight, bias)


def pack_linear_weights(model: nn.Module) -> int:
    """Repack the model's linear weights in place for cpu_kernels.linear_packed (fp32 on CPU, output rows a
    multiple of 16; others stay as they are) and return how many were packed. Call it after the checkpoint is
    loaded: checkpoint_targets describes the unpacked layout."""
    params = [param for module in model.modules() for name in PACKED_WEIGHTS
              if (param := module._parameters.get(name)) is not None and cpu_kernels.packable(param.data)]
    with progress.step("packing weights for the CPU kernels", total=len(params), unit="matrices",
                       total_bytes=sum(param.data.nbytes for param in params)) as step:
        for param in params:
            param.data = cpu_kernels.pack_weight(param.data)
            step.advance(1, param.data.nbytes)
    return len(params)


def embedding_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an embedding table [vocab, hidden], or of a tied LM head packed by pack_linear_weights
    ([vocab/16, hidden, 16]: row v is column v % 16 of panel v // 16)."""
    if table.dim() == 3:
        return table[ids // table.shape[2], :, ids % table.shape[2]]
    return table[ids]


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 like the reference so low-precision runs match it."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise over the last dimension (fp32 on CPU through cpu_kernels.rms_norm where they load)."""
        if (x.dtype == torch.float32 and x.device.type == "cpu" and x.numel()
                and self.weight.dtype == torch.float32 and cpu_kernels.available()):
            return cpu_kernels.rms_norm(x.contiguous(), self.weight, self.eps)  # q/k arrive as strided views
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [num_tokens, heads, head_dim] by the half-split convention Qwen checkpoints use (fp32 on CPU in
    one pass through cpu_kernels.rotary where they load; cos and sin come as [num_tokens, 1, head_dim])."""
    if (x.dim() == 3 and x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(-1) == 1
            and cos.dtype == torch.float32 and cos.dim() == 3 and cos.is_contiguous() and sin.is_contiguous()
            and cpu_kernels.available()):
        return cpu_kernels.rotary(x, cos.squeeze(1), sin.squeeze(1))
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matrix at load time."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(2 * intermediate, hidden, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(hidden, intermediate, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to [num_tokens, hidden]."""
        gate_up = linear(x, self.gate_up_proj)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj)

    def checkpoint_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> the view of our fused parameter it fills."""
        i = self.intermediate
        return {
            f"{prefix}.gate_proj.weight": self.gate_up_proj.data[:i],
            f"{prefix}.up_proj.weight": self.gate_up_proj.data[i:],
            f"{prefix}.down_proj.weight": self.down_proj.data,
        }
