"""What every quantized format shares: the description of a checkpoint's quantization (`Quantization`), the layout
of one stored linear (`LinearLayout`: its tensors, their shapes, how they make a weight) and int32 unpacking."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Protocol

import torch

# Dtypes a scale may be stored in.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT32 = (torch.int32,)


@dataclass(frozen=True, slots=True)
class Part:
    """One tensor a quantized linear stores: its shape and the dtypes it may have."""

    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]


class LinearLayout(Protocol):
    """How one format stores one linear layer's weight [out_features, in_features] as `<prefix>.<part>` tensors."""

    # The part whose presence says a linear is stored in this format (qweight, weight_packed, weight_scale_inv).
    marker: str
    # The parts every stored linear has; the others `parts` names are optional (g_idx, a zero point).
    required: tuple[str, ...]

    def parts(self, out_features: int, in_features: int) -> dict[str, Part]:
        """Every part a linear of this shape may store, with its shape and dtypes."""
        ...

    def dequantize(self, parts: dict[str, torch.Tensor], out_features: int, in_features: int) -> torch.Tensor:
        """The weight [out_features, in_features] in fp32 from the stored parts (already checked against `parts`);
        ValueError names what is inconsistent in their values."""
        ...

    def integer(self, parts: dict[str, torch.Tensor], out_features: int, in_features: int) -> IntegerWeight | None:
        """The stored integers unpacked (what the W4A16 / W8A16 kernels keep), or None for a format whose values are
        not integer codes (FP8); ValueError as `dequantize`."""
        ...


@dataclass(frozen=True)
class IntegerWeight:
    """A linear's weight [out, in] as integer codes: W[o, i] = (codes[o, i] - zeros[o, g]) * scales[o, g], g the group
    of input i: `groups[i]` (GPTQ's g_idx) where given, else i // group_size (None: one group). `codes` are uint8,
    below 2^bits; `zeros` [out, num_groups] are in code units, as fp32 (GPTQ's v1 offset can make them 2^bits);
    `scales` [out, num_groups] fp32."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int | None
    groups: torch.Tensor | None = None

    def group_of_inputs(self) -> torch.Tensor:
        """Each input's group, [in]."""
        if self.groups is not None:
            return self.groups.long()
        return groups_in_order(self.codes.shape[1], self.group_size)

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in fp32."""
        groups = self.group_of_inputs()
        return (self.codes.float() - self.zeros[:, groups]) * self.scales[:, groups]

    def values_at(self, flat: torch.Tensor) -> torch.Tensor:
        """The dequantized weight's elements at row-major positions `flat` (a sample, without dequantizing it all)."""
        rows, cols = flat // self.codes.shape[1], flat % self.codes.shape[1]
        groups = self.group_of_inputs()[cols]
        return (self.codes[rows, cols].float() - self.zeros[rows, groups]) * self.scales[rows, groups]


@dataclass(frozen=True)
class Quantization:
    """What config.json's quantization_config says of the checkpoint: `method` as it names it, `bits` per weight,
    `group_size` input columns per scale (None: one scale per output row, or per `block` for FP8), `symmetric` (no
    zero points stored), `desc_act` (GPTQ: each input row's group comes from g_idx), the modules it leaves in 16 bits
    (`not_converted`, as written: `modules_to_not_convert` or compressed-tensors' `ignore`) and the `layout` of one
    stored linear."""

    method: str
    bits: int
    group_size: int | None
    symmetric: bool
    layout: LinearLayout = field(repr=False, compare=False)
    desc_act: bool = False
    block: tuple[int, int] | None = None
    not_converted: tuple[str, ...] = ()
    # compressed-tensors writes `ignore` entries as exact names or "re:" regexes; transformers' lists are names,
    # regexes or suffixes at a module boundary.
    ignore_syntax: str = "transformers"
    lm_head: bool = False  # whether the config says the LM head is quantized too (GPTQ's `lm_head`)

    def quantizes(self, module: str) -> bool:
        """Whether the config says `module` (e.g. 'model.layers.0.mlp.down_proj') is stored quantized."""
        if module == "lm_head" and not self.lm_head:
            return False
        return not any(self._names(entry, module) for entry in self.not_converted)

    def _names(self, entry: str, module: str) -> bool:
        if self.ignore_syntax == "compressed-tensors":
            return re.match(entry.removeprefix("re:"), module) is not None if entry.startswith("re:") else entry == module
        # From the start to a module boundary ("layers.1" names "layers.1.mlp", not "layers.11"), or a suffix.
        return re.match(rf"(?:{entry})(?:(?<=\.)|(?=\.|$))", module) is not None or module.endswith(entry)

    def describe(self) -> str:
        """e.g. 'AWQ 4-bit, group size 128, zero points' or 'FP8 (e4m3), 128x128 blocks'."""
        name = {"awq": "AWQ", "gptq": "GPTQ", "fp8": "FP8 (e4m3)"}.get(self.method, self.method)
        if self.block is not None:
            return f"{name}, {self.block[0]}x{self.block[1]} blocks"
        group = f"group size {self.group_size}" if self.group_size else "one scale per output channel"
        zeros = "symmetric" if self.symmetric else "zero points"
        return f"{name} {self.bits}-bit, {group}, {zeros}{', desc_act' if self.desc_act else ''}"


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The unsigned `bits`-bit (4 or 8) values packed into int32 words along `dim`, value k of a word in its bits
    [k * bits, (k + 1) * bits): word j's value k lands at index j * (32 // bits) + k, so `dim` grows 32 // bits
    times; uint8. Read through the words' bytes (a little-endian int32's byte b holds its bits 8b..8b+7: values 2b
    and 2b + 1 at 4 bits, value b at 8), one byte per value: a model's worth of words unpacks in seconds."""
    if bits not in (4, 8):
        raise ValueError(f"only 4- and 8-bit values are unpacked, not {bits}-bit")
    if sys.byteorder != "little":
        raise ValueError("unpacking int32 words through their bytes assumes a little-endian CPU")
    words = packed.movedim(dim, -1).contiguous()
    # Through one flat view: a dimension of size 1 may keep any stride, which a view to bytes refuses.
    values = words.reshape(-1).view(torch.uint8).reshape(*words.shape[:-1], words.shape[-1] * 4)
    if bits == 4:
        values = torch.stack([values & 15, values >> 4], dim=-1).flatten(-2)
    return values.movedim(-1, dim)


def groups_in_order(in_features: int, group_size: int | None) -> torch.Tensor:
    """Each input row's group when groups are consecutive runs of `group_size` rows (None: one group)."""
    return torch.arange(in_features) // (group_size or in_features)


def num_groups(in_features: int, group_size: int | None) -> int:
    """Groups of `group_size` input rows (the last may be partial); one when group_size is None."""
    return -(-in_features // group_size) if group_size else 1

