"""What a forward pass is given per step: the attention batch every attention backend is handed, the interface
a backend implements, and the ForwardContext the model threads through its layers.

These are the models' types: a model's layers call `ctx.attention(...)` and read `ctx.linear`, and the engine
(its model runner and attention backends) fills them in. They live here so that models/ imports nothing from the
engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from qwenserve.models.linear_state import LinearAttentionBatch


@dataclass(slots=True)
class AttentionBatch:
    """One step's sequences as attention sees them. Sequences with one query token come first
    (`num_decodes` of them) so backends can treat them as a single padded batch."""

    query_lens: list[int]  # tokens computed this step, per sequence
    context_lens: list[int]  # tokens in the KV cache after this step (cached + new), per sequence
    block_tables: list[list[int]]  # KV block ids per sequence, covering context_lens
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot (block * block_size + offset) per new token
    num_decodes: int


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """A step whose every row is one decode token, as the CPU kernels attend it (`AttentionBackend.decode_rows`)."""

    slot_mapping: torch.Tensor  # [rows] int64: where each row's K/V goes
    block_table: torch.Tensor  # [rows, max_blocks] int64, padded
    context_lens: torch.Tensor  # [rows] int64, this step's token included


class AttentionBackend(Protocol):
    """Writes this step's K/V into the paged cache and attends over each sequence's context."""

    name: str

    def prepare(self, batch: AttentionBatch, device: torch.device) -> Any:
        """Build per-step metadata once; every layer then reuses it."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] of one layer
        v_cache: torch.Tensor,
        meta: Any,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        """Store k/v at the step's slots, then return the attention output for every query token."""
        ...

    def decode_rows(self, meta: Any) -> DecodeRows | None:
        """The step as DecodeRows where every row is a decode token attended by the CPU kernel, else None."""
        ...


@dataclass(slots=True)
class ForwardContext:
    """Per-step state the model threads through its layers: the cache and how to attend over it, and for a hybrid
    model the linear-attention layers' per-sequence states."""

    backend: AttentionBackend
    meta: Any
    kv_cache: torch.Tensor  # [num_kv_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    linear: LinearAttentionBatch | None = None

    def attention(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of layer `layer_idx` (see AttentionBackend.forward)."""
        layer_cache = self.kv_cache[layer_idx]
        return self.backend.forward(q, k, v, layer_cache[0], layer_cache[1], self.meta)

    def decode_rows(self) -> DecodeRows | None:
        """This step as DecodeRows where every row is a decode token the CPU kernel attends (see AttentionBackend)."""
        return self.backend.decode_rows(self.meta)
