"""GPTQ (`quant_method: gptq`) as AutoGPTQ / GPTQModel save it, 4 or 8 bits, with and without desc_act.

Per linear with weight W [out, in], b bits, p = 32 / b values per int32 word, sequential within a word (value k in
bits [k*b, (k+1)*b)):
- `qweight` int32 [in / p, out]: packed along the input dimension (word j of a column holds input rows j*p..j*p+p-1);
- `qzeros` int32 [groups, out / p]: the zero points, packed along the output dimension;
- `scales` float16 [groups, out];
- `g_idx` int32 [in] (optional): input row i's group. With desc_act the rows were quantized in activation order, so
  groups are not consecutive and g_idx is the only truth; without it g_idx[i] = i // group_size, which is what we use
  when g_idx is absent. group_size -1 means one group for the whole row.
W[o, i] = (q[i, o] - zero[g_idx[i], o]) * s[g_idx[i], o].

The zero point's "+1": AutoGPTQ's packer stored `zeros - 1` and its kernels add 1 back when they unpack, so a
checkpoint in that format (`checkpoint_format`/`format`: "gptq", the default when neither key is there, which is
what Qwen's own GPTQ checkpoints are) stores z - 1 and zero = stored + 1, per value, after masking: a symmetric
4-bit checkpoint stores 7 for its zero point 8. GPTQModel's "gptq_v2" stores z itself. We follow the kernels that
read each format (AutoGPTQ's and vLLM's "gptq" kernels add 1 to the masked value; GPTQModel converts v1 to v2 by the
same per-value +1), so our weights are the ones those kernels compute with.
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

# checkpoint_format -> what is added to a stored zero point.
ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}
SUPPORTED = "GPTQ with 4 or 8 bits in the 'gptq' or 'gptq_v2' checkpoint format"


class GptqLayout:
    """qweight / qzeros / scales / g_idx as AutoGPTQ's and GPTQModel's QuantLinear save them."""

    marker = "qweight"
    required = ("qweight", "qzeros", "scales")

    def __init__(self, bits: int, group_size: int | None, zero_offset: int) -> None:
        self.bits, self.group_size, self.zero_offset = bits, group_size, zero_offset
        self.per_word = 32 // bits

    def parts(self, out_features: int, in_features: int) -> dict[str, Part]:
        """qweight [in/p, out], qzeros [groups, out/p], scales [groups, out], g_idx [in]."""
        groups, p = num_groups(in_features, self.group_size), self.per_word
        return {
            "qweight": Part((in_features // p, out_features), INT32),
            "qzeros": Part((groups, out_features // p), INT32),
            "scales": Part((groups, out_features), FLOAT_DTYPES),
            "g_idx": Part((in_features,), INT32),
        }

    def dequantize(self, parts: dict[str, torch.Tensor], out_features: int, in_features: int) -> torch.Tensor:
        """(q - zero) * s with each input row's group, transposed to [out, in]."""
        return self.integer(parts, out_features, in_features).dequantize()

    def integer(self, parts: dict[str, torch.Tensor], out_features: int, in_features: int) -> IntegerWeight:
        """The codes, zero points (with the format's offset) and scales unpacked and transposed to [out, ...], with
        g_idx where the checkpoint stores it."""
        if in_features % self.per_word or out_features % self.per_word:
            raise ValueError(f"{self.bits}-bit GPTQ needs in_features ({in_features}) and out_features "
                             f"({out_features}) divisible by {self.per_word}")
        groups = parts.get("g_idx")
        if groups is not None and (int(groups.min()) < 0 or int(groups.max()) >= parts["scales"].shape[0]):
            raise ValueError(f"g_idx names groups outside 0..{parts['scales'].shape[0] - 1}")
        q = unpack_int32(parts["qweight"], self.bits, dim=0)
        zeros = unpack_int32(parts["qzeros"], self.bits, dim=1).float() + self.zero_offset  # 2^bits in v1: not uint8
        return IntegerWeight(q.t(), parts["scales"].float().t(), zeros.t(), self.bits, self.group_size, groups)


def parse(qc: dict[str, Any]) -> Quantization:
    """The Quantization a GPTQ quantization_config describes; CheckpointError (one line) for what is not supported."""
    bits = int(qc.get("bits") or 4)
    group_size = int(qc.get("group_size") or -1)
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if bits not in (4, 8):
        raise CheckpointError(f"GPTQ with {bits} bits is not supported: qwen-serve loads {SUPPORTED}")
    if fmt not in ZERO_OFFSETS:
        raise CheckpointError(f"GPTQ checkpoint_format {fmt!r} is not supported: qwen-serve loads {SUPPORTED}")
    if qc.get("dynamic"):
        raise CheckpointError(f"GPTQ with per-module overrides (dynamic) is not supported: qwen-serve loads {SUPPORTED}"
                              " and one bit width for every module")
    return Quantization(
        method="gptq", bits=bits, group_size=group_size if group_size > 0 else None,
        symmetric=bool(qc.get("sym", True)), layout=GptqLayout(bits, group_size if group_size > 0 else None,
                                                                ZERO_OFFSETS[fmt]),
        desc_act=bool(qc.get("desc_act", False)), lm_head=bool(qc.get("lm_head", False)),
    )
