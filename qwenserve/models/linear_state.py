"""The linear-attention layers' state tensors (Qwen3-Next, Qwen3.5), as a forward pass reads and writes them.

A Gated DeltaNet layer keeps, per sequence, a state of constant size instead of KV per token: the last
(conv kernel - 1) inputs of its short causal convolution, and its recurrent matrix. `LinearStateCache` holds every
layer's state for a number of slots; `LinearAttentionBatch` says which slot each of a step's rows uses. They are the
models' concept, as the KV cache's layout is: the engine decides how many slots there are and which sequence holds
which (engine/state_pool.py), the model computes on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qwenserve.kv_layout import LinearState
from qwenserve.models.gated_delta import PrefillChunks

if TYPE_CHECKING:
    from qwenserve.models.config import ModelConfig


@dataclass(slots=True)
class LinearStateCache:
    """The state tensors of every linear-attention layer, indexed [linear layer, slot]: `conv` holds the last
    (kernel - 1) convolution inputs [L, slots, conv_dim, kernel - 1] in the serving dtype, `recurrent` the
    delta-rule matrices [L, slots, value_heads, key_head_dim, value_head_dim] in fp32 (the reference keeps them so)."""

    conv: torch.Tensor
    recurrent: torch.Tensor

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """One sequence's state across every linear-attention layer (the recurrent matrices in fp32)."""
        conv = conv_dim(cfg) * (cfg.linear_conv_kernel_dim - 1) * torch.empty((), dtype=dtype).element_size()
        recurrent = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        return len(cfg.linear_layers) * (conv + recurrent)

    @classmethod
    def for_model(cls, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device) -> LinearStateCache:
        layers = len(cfg.linear_layers)
        conv = torch.zeros(layers, num_slots, conv_dim(cfg), cfg.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
        recurrent = torch.zeros(layers, num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                cfg.linear_value_head_dim, dtype=torch.float32, device=device)
        return cls(conv, recurrent)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    def slot(self, slot: int) -> LinearState:
        """Views of one slot's state, every linear layer's (what a handoff carries)."""
        return LinearState(conv=self.conv[:, slot], recurrent=self.recurrent[:, slot])

    def load(self, slot: int, state: LinearState) -> None:
        """Replace one slot's state with one computed elsewhere (a handoff's)."""
        self.conv[:, slot].copy_(state.conv)
        self.recurrent[:, slot].copy_(state.recurrent)

    def reset(self, slots: list[int]) -> None:
        """Zero the slots of sequences about to compute their first token (a fresh or a recomputed sequence)."""
        index = torch.tensor(slots, dtype=torch.long, device=self.conv.device)
        self.conv[:, index] = 0
        self.recurrent[:, index] = 0


@dataclass(slots=True)
class LinearAttentionBatch:
    """One step's sequences as the linear-attention layers see them, in the attention batch's order: the
    `num_decodes` one-token rows first (one batched recurrent update over `decode_slots`), then one chunk per
    prefilling sequence, `prefills` = (first row, rows, slot)."""

    state: LinearStateCache
    num_decodes: int
    decode_slots: torch.Tensor  # [num_decodes] int64
    prefills: PrefillChunks


def conv_dim(cfg: ModelConfig) -> int:
    """Channels of the short convolution: the keys and queries of every key head, the values of every value head."""
    return 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
