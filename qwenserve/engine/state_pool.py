"""The state pool of hybrid models: per-sequence state of the linear-attention layers, beside the KV block pool.

A Gated DeltaNet layer (Qwen3-Next, Qwen3.5) keeps, per sequence, a state of constant size instead of KV per token
(its tensors are models/linear_state.py's LinearStateCache). The pool has one slot
per sequence that can run at once (max_num_seqs); a sequence takes a slot when it is admitted and gives it back when
it finishes or is preempted. A preempted sequence recomputes from its first token, its state as well as its KV, so a
slot is never saved anywhere. A disaggregated handoff carries the slot's contents (a kv_layout.LinearState) from the
prefill worker's pool into a decode worker's.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from qwenserve.models.linear_state import conv_dim

if TYPE_CHECKING:
    from qwenserve.models.config import ModelConfig


class StatePool:
    """Hands out state slots: which sequence's linear-attention state lives where in the LinearStateCache."""

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


def linear_state_layout(cfg: ModelConfig) -> dict[str, int]:
    """The KVLayout fields that describe a model's linear-attention state (none for a model without such layers)."""
    if not cfg.is_hybrid:
        return {}
    return {
        "linear_layers": len(cfg.linear_layers),
        "linear_conv_dim": conv_dim(cfg),
        "linear_conv_width": cfg.linear_conv_kernel_dim - 1,
        "linear_value_heads": cfg.linear_num_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_value_head_dim": cfg.linear_value_head_dim,
    }
