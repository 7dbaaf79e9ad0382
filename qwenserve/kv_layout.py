"""The description of a KV cache that exporter and importer must agree on, in one place for the engine and the
transports: the dataclass, its wire form (`qwenserve.v1.KVLayout`), the one compatibility check and its error.

A handoff is token-major, [num_layers, 2 (k, v), num_tokens, num_kv_heads, head_dim], so engines with different
block sizes can share it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from qwenserve.engine.errors import RequestError
from qwenserve.v1 import common_pb2

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# block_size is not compared: the handoff is token-major.
COMPATIBILITY_FIELDS = ("model_fingerprint", "dtype", "num_layers", "num_kv_heads", "head_dim")


class KVLayoutMismatch(RequestError):
    """KV computed elsewhere does not fit here (another model, dtype or shape), so it must not be used.

    A RequestError, because the engine refuses the request that brings it (INVALID_ARGUMENT at a worker's edge);
    the decode worker refuses a handoff that carries it before the engine sees it (FAILED_PRECONDITION: the
    router prefills again)."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape and provenance of KV. `model_fingerprint` hashes the config, the tensor names/shapes and a
    sample of the weights, so KV made by other weights is refused."""

    dtype: str  # "float32", "bfloat16", "float16"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    model_fingerprint: str

    def __post_init__(self) -> None:
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"KV dtype {self.dtype!r} is not one of {sorted(TORCH_DTYPES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KV layout {name} must be >= 1, got {getattr(self, name)}")

    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    def token_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of the token-major KV tensor for `num_tokens` tokens."""
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)

    def nbytes(self, num_tokens: int) -> int:
        """Bytes of KV for `num_tokens` tokens."""
        itemsize = torch.empty((), dtype=self.torch_dtype()).element_size()
        return self.num_layers * 2 * num_tokens * self.num_kv_heads * self.head_dim * itemsize

    def check_accepts(self, other: KVLayout, what: str = "KV") -> None:
        """Raise KVLayoutMismatch naming every field where `other` (the KV offered) differs from this layout
        (the one that would use it); block sizes may differ."""
        diffs = [
            f"{name}: got {getattr(other, name)!r}, need {getattr(self, name)!r}"
            for name in COMPATIBILITY_FIELDS
            if getattr(self, name) != getattr(other, name)
        ]
        if diffs:
            raise KVLayoutMismatch(
                f"{what} does not fit here (prefill and decode must serve the same model with the same dtype and "
                "KV layout): " + "; ".join(diffs)
            )

    def to_proto(self) -> common_pb2.KVLayout:
        return common_pb2.KVLayout(**{f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_proto(cls, message: common_pb2.KVLayout) -> KVLayout:
        """The layout a handle carries; ValueError when it describes no usable layout."""
        return cls(**{f.name: getattr(message, f.name) for f in fields(cls)})
