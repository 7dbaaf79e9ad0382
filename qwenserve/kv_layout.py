"""The description of a KV cache that exporter and importer must agree on, in one place for the engine and the
transports: the dataclass, the one compatibility check and its error (its wire form, `qwenserve.v1.KVLayout`, is
converted in qwenserve/protocol.py).

A handoff is token-major, [num_layers, 2 (k, v), num_tokens, num_kv_heads, head_dim], so engines with different
block sizes can share it. A hybrid model's handoff (Qwen3-Next, Qwen3.5) also carries the state its
linear-attention layers reached after those tokens, in the same bytes after the KV, so one lease and one checksum
cover both: the recurrent matrices (float32) first, then the convolution's kept inputs (the serving dtype).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Bytes per value of each serving dtype. torch is imported only where tensors are handled, so the router, which
# converts layouts to and from the wire and never touches KV, starts without it.
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def __getattr__(name: str) -> object:
    """TORCH_DTYPES (serving dtype name -> torch.dtype), made on first use so importing this module needs no torch."""
    if name == "TORCH_DTYPES":
        return _torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# block_size is not compared: the handoff is token-major.
COMPATIBILITY_FIELDS = (
    "model_fingerprint", "dtype", "num_layers", "num_kv_heads", "head_dim", "linear_layers", "linear_conv_dim",
    "linear_conv_width", "linear_value_heads", "linear_key_head_dim", "linear_value_head_dim",
)
LINEAR_FIELDS = COMPATIBILITY_FIELDS[6:]


class KVLayoutMismatch(ValueError):
    """KV computed elsewhere does not fit here (another model, dtype or shape), so it must not be used.

    The decode worker refuses a handoff that carries it before the engine sees it (FAILED_PRECONDITION: the router
    prefills again); the engine refuses a request that brings it as a request error of its own
    (engine/kv_handoff.py's ImportedKVMismatch, INVALID_ARGUMENT at a worker's edge)."""


@dataclass(frozen=True, slots=True)
class LinearState:
    """One request's linear-attention state after some tokens, every linear layer's: `recurrent` [linear layers,
    value heads, key head dim, value head dim] float32 and `conv` [linear layers, conv channels, kept inputs] in the
    serving dtype. The shapes are KVLayout.recurrent_shape and conv_shape."""

    conv: torch.Tensor
    recurrent: torch.Tensor


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape and provenance of KV. `model_fingerprint` hashes the config, the tensor names/shapes and a
    sample of the weights, so KV made by other weights is refused. The linear_* fields describe a hybrid model's
    linear-attention state (0 linear_layers: none); num_layers counts only the full-attention layers."""

    dtype: str  # "float32", "bfloat16", "float16"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    model_fingerprint: str
    linear_layers: int = 0
    linear_conv_dim: int = 0
    linear_conv_width: int = 0  # the convolution's kernel - 1
    linear_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # The config, tensor names and shapes without the weights' values (engine/weights.py): a model's bf16 and its
    # AWQ/GPTQ checkpoints share it. "" where the sender predates it.
    architecture_fingerprint: str = ""
    # The receiving side's policy, never sent (protocol.py): KV made by other weights of this architecture is
    # accepted (--kv-from-other-weights).
    accepts_other_weights: bool = field(default=False, compare=False, metadata={"local": True})
    # The precision of the weights that computed the KV (Precision.labels()'s "weights"), for the importer's span and
    # metrics; never compared.
    weights: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"KV dtype {self.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        required = ("num_layers", "num_kv_heads", "head_dim") + (LINEAR_FIELDS if self.linear_layers else ())
        for name in required:
            if getattr(self, name) < 1:
                raise ValueError(f"KV layout {name} must be >= 1, got {getattr(self, name)}")
        if not self.linear_layers and any(getattr(self, name) for name in LINEAR_FIELDS):
            raise ValueError("a KV layout without linear_layers describes no linear-attention state")

    @property
    def has_linear_state(self) -> bool:
        return self.linear_layers > 0

    @property
    def recurrent_shape(self) -> tuple[int, int, int, int]:
        """[linear layers, value heads, key head dim, value head dim]: the delta rule's matrices, in float32."""
        return (self.linear_layers, self.linear_value_heads, self.linear_key_head_dim, self.linear_value_head_dim)

    @property
    def conv_shape(self) -> tuple[int, int, int]:
        """[linear layers, conv channels, kept inputs]: the short convolution's last inputs, in the serving dtype."""
        return (self.linear_layers, self.linear_conv_dim, self.linear_conv_width)

    def torch_dtype(self) -> torch.dtype:
        return _torch_dtypes()[self.dtype]

    def token_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of the token-major KV tensor for `num_tokens` tokens."""
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)

    def kv_nbytes(self, num_tokens: int) -> int:
        """Bytes of KV for `num_tokens` tokens."""
        return math.prod(self.token_shape(num_tokens)) * self._itemsize()

    @property
    def state_nbytes(self) -> int:
        """Bytes of one request's linear-attention state (0 for a model without linear-attention layers)."""
        return math.prod(self.recurrent_shape) * 4 + math.prod(self.conv_shape) * self._itemsize()

    def nbytes(self, num_tokens: int) -> int:
        """Bytes of a handoff of `num_tokens` tokens: their KV, then the linear-attention state if any."""
        return self.kv_nbytes(num_tokens) + self.state_nbytes

    def split(self, data: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, LinearState | None]:
        """Views over a handoff's bytes (`data`: uint8, nbytes(num_tokens) long, 4-byte aligned): the KV
        [L, 2, T, H, D] and, for a hybrid model, the linear-attention state."""
        import torch

        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != self.nbytes(num_tokens):
            raise ValueError(f"a handoff of {num_tokens} tokens is {self.nbytes(num_tokens)} bytes (uint8, 1-D); "
                             f"got {data.dtype} {tuple(data.shape)}")
        kv_end = self.kv_nbytes(num_tokens)
        kv = data[:kv_end].view(self.torch_dtype()).view(self.token_shape(num_tokens))
        if not self.has_linear_state:
            return kv, None
        # KV ends on a 4-byte boundary (an even number of 2-byte values), so the float32 matrices can follow it.
        recurrent_end = kv_end + math.prod(self.recurrent_shape) * 4
        recurrent = data[kv_end:recurrent_end].view(torch.float32).view(self.recurrent_shape)
        conv = data[recurrent_end:].view(self.torch_dtype()).view(self.conv_shape)
        return kv, LinearState(conv=conv, recurrent=recurrent)

    def check_state(self, state: LinearState | None, what: str = "imported state") -> None:
        """Raise KVLayoutMismatch unless `state` is what this layout's requests carry: none without linear-attention
        layers, else tensors of the layout's shapes and dtypes."""
        if state is None or not self.has_linear_state:
            if (state is None) != (not self.has_linear_state):
                raise KVLayoutMismatch(
                    f"{what}: a hybrid model's handoff carries its linear-attention state with the KV" if state is None
                    else f"{what}: linear-attention state was given for a model without linear-attention layers")
            return
        import torch

        for name, tensor, shape, dtype in (("recurrent", state.recurrent, self.recurrent_shape, torch.float32),
                                           ("conv", state.conv, self.conv_shape, self.torch_dtype())):
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise KVLayoutMismatch(f"{what}: the {name} state is {tensor.dtype} {list(tensor.shape)}; this "
                                       f"model's is {dtype} {list(shape)}")

    def _itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    def check_accepts(self, other: KVLayout, what: str = "KV") -> None:
        """Raise KVLayoutMismatch naming every field where `other` (the KV offered) differs from this layout
        (the one that would use it); block sizes may differ."""
        other_weights = self.accepts_other_weights and self.architecture_fingerprint != "" \
            and other.architecture_fingerprint == self.architecture_fingerprint
        diffs = [
            f"{name}: got {getattr(other, name)!r}, need {getattr(self, name)!r}"
            for name in COMPATIBILITY_FIELDS
            if getattr(self, name) != getattr(other, name) and not (name == "model_fingerprint" and other_weights)
        ]
        if diffs:
            same_architecture = other.architecture_fingerprint == self.architecture_fingerprint != ""
            hint = (" (the same architecture with other weights: --kv-from-other-weights on this worker accepts it)"
                    if same_architecture and not self.accepts_other_weights and len(diffs) == 1
                    and diffs[0].startswith("model_fingerprint") else "")
            raise KVLayoutMismatch(
                f"{what} does not fit here (prefill and decode must serve the same model with the same dtype and "
                "KV layout): " + "; ".join(diffs) + hint
            )
