"""The weights of a dense model's decoder layers as decode_stack.c reads them: one `DecodeStack` per model, built
once after its weights are packed, holding the C structures and the tensors they point into (kept alive here)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from qwenserve.cpu_kernels.amx_weight import AmxWeight
from qwenserve.cpu_kernels.packed_weight import PackedWeight
from qwenserve.cpu_kernels.quant_weight import QuantWeight

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class StackWeight(ctypes.Structure):
    _fields_ = [("bits", _I64), ("data", _P), ("scales", _P), ("zeros", _P), ("perm", _P), ("group", _I64),
                ("n", _I64), ("k", _I64), ("tiles", _P)]


class StackLayer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P), ("qkv_bias", _P),
                ("qkv", StackWeight), ("o", StackWeight), ("gate_up", StackWeight), ("down", StackWeight)]


class StackShape(ctypes.Structure):
    _fields_ = [("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64), ("rot", _I64),
                ("intermediate", _I64), ("block_size", _I64), ("num_threads", _I64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("qk_zero_centered", _I64), ("quant_amx_rows", _I64),
                ("panel_amx_rows", _I64)]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors: norms [hidden] / [head_dim] bf16 (q_norm, k_norm None: none), qkv_bias bf16
    (None: none), and the four products as bf16 PackedWeights or QuantWeights."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv_bias: torch.Tensor | None
    qkv: PackedWeight | QuantWeight
    o: PackedWeight | QuantWeight
    gate_up: PackedWeight | QuantWeight
    down: PackedWeight | QuantWeight


def stack_weight(weight: object, k: int, n: int) -> StackWeight | None:
    """`weight` [n, k] as decode_stack.c reads it, or None where it cannot (fp32 panels, an unpacked tensor, another
    shape)."""
    if isinstance(weight, PackedWeight):
        if weight.dtype != torch.bfloat16 or weight.panels.dim() != 3 or weight.shape != (n, k):
            return None
        tiles = weight.dense.tiles.data_ptr() if isinstance(weight.dense, AmxWeight) else None
        return StackWeight(16, weight.panels.data_ptr(), None, None, None, 0, n, k, tiles)
    if isinstance(weight, QuantWeight):
        if weight.shape != (n, k):
            return None
        weight.check()
        perm = weight.perm.data_ptr() if weight.perm is not None else None
        return StackWeight(weight.bits, weight.codes.data_ptr(), weight.scales.data_ptr(), weight.zeros.data_ptr(),
                           perm, weight.group_size, n, k, None)
    return None


def _bf16_vector(t: torch.Tensor | None, size: int) -> bool:
    return t is None or (t.dtype == torch.bfloat16 and t.shape == (size,) and t.is_contiguous()
                         and t.device.type == "cpu")


class DecodeStack:
    """The C view of a model's layers (see decode_stack.c), with the sizes they were checked against."""

    def __init__(self, layers: list[LayerWeights], hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, rot: int, eps: float, qk_zero_centered: bool) -> None:
        """ValueError when a tensor is not what the C code reads for these sizes."""
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        qkv_out = q_size + 2 * kv_size
        self.sizes = (hidden, heads, kv_heads, head_dim, intermediate, rot)
        self.eps, self.qk_zero_centered = eps, qk_zero_centered
        self._tensors = layers  # what the structures point into
        # Whether any product is bf16 panels, and whether every one of them has its AMX tiles too (then, as codes, it
        # goes to them from a row count the caller names).
        self.has_panels, self.panels_tiled = False, True
        self.layers = (StackLayer * len(layers))()
        for i, w in enumerate(layers):
            shapes = {"qkv": (hidden, qkv_out), "o": (q_size, hidden), "gate_up": (hidden, 2 * intermediate),
                      "down": (intermediate, hidden)}
            products = {name: stack_weight(getattr(w, name), k, n) for name, (k, n) in shapes.items()}
            bad = [name for name, product in products.items() if product is None]
            if bad:
                raise ValueError(f"layer {i}: {', '.join(bad)} not bf16 panels or codes of the model's shape")
            self.has_panels |= any(product.bits == 16 for product in products.values())
            self.panels_tiled &= all(product.tiles for product in products.values() if product.bits == 16)
            vectors = ((w.input_norm, hidden), (w.post_norm, hidden), (w.q_norm, head_dim), (w.k_norm, head_dim),
                       (w.qkv_bias, qkv_out))
            if w.input_norm is None or w.post_norm is None or (w.q_norm is None) != (w.k_norm is None) \
                    or not all(_bf16_vector(t, size) for t, size in vectors):
                raise ValueError(f"layer {i}: a norm weight or the bias is not a bf16 vector of the model's size")
            self.layers[i] = StackLayer(*(t.data_ptr() if t is not None else None for t, _ in vectors), **products)

    def __len__(self) -> int:
        return len(self.layers)

    def shape(self, block_size: int, num_threads: int, quant_amx_rows: int | None = None,
              panel_amx_rows: int | None = None) -> StackShape:
        """The sizes decode_stack.c reads; codes go to AMX tiles in steps of `quant_amx_rows` rows or more, bf16
        weights with tiles in steps of `panel_amx_rows` (None: never)."""
        hidden, heads, kv_heads, head_dim, intermediate, rot = self.sizes
        return StackShape(hidden, heads, kv_heads, head_dim, rot, intermediate, block_size, num_threads, self.eps,
                          head_dim**-0.5, int(self.qk_zero_centered), quant_amx_rows or 0, panel_amx_rows or 0)
