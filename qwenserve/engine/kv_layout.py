"""How one request's KV is described when it leaves or enters the engine (disaggregated prefill/decode).

Exported and imported KV is token-major: a tensor [num_layers, 2 (k, v), num_tokens, num_kv_heads,
head_dim] of the serving dtype, so the block size of the two engines need not agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from qwenserve.engine.errors import KVLayoutMismatchError


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape and provenance of an engine's KV. `model_fingerprint` hashes the config, the tensor
    names/shapes and a sample of the weights, so KV from other weights is refused."""

    dtype: str  # "float32", "bfloat16", "float16"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    model_fingerprint: str

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for handles that travel over the wire."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        """Inverse of to_dict."""
        return cls(**data)

    def torch_dtype(self) -> torch.dtype:
        """The dtype as a torch dtype."""
        return getattr(torch, self.dtype)

    def token_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of the token-major KV tensor for `num_tokens` tokens."""
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)

    def nbytes(self, num_tokens: int) -> int:
        """Bytes of KV for `num_tokens` tokens."""
        n = 1
        for d in self.token_shape(num_tokens):
            n *= d
        return n * torch.empty((), dtype=self.torch_dtype()).element_size()

    def check_compatible(self, other: KVLayout) -> None:
        """Raise KVLayoutMismatchError naming the first field that differs (block size may differ)."""
        for name in ("model_fingerprint", "dtype", "num_layers", "num_kv_heads", "head_dim"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise KVLayoutMismatchError(
                    f"imported KV has {name}={theirs!r} but this engine needs {name}={mine!r}; "
                    "export and import must use the same model and dtype"
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


# Called once per exported request: (layout, num_tokens) -> a writable [L, 2, T, H, D] tensor of the serving
# dtype (typically a view over shared memory) that the engine fills with one copy.
KVExportSink = Callable[[KVLayout, int], torch.Tensor]
