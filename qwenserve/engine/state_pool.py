"""The state pool of hybrid models: per-sequence state of the linear-attention layers, beside the KV block pool.

A Gated DeltaNet layer (Qwen3-Next, Qwen3.5) keeps, per sequence, a state of constant size instead of KV per token:
the last (conv kernel - 1) inputs of its short causal convolution, and its recurrent matrix. The pool has one slot
per sequence that can run at once (max_num_seqs); a sequence takes a slot when it is admitted and gives it back when
it finishes or is preempted. A preempted sequence recomputes from its first token, its state as well as its KV, so a
slot is never saved anywhere. A disaggregated handoff carries the slot's contents (a kv_layout.LinearState) from the
prefill worker's pool into a decode worker's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qwenserve.kv_layout import LinearState
from qwenserve.models.gated_delta import PrefillChunks

if TYPE_CHECKING:
    from qwenserve.models.config import ModelConfig


class StatePool:
    """Hands out state slots: which sequence's linear-attention state lives where in LinearStateCache."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free slot; the scheduler checks num_free first."""
        if not self._free:
            raise RuntimeError("state pool exhausted")  # the scheduler admits only while a slot is free
        return self._free.popleft()

    def free(self, slot: int) -> None:
        self._free.append(slot)


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
        conv = _conv_dim(cfg) * (cfg.linear_conv_kernel_dim - 1) * torch.empty((), dtype=dtype).element_size()
        recurrent = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        return len(cfg.linear_layers) * (conv + recurrent)

    @classmethod
    def for_model(cls, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device) -> LinearStateCache:
        layers = len(cfg.linear_layers)
        conv_dim = _conv_dim(cfg)
        conv = torch.zeros(layers, num_slots, conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
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


def linear_state_layout(cfg: ModelConfig) -> dict[str, int]:
    """The KVLayout fields that describe a model's linear-attention state (none for a model without such layers)."""
    if not cfg.is_hybrid:
        return {}
    return {
        "linear_layers": len(cfg.linear_layers),
        "linear_conv_dim": _conv_dim(cfg),
        "linear_conv_width": cfg.linear_conv_kernel_dim - 1,
        "linear_value_heads": cfg.linear_num_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_value_head_dim": cfg.linear_value_head_dim,
    }


def _conv_dim(cfg: ModelConfig) -> int:
    """Channels of the short convolution: the keys and queries of every key head, the values of every value head."""
    return 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
