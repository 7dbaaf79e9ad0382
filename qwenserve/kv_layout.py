"""The description of a KV cache that exporter and importer must agree on: one definition for the engine
and the transports. A handoff is token-major, [num_layers, 2 (k, v), num_tokens, num_kv_heads, head_dim],
so engines with different block sizes can share it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# block_size is not compared: the handoff is token-major.
COMPATIBILITY_FIELDS = ("model_fingerprint", "dtype", "num_layers", "num_kv_heads", "head_dim")


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

    def differences(self, other: KVLayout) -> list[str]:
        """Human-readable differences that make KV of `other` unusable here (empty when compatible)."""
        return [
            f"{name}: got {getattr(other, name)!r}, need {getattr(self, name)!r}"
            for name in COMPATIBILITY_FIELDS
            if getattr(self, name) != getattr(other, name)
        ]
