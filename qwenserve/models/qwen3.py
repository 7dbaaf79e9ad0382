"""Qwen3 (and, through its options, Qwen2): a decoder-only transformer over flattened variable-length batches.

Tokens of every sequence in a step are concatenated into one [num_tokens, hidden] matrix, so each linear
layer runs once per step whatever the batch looks like; only attention needs to know the sequence bounds,
and the ForwardContext carries them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from qwenserve.models.config import ModelConfig
from qwenserve.models.forward_context import ForwardContext
from qwenserve.models.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP
from qwenserve.models.ops import TORCH_OPS, Ops

if TYPE_CHECKING:
    from qwenserve.models.screened_head import ScreenedHead


class QwenAttention(nn.Module):
    """Grouped-query attention with fused q/k/v, optional q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3) and
    an optional output gate (Qwen3-Next, Qwen3.5: q_proj yields each head's query and a sigmoid gate).
    `layer_idx` is the layer's place in the KV cache (in a hybrid model, among the full-attention layers)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.output_gate = cfg.attn_output_gate
        self.q_out = self.q_size * (2 if self.output_gate else 1)
        qkv_out = self.q_out + 2 * self.kv_size
        self.qkv_proj = nn.Parameter(torch.empty(qkv_out, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.qkv_bias = (
            nn.Parameter(torch.empty(qkv_out, dtype=dtype), requires_grad=False) if cfg.attention_bias else None
        )
        self.o_proj = nn.Parameter(torch.empty(cfg.hidden_size, self.q_size, dtype=dtype), requires_grad=False)
        zc = cfg.zero_centered_norm
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, zc, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, zc, ops) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Self-attention of [num_tokens, hidden] against each sequence's cached context."""
        n = x.shape[0]
        qkv = self.ops.linear(x, self.qkv_proj, self.qkv_bias)
        q, k, v = qkv.split([self.q_out, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.output_gate:  # per head: head_dim query channels, then head_dim gate channels
            q, gate = q.reshape(n, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
            gate = gate.reshape(n, self.q_size)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.zero_centered) \
            if self.q_norm is not None and self.k_norm is not None else (None, None, 0.0, False)
        q, k = self.ops.qk_norm_rope(q, k, *norms, cos, sin)
        out = ctx.attention(self.layer_idx, q, k, v)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.ops.linear(out, self.o_proj)

    def checkpoint_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> the view of our fused parameter it fills."""
        qs, ks = self.q_out, self.kv_size
        w = self.qkv_proj.data
        targets = {
            f"{prefix}.q_proj.weight": w[:qs],
            f"{prefix}.k_proj.weight": w[qs : qs + ks],
            f"{prefix}.v_proj.weight": w[qs + ks :],
            f"{prefix}.o_proj.weight": self.o_proj.data,
        }
        if self.qkv_bias is not None:
            b = self.qkv_bias.data
            targets.update(
                {
                    f"{prefix}.q_proj.bias": b[:qs],
                    f"{prefix}.k_proj.bias": b[qs : qs + ks],
                    f"{prefix}.v_proj.bias": b[qs + ks :],
                }
            )
        if self.q_norm is not None:
            targets[f"{prefix}.q_norm.weight"] = self.q_norm.weight.data
            targets[f"{prefix}.k_norm.weight"] = self.k_norm.weight.data
        return targets


class QwenDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, mlp: nn.Module, dtype: torch.dtype, ops: Ops) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops=ops)
        self.self_attn = QwenAttention(cfg, layer_idx, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops=ops)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """One transformer block over the flattened tokens."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))

    def checkpoint_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> destination view, for this block."""
        return {
            f"{prefix}.input_layernorm.weight": self.input_layernorm.weight.data,
            f"{prefix}.post_attention_layernorm.weight": self.post_attention_layernorm.weight.data,
            **self.self_attn.checkpoint_targets(f"{prefix}.self_attn"),
            **self.mlp.checkpoint_targets(f"{prefix}.mlp"),
        }


class QwenForCausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head; `forward` returns hidden states and
    `compute_logits` projects only the rows that are sampled (the LM head is the largest matrix). `ops` (see
    models/ops.py) are what every layer computes with, chosen by the engine (engine/kernels.py); PyTorch's by
    default."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int, ops: Ops | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = ops or TORCH_OPS
        # [vocab, hidden], as checkpoints store it; tied checkpoints keep this single copy for embeddings too.
        self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.embed_tokens = (
            None
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        )
        self.layers = nn.ModuleList(self.build_layer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.zero_centered_norm, self.ops)
        # Built with the packed weights where the engine screens greedy steps' LM head (models/screened_head.py).
        self.lm_head_screen: ScreenedHead | None = None
        rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.rotary = RotaryEmbedding(rotary_dim, cfg.rope, max_positions, dtype)

    def build_layer(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        """Decoder layer `layer_idx`; hybrid families override this."""
        return QwenDecoderLayer(cfg, layer_idx, self.build_mlp(cfg, layer_idx, dtype), dtype, self.ops)

    def build_mlp(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        """The MLP of layer `layer_idx`; model families with experts override this."""
        return SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, dtype, self.ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] (before the final norm) for flattened tokens."""
        table = self.lm_head if self.embed_tokens is None else self.embed_tokens
        x = self.ops.embedding(table, input_ids)
        cos, sin = self.rotary.lookup(positions)
        fused = self.ops.decode_layers(self, x, cos, sin, ctx)
        if fused is not None:
            return fused
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return x

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None,
                       largest: int = 0) -> torch.Tensor:
        """Final norm and LM head for the selected rows; logits in fp32 for the sampler (in `out` [rows, vocab]
        where the ops can use a buffer). `largest` > 0: the caller reads only each row's `largest` highest logits
        (greedy: the first of equal largest), so where the head is screened (models/screened_head.py) the others may
        be -inf."""
        x = self.norm(hidden)
        if largest > 0 and self.lm_head_screen is not None:
            logits = self.lm_head_screen.logits(x, self.lm_head, out, largest)
            if logits is not None:
                return logits
        return self.ops.logits(x, self.lm_head, out)

    def checkpoint_targets(self) -> dict[str, torch.Tensor]:
        """Every tensor the checkpoint must contain, mapped to the view of our parameters it fills.
        The loader uses this to fill fused matrices in place and to name missing or unexpected tensors."""
        head, prefix = self.lm_head.data, self.cfg.weight_prefix
        targets = {f"{prefix}norm.weight": self.norm.weight.data}
        if self.embed_tokens is None:
            targets[f"{prefix}embed_tokens.weight"] = head
        else:
            targets[f"{prefix}embed_tokens.weight"] = self.embed_tokens.data
            targets["lm_head.weight"] = head
        for i, layer in enumerate(self.layers):
            targets.update(layer.checkpoint_targets(f"{prefix}layers.{i}"))
        return targets

    def optional_checkpoint_tensors(self) -> set[str]:
        """Tensors a checkpoint may carry that we do not need (a tied LM head saved anyway)."""
        return {"lm_head.weight"} if self.cfg.tie_word_embeddings else set()

    def skipped_checkpoint_prefixes(self) -> dict[str, str]:
        """Name prefix -> why: whole parts of a checkpoint this model does not run (the loader logs each once)."""
        return {}


class Qwen3ForCausalLM(QwenForCausalLM):
    """Qwen3: per-head q/k RMSNorm, no attention bias unless the config sets it."""
