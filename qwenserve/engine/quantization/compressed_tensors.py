"""compressed-tensors' `pack-quantized` format (`quant_method: compressed-tensors`), what llm-compressor writes:
int4 / int8 weights, 16-bit activations (W4A16, W8A16), one scale per group of input columns or per output row.

Per linear with weight W [out, in], b bits, p = 32 / b values per int32 word, sequential within a word (value k in
bits [k*b, (k+1)*b)):
- `weight_packed` int32 [out, ceil(in / p)]: packed along the input dimension, the last word padded;
- `weight_scale` [out, in / group_size] (group strategy) or [out, 1] (channel strategy), in the model's dtype;
- `weight_zero_point` int32 [ceil(out / p), groups] (asymmetric schemes only): packed along the output dimension;
- `weight_shape` int [2]: [out, in];
- `weight_g_idx` int32 [in] (optional, from activation-ordered "group" actorder): input column i's group.
Values are signed (int4: -8..7) and stored with an offset of 2^(b-1) so that each packs as unsigned; zero points
too. W[o, i] = (q[o, i] - zp[o, g(i)]) * s[o, g(i)] (compressed-tensors' `unpack_from_int32` and `dequantize`;
its dequantize multiplies in the scale's dtype, we in fp32, which rounds once, to the serving dtype).
"""

from __future__ import annotations

from typing import Any

import torch

from qwenserve.engine.errors import CheckpointError
from qwenserve.engine.quantization.scheme import (
    FLOAT_DTYPES,
    INT32,
    IntegerWeight,
    Part,
    Quantization,
    num_groups,
    unpack_int32,
)

SUPPORTED = "compressed-tensors' pack-quantized format with int4 or int8 weights and 16-bit activations (W4A16, W8A16)"
INTEGERS = (torch.int32, torch.int64)


class PackQuantizedLayout:
    """weight_packed / weight_scale / weight_zero_point / weight_shape as compressed-tensors' PackedQuantizationCompressor
    writes them."""

    marker = "weight_packed"
    required = ("weight_packed", "weight_scale", "weight_shape")

    def __init__(self, bits: int, group_size: int | None, symmetric: bool) -> None:
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric
        self.per_word = 32 // bits

    def parts(self, out_features: int, in_features: int) -> dict[str, Part]:
        """weight_packed [out, ceil(in/p)], weight_scale [out, groups], weight_shape [2], weight_g_idx [in] and, when
        asymmetric, weight_zero_point [ceil(out/p), groups]."""
        groups, p = num_groups(in_features, self.group_size), self.per_word
        parts = {
            "weight_packed": Part((out_features, -(-in_features // p)), INT32),
            "weight_scale": Part((out_features, groups), FLOAT_DTYPES),
            "weight_shape": Part((2,), INTEGERS),
            "weight_g_idx": Part((in_features,), INT32),
        }
        if not self.symmetric:
            parts["weight_zero_point"] = Part((-(-out_features // p), groups), INT32)
        return parts

    def dequantize(self, parts: dict[str, torch.Tensor], out_features: int, in_features: int) -> torch.Tensor:
        """(q - zp) * s per group, with the storage offset taken off q and zp."""
        return self.integer(parts, out_features, in_features).dequantize()

    def integer(self, parts: dict[str, torch.Tensor], out_features: int, in_features: int) -> IntegerWeight:
        """The stored (offset, so unsigned) codes and zero points unpacked, the offset itself the zero point of a
        symmetric scheme (the offset cancels in q - zp)."""
        stored = tuple(int(n) for n in parts["weight_shape"].tolist())
        if stored != (out_features, in_features):
            raise ValueError(f"weight_shape says {list(stored)}, the model's weight is [{out_features}, {in_features}]")
        if self.group_size and in_features % self.group_size:
            raise ValueError(f"in_features ({in_features}) is not a multiple of the group size ({self.group_size})")
        codes = unpack_int32(parts["weight_packed"], self.bits, dim=1)[:, :in_features]
        scales = parts["weight_scale"].float()
        if "weight_zero_point" in parts:
            zeros = unpack_int32(parts["weight_zero_point"], self.bits, dim=0)[:out_features].float()
        else:
            zeros = torch.full_like(scales, float(1 << (self.bits - 1)))
        return IntegerWeight(codes, scales, zeros, self.bits, self.group_size, parts.get("weight_g_idx"))


def parse(qc: dict[str, Any]) -> Quantization:
    """The Quantization a compressed-tensors quantization_config describes; CheckpointError (one line) for what is not
    supported (another format, quantized activations, float weights, other strategies, mixed schemes)."""
    groups = qc.get("config_groups") or {}
    schemes = [g for g in groups.values() if isinstance(g, dict)]
    if not schemes or len(schemes) != len(groups):
        raise CheckpointError(f"compressed-tensors config_groups must spell out each scheme: qwen-serve loads {SUPPORTED}")
    formats = {str(s.get("format") or qc.get("format") or "") for s in schemes}
    if formats != {"pack-quantized"}:
        named = ", ".join(repr(f) for f in sorted(formats))
        raise CheckpointError(f"compressed-tensors format {named} is not supported: qwen-serve loads {SUPPORTED}")
    weights = [s.get("weights") or {} for s in schemes]
    if any(w != weights[0] for w in weights):
        raise CheckpointError(f"compressed-tensors with different weight schemes per group is not supported: qwen-serve "
                              f"loads {SUPPORTED}, one scheme for every module")
    if any(s.get("input_activations") or s.get("output_activations") for s in schemes):
        raise CheckpointError(f"compressed-tensors with quantized activations is not supported: qwen-serve loads {SUPPORTED}")
    if qc.get("kv_cache_scheme"):
        raise CheckpointError(f"compressed-tensors with a quantized KV cache (kv_cache_scheme) is not supported: "
                              f"qwen-serve loads {SUPPORTED}")
    w = weights[0]
    bits, kind, strategy = int(w.get("num_bits") or 0), w.get("type", "int"), w.get("strategy") or "group"
    if kind != "int" or bits not in (4, 8):
        raise CheckpointError(f"compressed-tensors {kind} weights with {bits} bits are not supported: qwen-serve loads "
                              f"{SUPPORTED}")
    if strategy not in ("group", "channel") or w.get("dynamic"):
        raise CheckpointError(f"compressed-tensors weight strategy {strategy!r} is not supported: qwen-serve loads "
                              f"{SUPPORTED}, with group or channel scales")
    group_size = int(w["group_size"]) if strategy == "group" and w.get("group_size") else None
    if strategy == "group" and group_size is None:
        raise CheckpointError(f"compressed-tensors group strategy without a group_size: qwen-serve loads {SUPPORTED}")
    symmetric = bool(w.get("symmetric", True))
    return Quantization(
        method="compressed-tensors", bits=bits, group_size=group_size, symmetric=symmetric,
        layout=PackQuantizedLayout(bits, group_size, symmetric), desc_act=w.get("actorder") == "group",
        not_converted=tuple(qc.get("ignore") or ()), ignore_syntax="compressed-tensors", lm_head=True,
    )
