"""Qwen3-MoE: Qwen3 attention with a sparse mixture-of-experts MLP on the layers the config selects."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qwenserve.models.config import ModelConfig
from qwenserve.models.layers import SwiGLUMLP
from qwenserve.models.ops import Ops
from qwenserve.models.qwen3 import QwenForCausalLM


class SparseMoeBlock(nn.Module):
    """Softmax router picks the top-k experts per token (renormalised when norm_topk_prob); each expert is
    a SwiGLU MLP. Tokens are grouped by expert so every expert runs one matrix product per step."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
        self.intermediate = inter
        self.gate = nn.Parameter(torch.empty(cfg.num_experts, hidden, dtype=dtype), requires_grad=False)
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.num_experts, 2 * inter, hidden, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(cfg.num_experts, hidden, inter, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route [num_tokens, hidden] through the experts and sum their outputs weighted by the router."""
        router_logits = F.linear(x, self.gate)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        flat_experts = experts.flatten()
        order = torch.argsort(flat_experts, stable=True)
        token_of = order // self.top_k
        weight_of = weights.flatten()[order]
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[start : start + count]
            act = self.ops.silu_mul(self.ops.linear(x[tokens], self.gate_up_proj[expert]), self.intermediate)
            y = self.ops.linear(act, self.down_proj[expert]) * weight_of[start : start + count, None]
            out.index_add_(0, tokens, y)
            start += count
        return out

    def checkpoint_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Per-expert checkpoint tensors (hub layout) -> slices of our stacked expert parameters."""
        i = self.intermediate
        targets = {f"{prefix}.gate.weight": self.gate.data}
        for e in range(self.num_experts):
            targets[f"{prefix}.experts.{e}.gate_proj.weight"] = self.gate_up_proj.data[e, :i]
            targets[f"{prefix}.experts.{e}.up_proj.weight"] = self.gate_up_proj.data[e, i:]
            targets[f"{prefix}.experts.{e}.down_proj.weight"] = self.down_proj.data[e]
        return targets


class Qwen3MoeForCausalLM(QwenForCausalLM):
    """Qwen3-MoE: sparse layers where ModelConfig.is_moe_layer (decoder_sparse_step, mlp_only_layers)."""

    def build_mlp(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        """A SparseMoeBlock on sparse layers, a dense SwiGLU MLP on the others."""
        if cfg.is_moe_layer(layer_idx):
            return SparseMoeBlock(cfg, dtype, self.ops)
        return SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, dtype, self.ops)
