"""AWQ in AutoAWQ's GEMM layout (`quant_method: awq`, `version`/`format: gemm`), 4-bit with zero points.

Per linear with weight W [out, in], in groups of `group_size` input rows:
- `qweight` int32 [in, out / 8]: W's transpose, eight 4-bit values per word along the output dimension, in AWQ's
  interleaved order: the word's value k (bits 4k..4k+3) is column ORDER[k] of its eight;
- `qzeros` int32 [in / group_size, out / 8]: the zero points, packed the same way;
- `scales` float16 [in / group_size, out].
W[o, i] = (q[i, o] - z[i // group_size, o]) * s[i // group_size, o].
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
    unpack_int32,
)

# Column of its group of eight that each 4-bit value of a word holds (AutoAWQ's packing order)...
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# ...and, for each column, which value of the word holds it.
COLUMN_TO_VALUE = tuple(ORDER.index(c) for c in range(8))
SUPPORTED = "AWQ's GEMM layout (version 'gemm'), 4-bit, with zero points"


class AwqLayout:
    """qweight / qzeros / scales as AutoAWQ's WQLinear_GEMM saves them."""

    marker = "qweight"
    required = ("qweight", "qzeros", "scales")

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def parts(self, out_features: int, in_features: int) -> dict[str, Part]:
        """qweight [in, out/8], qzeros [in/group, out/8], scales [in/group, out]."""
        groups = in_features // self.group_size
        return {
            "qweight": Part((in_features, out_features // 8), INT32),
            "qzeros": Part((groups, out_features // 8), INT32),
            "scales": Part((groups, out_features), FLOAT_DTYPES),
        }

    def dequantize(self, parts: dict[str, torch.Tensor], out_features: int, in_features: int) -> torch.Tensor:
        """(q - z) * s per group, transposed to [out, in]."""
        return self.integer(parts, out_features, in_features).dequantize()

    def integer(self, parts: dict[str, torch.Tensor], out_features: int, in_features: int) -> IntegerWeight:
        """The codes, zero points and scales unpacked and transposed to [out, ...]."""
        if out_features % 8 or in_features % self.group_size:
            raise ValueError(f"AWQ needs out_features ({out_features}) divisible by 8 and in_features ({in_features}) "
                             f"by the group size ({self.group_size})")
        return IntegerWeight(unpack_awq(parts["qweight"]).t(), parts["scales"].float().t(),
                             unpack_awq(parts["qzeros"]).float().t(), 4, self.group_size)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[rows, n / 8] int32 words in AWQ's order -> [rows, n] values in column order."""
    values = unpack_int32(packed, 4, dim=1)
    return values.unflatten(1, (-1, 8))[:, :, list(COLUMN_TO_VALUE)].flatten(1)


def parse(qc: dict[str, Any]) -> Quantization:
    """The Quantization an AWQ quantization_config describes; CheckpointError (one line) for what is not supported."""
    version = str(qc.get("version") or qc.get("format") or "gemm").lower()
    bits = int(qc.get("bits") or qc.get("w_bit") or 4)
    group_size = int(qc.get("group_size") or qc.get("q_group_size") or 128)
    if version != "gemm":
        raise CheckpointError(f"AWQ version {version!r} is not supported: qwen-serve loads {SUPPORTED}")
    if bits != 4:
        raise CheckpointError(f"AWQ with {bits} bits is not supported: qwen-serve loads {SUPPORTED}")
    if qc.get("zero_point") is False:
        raise CheckpointError(f"AWQ without zero points (zero_point: false) is not supported: qwen-serve loads {SUPPORTED}")
    if group_size <= 0:
        raise CheckpointError(f"AWQ group_size {group_size} is not supported: qwen-serve loads {SUPPORTED} and a group size")
    return Quantization(
        method="awq", bits=4, group_size=group_size, symmetric=False, layout=AwqLayout(group_size),
        not_converted=tuple(qc.get("modules_to_not_convert") or ()),
    )
