"""The PyTorch forms of the elementwise math around a layer's products: RMSNorm, the rotary embedding, the q/k
norms with it, and SwiGLU's activation. They are what transformers computes, op for op, so an fp32 model stays
token-exact with it; faster forms (models/ops.py: the C kernels' for bf16 models) are tested against these."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """Normalise over the last dimension in fp32, as the reference does, then scale by `weight` in x's dtype.
    `zero_centered` (Qwen3-Next, Qwen3.5): the checkpoint stores w and the scale is (1 + w), applied in fp32."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (x32 * (1.0 + weight.float())).to(dtype)
    return weight * x32.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [num_tokens, heads, head_dim] by the half-split convention Qwen checkpoints use (cos and sin come
    as [num_tokens, 1, rotary_dim]). A rotary_dim below head_dim (partial rotary) rotates the leading channels
    and passes the rest through."""
    rotary_dim = cos.shape[-1]
    if rotary_dim != x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 eps: float, zero_centered: bool, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """q [tokens, heads, dim] and k [tokens, kv_heads, dim] normalised per head (Qwen3's q/k norms; none where the
    weights are None), then rotated."""
    if q_weight is not None and k_weight is not None:
        q, k = rms_norm(q, q_weight, eps, zero_centered), rms_norm(k, k_weight, eps, zero_centered)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def silu_mul(gate_up: torch.Tensor, n: int) -> torch.Tensor:
    """silu(gate) * up, where the last dimension of gate_up is the n gate values, then the n up values."""
    gate, up = gate_up.split(n, dim=-1)
    return F.silu(gate) * up
