"""The KV layout both sides must agree on, and the shape of a handoff: [L, 2, T, H, D]."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import torch

from qwenserve.kv_transfer.errors import KVLayoutInvalid, KVLayoutMismatch
from qwenserve.v1 import common_pb2

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class KVLayout:
    """How a KV cache is laid out (mirror of `qwenserve.v1.KVLayout`)."""

    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    model_fingerprint: str

    def __post_init__(self) -> None:
        if self.dtype not in TORCH_DTYPES:
            raise KVLayoutInvalid(f"KV dtype {self.dtype!r} is not one of {sorted(TORCH_DTYPES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise KVLayoutInvalid(f"KV layout {name} must be >= 1, got {getattr(self, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    def shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """The handoff tensor's shape for `num_tokens` tokens: [layers, K/V, tokens, heads, head_dim]."""
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)

    def nbytes(self, num_tokens: int) -> int:
        """Bytes of KV for `num_tokens` tokens."""
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.num_layers * 2 * num_tokens * self.num_kv_heads * self.head_dim * itemsize

    def to_proto(self) -> common_pb2.KVLayout:
        return common_pb2.KVLayout(**{f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_proto(cls, message: common_pb2.KVLayout) -> KVLayout:
        return cls(**{f.name: getattr(message, f.name) for f in fields(cls)})


class LayoutLike(Protocol):
    """Anything with KVLayout's fields: the proto message, or the engine's own layout dataclass."""

    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    model_fingerprint: str


def as_layout(layout: LayoutLike) -> KVLayout:
    """Accept this dataclass, the proto message or any object with the same fields."""
    if isinstance(layout, KVLayout):
        return layout
    return KVLayout(**{f.name: getattr(layout, f.name) for f in fields(KVLayout)})


#: block_size is not compared: a handoff is token-major, so engines with other block sizes can share it.
COMPATIBILITY_FIELDS = ("model_fingerprint", "dtype", "num_layers", "num_kv_heads", "head_dim")


def check_layout_matches(actual: KVLayout, expected: KVLayout) -> None:
    """Raise KVLayoutMismatch naming every field where the handle differs from the importer."""
    diffs = [
        f"{name}: handle has {getattr(actual, name)!r}, importer expects {getattr(expected, name)!r}"
        for name in COMPATIBILITY_FIELDS
        if getattr(actual, name) != getattr(expected, name)
    ]
    if diffs:
        raise KVLayoutMismatch(
            "KV handoff is incompatible with this worker (prefill and decode must serve the same "
            "model with the same KV layout): " + "; ".join(diffs)
        )
