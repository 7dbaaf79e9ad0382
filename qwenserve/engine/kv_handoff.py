"""How one request's KV leaves or enters the engine (disaggregated prefill/decode): the engine's side of a handoff.

Exported and imported KV is token-major: a tensor [num_layers, 2 (k, v), num_tokens, num_kv_heads, head_dim] of
the serving dtype, so the block size of the two engines need not agree. A hybrid model's handoff carries, besides
the KV of its full-attention layers, the state its linear-attention layers reached after those tokens (a
LinearState). The layout itself, and the check that two layouts agree, are `qwenserve.kv_layout`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from qwenserve.engine.errors import RequestError
from qwenserve.kv_layout import KVLayout, KVLayoutMismatch, LinearState


class ImportedKVMismatch(RequestError, KVLayoutMismatch):
    """The engine refuses a request whose imported KV does not fit it: the client's error at a worker's edge
    (INVALID_ARGUMENT), and a KVLayoutMismatch for code that handles every such mismatch alike."""


@dataclass(frozen=True, slots=True)
class KVImport:
    """Prompt KV computed elsewhere: `kv` is [num_layers, 2, num_tokens, num_kv_heads, head_dim] covering
    the first num_tokens tokens of the prompt (+ resume tokens), described by `layout`; for a hybrid model `state`
    is its linear-attention state after exactly those tokens."""

    kv: torch.Tensor
    layout: KVLayout
    state: LinearState | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.kv.shape[2])

    def check_fits(self, engine_layout: KVLayout, request_tokens: int) -> None:
        """Raise ImportedKVMismatch unless this KV can seed a request of `request_tokens` tokens on an engine
        whose KV is `engine_layout`: same model and layout, a tensor of that shape and dtype, no extra tokens."""
        try:
            engine_layout.check_accepts(self.layout, "imported KV")
        except KVLayoutMismatch as e:
            raise ImportedKVMismatch(str(e)) from None
        kv = self.kv
        expected = engine_layout.token_shape(kv.shape[2] if kv.dim() == 5 else -1)
        if kv.dim() != 5 or tuple(kv.shape) != expected:
            raise ImportedKVMismatch(
                f"imported KV has shape {list(kv.shape)}; expected [num_layers, 2, num_tokens, num_kv_heads, "
                f"head_dim] = {list(expected)}"
            )
        if kv.dtype != engine_layout.torch_dtype():
            raise ImportedKVMismatch(f"imported KV has dtype {kv.dtype}; this engine serves {engine_layout.dtype}")
        if kv.shape[2] > request_tokens:
            raise ImportedKVMismatch(f"imported KV covers {kv.shape[2]} tokens but the request has only {request_tokens}")
        try:
            engine_layout.check_state(self.state)
        except KVLayoutMismatch as e:
            raise ImportedKVMismatch(str(e)) from None
        if self.state is not None and kv.shape[2] >= request_tokens:
            # KV can be recomputed over, a recurrent state cannot be rewound: the engine computes the last token.
            raise ImportedKVMismatch(f"imported KV and state cover all {request_tokens} tokens of the request; a hybrid "
                                     "model's import must leave at least the last token to compute")


class KVExportTarget(Protocol):
    """Where an exported request's KV goes, when it can take the engine's cache directly (a handoff slot that
    hashes the bytes as they land, say)."""

    #: The writable [L, 2, T, H, D] destination, for engines whose cache `gather` cannot read.
    tensor: torch.Tensor

    def gather(self, planes: torch.Tensor, rows: torch.Tensor) -> None:
        """tensor[l, k, t] = planes[l, k, rows[t]]: planes is the paged cache as [L, 2, slots, H, D] on the CPU."""
        ...

    def write_state(self, state: LinearState) -> None:
        """Copy a hybrid model's linear-attention state in beside the KV (before the handoff is published)."""
        ...


# Called once per exported request: (layout, num_tokens) -> a writable [L, 2, T, H, D] tensor of the serving
# dtype (typically a view over shared memory), or a KVExportTarget, that the engine fills with one copy. A hybrid
# model's export needs a KVExportTarget: its linear-attention state goes with the KV.
KVExportSink = Callable[[KVLayout, int], "torch.Tensor | KVExportTarget"]
