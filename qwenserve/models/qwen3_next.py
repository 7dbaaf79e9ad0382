"""Qwen3-Next and Qwen3.5 (dense and MoE): hybrid decoders of Gated DeltaNet layers and gated full attention.

Most layers are linear attention (Gated DeltaNet): a short causal convolution over the q/k/v projection, then the
gated delta rule, whose per-sequence recurrent matrix replaces a growing KV cache. Every few layers (the config's
layer_types) is full attention with a sigmoid output gate, on the paged KV cache as in Qwen3. Norms are
zero-centered (the scale is 1 + w), rope rotates only a leading fraction of each head, and the MoE layers add a
gated shared expert.

Tokens are flattened across sequences as in qwen3.py. The linear layers read each sequence's state slot from the
ForwardContext: decode rows (one token each) update all their states in one batched recurrent step (the ops table's:
a C kernel on CPUs, flash-linear-attention's on CUDA where installed); a prefill chunk runs the chunked form of the
delta rule (models/gated_delta.py) from its sequence's state and leaves the state of its last token, so the next
chunk carries on from there.

The two families differ in how the linear layers' input projections are stored: Qwen3-Next fuses them per key
head (in_proj_qkvz, in_proj_ba, grouped by key head), Qwen3.5 keeps four matrices (in_proj_qkv, _z, _b, _a).
Both are loaded into one matrix here, in the checkpoint's own row order, and taken apart after the product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qwenserve.models.config import ModelConfig
from qwenserve.models.forward_context import ForwardContext
from qwenserve.models.gated_delta import l2_normalize
from qwenserve.models.layers import RMSNorm, SwiGLUMLP
from qwenserve.models.linear_state import LinearAttentionBatch
from qwenserve.models.ops import Ops
from qwenserve.models.qwen3 import QwenAttention, QwenForCausalLM
from qwenserve.models.qwen3_moe import SparseMoeBlock


class GatedDeltaNet(nn.Module):
    """A linear-attention layer: projections, a depthwise causal convolution (kernel K, its last K-1 inputs kept
    per sequence), the gated delta rule over value heads (key heads shared by consecutive value heads), and a
    gated RMSNorm (silu of z) before the output projection. `linear_idx` is the layer's place in the state tensors."""

    def __init__(self, cfg: ModelConfig, linear_idx: int, dtype: torch.dtype, ops: Ops, grouped_projections: bool) -> None:
        super().__init__()
        self.ops = ops
        self.linear_idx = linear_idx
        self.grouped = grouped_projections
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        hidden = cfg.hidden_size
        rows = 2 * self.key_dim + 2 * self.value_dim + 2 * self.num_v_heads
        self.in_proj = nn.Parameter(torch.empty(rows, hidden, dtype=dtype), requires_grad=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.kernel, dtype=dtype), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype), requires_grad=False)
        self.norm = RMSNorm(self.head_v_dim, cfg.rms_norm_eps, dtype)  # plain weight: not zero-centered
        self.out_proj = nn.Parameter(torch.empty(hidden, self.value_dim, dtype=dtype), requires_grad=False)

    def _split_projection(self, p: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[n, rows] -> conv input [n, conv_dim] (q, k, v of all heads in turn), z [n, Hv, dv], b and a [n, Hv]."""
        n, kd, vd, nv = p.shape[0], self.key_dim, self.value_dim, self.num_v_heads
        if not self.grouped:
            qkv, z, b, a = p.split([2 * kd + vd, vd, nv, nv], dim=-1)
            return qkv, z.reshape(n, nv, self.head_v_dim), b, a
        # Qwen3-Next: per key head, [q, k, v of its value heads, z of its value heads], then per key head [b.., a..].
        per_group = nv // self.num_k_heads
        qkvz, ba = p.split([2 * kd + 2 * vd, 2 * nv], dim=-1)
        hk, group_v = self.head_k_dim, per_group * self.head_v_dim
        q, k, v, z = qkvz.reshape(n, self.num_k_heads, -1).split([hk, hk, group_v, group_v], dim=-1)
        b, a = ba.reshape(n, self.num_k_heads, 2 * per_group).split(per_group, dim=-1)
        qkv = torch.cat([q.reshape(n, kd), k.reshape(n, kd), v.reshape(n, vd)], dim=-1)
        return qkv, z.reshape(n, nv, self.head_v_dim), b.reshape(n, nv), a.reshape(n, nv)

    def _conv(self, x: torch.Tensor, conv_state: torch.Tensor, batch: LinearAttentionBatch) -> torch.Tensor:
        """silu(causal depthwise conv) of x [n, conv_dim], each sequence continuing from its kept inputs, which are
        replaced by its last K-1 inputs."""
        out = torch.empty_like(x)
        w, keep = self.conv_weight, self.kernel - 1
        nd = batch.num_decodes
        if nd:
            out[:nd] = self.ops.short_conv_step(x[:nd], conv_state, w, batch.decode_slots)
        for start, count, slot in batch.prefills:
            seq = torch.cat([conv_state[slot], x[start : start + count].T], dim=-1)  # [C, K-1 + count]
            out[start : start + count] = F.silu(F.conv1d(seq[None], w[:, None, :], groups=self.conv_dim)[0].T)
            conv_state[slot] = seq[:, seq.shape[1] - keep :]
        return out

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Linear attention of [num_tokens, hidden], each sequence from (and into) its state slot."""
        batch, n = ctx.linear, x.shape[0]
        states = batch.state
        qkv, z, b, a = self._split_projection(self.ops.linear(x, self.in_proj))
        mixed = self._conv(qkv, states.conv[self.linear_idx], batch)
        q, k, v = mixed.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        repeat = self.num_v_heads // self.num_k_heads
        q = l2_normalize(q.reshape(n, self.num_k_heads, self.head_k_dim)).repeat_interleave(repeat, dim=1)
        k = l2_normalize(k.reshape(n, self.num_k_heads, self.head_k_dim)).repeat_interleave(repeat, dim=1)
        q = q * self.head_k_dim**-0.5
        v = v.reshape(n, self.num_v_heads, self.head_v_dim)
        beta = torch.sigmoid(b).float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        recurrent = states.recurrent[self.linear_idx]
        out = torch.empty_like(v)
        nd = batch.num_decodes
        if nd:
            out[:nd] = self.ops.gated_delta_step(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], recurrent,
                                                 batch.decode_slots)
        if batch.prefills:
            out[batch.prefills.rows] = self.ops.gated_delta_prefills(q, k, v, g, beta, recurrent, batch.prefills)
        gated = self.norm(out.to(x.dtype)).float() * F.silu(z.float())
        return self.ops.linear(gated.to(x.dtype).reshape(n, self.value_dim), self.out_proj)

    def checkpoint_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> the view of our parameters it fills (the projections in their stored order)."""
        w, kd, vd, nv = self.in_proj.data, self.key_dim, self.value_dim, self.num_v_heads
        if self.grouped:
            projections = {"in_proj_qkvz": w[: 2 * kd + 2 * vd], "in_proj_ba": w[2 * kd + 2 * vd :]}
        else:
            qkv = 2 * kd + vd
            projections = {"in_proj_qkv": w[:qkv], "in_proj_z": w[qkv : qkv + vd],
                           "in_proj_b": w[qkv + vd : qkv + vd + nv], "in_proj_a": w[qkv + vd + nv :]}
        targets = {f"{prefix}.{name}.weight": view for name, view in projections.items()}
        targets.update({
            f"{prefix}.conv1d.weight": self.conv_weight.data.unsqueeze(1),
            f"{prefix}.dt_bias": self.dt_bias.data,
            f"{prefix}.A_log": self.A_log.data,
            f"{prefix}.norm.weight": self.norm.weight.data,
            f"{prefix}.out_proj.weight": self.out_proj.data,
        })
        return targets


class SharedExpertMoeBlock(nn.Module):
    """Routed experts (as Qwen3-MoE) plus a shared expert every token goes through, scaled by sigmoid(gate · x)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ops: Ops) -> None:
        super().__init__()
        self.routed = SparseMoeBlock(cfg, dtype, ops)
        self.shared_expert = SwiGLUMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype, ops)
        self.shared_expert_gate = nn.Parameter(torch.empty(1, cfg.hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Both paths over [num_tokens, hidden], summed."""
        shared = torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert(x)
        return self.routed(x) + shared

    def checkpoint_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        return {
            **self.routed.checkpoint_targets(prefix),
            **self.shared_expert.checkpoint_targets(f"{prefix}.shared_expert"),
            f"{prefix}.shared_expert_gate.weight": self.shared_expert_gate.data,
        }


class HybridDecoderLayer(nn.Module):
    """Pre-norm block whose token mixer is either Gated DeltaNet or gated full attention."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, mlp: nn.Module, dtype: torch.dtype, ops: Ops,
                 grouped_projections: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, zero_centered=True)
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: QwenAttention | None = None
        if cfg.layer_types[layer_idx] == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, cfg.linear_layers.index(layer_idx), dtype, ops, grouped_projections)
        else:
            self.self_attn = QwenAttention(cfg, cfg.kv_layers.index(layer_idx), dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, zero_centered=True)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """One block over the flattened tokens."""
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h, ctx) if self.linear_attn is not None else self.self_attn(h, cos, sin, ctx))
        return x + self.mlp(self.post_attention_layernorm(x))

    def checkpoint_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        mixer = (self.linear_attn.checkpoint_targets(f"{prefix}.linear_attn") if self.linear_attn is not None
                 else self.self_attn.checkpoint_targets(f"{prefix}.self_attn"))
        return {
            f"{prefix}.input_layernorm.weight": self.input_layernorm.weight.data,
            f"{prefix}.post_attention_layernorm.weight": self.post_attention_layernorm.weight.data,
            **mixer,
            **self.mlp.checkpoint_targets(f"{prefix}.mlp"),
        }


class Qwen3NextForCausalLM(QwenForCausalLM):
    """Qwen3-Next: hybrid layers, grouped linear-attention projections, MoE with a shared expert."""

    grouped_projections = True

    def build_layer(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        return HybridDecoderLayer(cfg, layer_idx, self.build_mlp(cfg, layer_idx, dtype), dtype, self.ops,
                                  self.grouped_projections)

    def build_mlp(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        if not cfg.is_moe_layer(layer_idx):
            return SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, dtype, self.ops)
        if cfg.shared_expert_intermediate_size:
            return SharedExpertMoeBlock(cfg, dtype, self.ops)
        return SparseMoeBlock(cfg, dtype, self.ops)

    def skipped_checkpoint_prefixes(self) -> dict[str, str]:
        return {
            "mtp.": "multi-token-prediction weights (no speculative decoding here)",
            "model.visual.": "the vision encoder (this checkpoint is served as text-only)",
        }


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):  # noqa: N801 - the family's own name
    """Qwen3.5 and Qwen3.5-MoE text models: as Qwen3-Next with separate linear-attention projections."""

    grouped_projections = False
