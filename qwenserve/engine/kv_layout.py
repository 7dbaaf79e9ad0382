"""How one request's KV is described when it leaves or enters the engine (disaggregated prefill/decode).

Exported and imported KV is token-major: a tensor [num_layers, 2 (k, v), num_tokens, num_kv_heads,
head_dim] of the serving dtype, so the block size of the two engines need not agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from qwenserve.engine.errors import KVLayoutMismatchError
from qwenserve.kv_layout import KVLayout

__all__ = ["KVExportSink", "KVExportTarget", "KVImport", "KVLayout", "check_compatible"]


def check_compatible(mine: KVLayout, theirs: KVLayout) -> None:
    """Raise KVLayoutMismatchError naming what differs (block size may differ)."""
    diffs = mine.differences(theirs)
    if diffs:
        raise KVLayoutMismatchError(
            "imported KV does not fit this engine (export and import must use the same model and dtype): "
            + "; ".join(diffs)
        )


@dataclass(frozen=True, slots=True)
class KVImport:
    """Prompt KV computed elsewhere: `kv` is [num_layers, 2, num_tokens, num_kv_heads, head_dim] covering
    the first num_tokens tokens of the prompt (+ resume tokens), described by `layout`."""

    kv: torch.Tensor
    layout: KVLayout

    @property
    def num_tokens(self) -> int:
        return int(self.kv.shape[2])


class KVExportTarget(Protocol):
    """Where an exported request's KV goes, when it can take the engine's cache directly (a handoff slot that
    hashes the bytes as they land, say)."""

    #: The writable [L, 2, T, H, D] destination, for engines whose cache `gather` cannot read.
    tensor: torch.Tensor

    def gather(self, planes: torch.Tensor, rows: torch.Tensor) -> None:
        """tensor[l, k, t] = planes[l, k, rows[t]]: planes is the paged cache as [L, 2, slots, H, D] on the CPU."""
        ...


# Called once per exported request: (layout, num_tokens) -> a writable [L, 2, T, H, D] tensor of the serving
# dtype (typically a view over shared memory), or a KVExportTarget, that the engine fills with one copy.
KVExportSink = Callable[[KVLayout, int], "torch.Tensor | KVExportTarget"]
