"""A linear layer's weight kept as 4- or 8-bit integer codes, in the layout linear_quant.c's product reads (W4A16,
W8A16: the activations stay fp32).

W[o, i] = (codes[o, i] - zeros[o, g]) * scales[o, g] with g the group of input i. Checkpoints store codes, zero
points and scales in their own packings (engine/quantization/); `QuantWeight.pack` takes them unpacked, as unsigned
codes with one zero point and scale per output column and group, and repacks them once: output columns in panels of
PANEL as the fp32 / bf16 panels, eight 4-bit codes a 32-bit word along the input (input i of an octet at bit
NIBBLE_SHIFTS[i]: even inputs in the low half, odd ones in the high half, so a nibble of both halves is an input
pair, what a 16-bit dot product multiplies), scales and zero points in fp16 next to them (exactly what a checkpoint
stores: its 16-bit scales and integer zero points; a value fp16 cannot hold exactly is refused, and the loader then
dequantizes that weight). GPTQ's act-order checkpoints (desc_act: groups that are not runs of consecutive inputs) are packed with their
inputs sorted by group, and the product gathers x's columns in that order first.
"""

from __future__ import annotations

import torch

from qwenserve.cpu_kernels.packed_weight import PANEL

BITS = (4, 8)
OCTET = 8  # 4-bit codes a word
NIBBLE_SHIFTS = tuple(16 * (i % 2) + 4 * (i // 2) for i in range(OCTET))


class QuantWeight:
    """A weight [n, k] as panels of codes `codes` (int32 words [n/PANEL, k/8, PANEL] at 4 bits, k rounded up to 8;
    uint8 [n/PANEL, k, PANEL] at 8; n rounded up to a panel), `scales` and `zeros` (fp16 [n/PANEL, groups, PANEL]), `group_size` inputs a group (the
    last may be shorter) and `perm`, the order of x's columns the codes follow (None: their own)."""

    __slots__ = ("codes", "scales", "zeros", "bits", "group_size", "out_features", "in_features", "perm")

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int,
                 out_features: int, in_features: int, perm: torch.Tensor | None = None) -> None:
        self.codes, self.scales, self.zeros = codes, scales, zeros
        self.bits, self.group_size = bits, group_size
        self.out_features, self.in_features = out_features, in_features
        self.perm = perm

    @classmethod
    def pack(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
             group_size: int | None, groups: torch.Tensor | None = None) -> QuantWeight:
        """The weight whose unsigned `codes` [n, k] (integers in [0, 2^bits)), `scales` and `zeros` [n, num_groups]
        (zero points in code units, any value) make W = (codes - zeros) * scales group by group. Groups are runs of
        `group_size` inputs (None: one group), or, where given, `groups` [k] names each input's group (GPTQ's g_idx),
        in which case every group but the last must hold exactly `group_size` inputs. ValueError says what does not
        fit; the caller then dequantizes instead."""
        if bits not in BITS:
            raise ValueError(f"QuantWeight holds {' or '.join(map(str, BITS))}-bit codes, not {bits}-bit")
        if codes.dim() != 2:
            raise ValueError(f"QuantWeight.pack wants codes [n, k], got {tuple(codes.shape)}")
        n, k = codes.shape
        group_size = group_size or k
        num_groups = -(-k // group_size)
        if scales.shape != (n, num_groups) or zeros.shape != (n, num_groups):
            raise ValueError(f"scales and zeros must be [{n}, {num_groups}] for {k} inputs in groups of {group_size}, "
                             f"got {tuple(scales.shape)} and {tuple(zeros.shape)}")
        if bits == 4 and group_size % OCTET and num_groups > 1:
            raise ValueError(f"4-bit codes are packed {OCTET} inputs a word: a group size of {group_size} splits a "
                             "word")
        if codes.numel() and ((codes.dtype != torch.uint8 and int(codes.min()) < 0) or int(codes.max()) >= 1 << bits):
            raise ValueError(f"codes outside [0, {1 << bits})")
        scales, zeros = _half_exactly(scales, "scales"), _half_exactly(zeros, "zero points")
        perm = None
        if groups is not None and not torch.equal(groups.long(), torch.arange(k) // group_size):
            perm = torch.argsort(groups.long(), stable=True)
            if not torch.equal(groups.long()[perm], torch.arange(k) // group_size):
                raise ValueError(f"the groups (g_idx) are not runs of {group_size} inputs in some order")
            codes = codes[:, perm]
        panels = -(-n // PANEL)
        pad_n = panels * PANEL - n
        codes = torch.nn.functional.pad(codes.to(torch.uint8), (0, -k % OCTET if bits == 4 else 0, 0, pad_n))
        if bits == 4:
            codes = _words(codes)
        return cls(_panels(codes, panels), _panels(_pad_rows(scales, pad_n), panels),
                   _panels(_pad_rows(zeros, pad_n), panels), bits, group_size, n, k, perm)

    def check(self) -> None:
        """ValueError unless the tensors have the sizes and dtypes linear_quant.c reads for this shape (a QuantWeight
        made by `pack` always does): the C code trusts them."""
        n, k = self.shape
        panels, groups = -(-n // PANEL), -(-k // self.group_size) if self.group_size > 0 else 0
        steps, code_dtype = (-(-k // OCTET), torch.int32) if self.bits == 4 else (k, torch.uint8)
        for name, t, shape, dtype in (("codes", self.codes, (panels, steps, PANEL), code_dtype),
                                      ("scales", self.scales, (panels, groups, PANEL), torch.float16),
                                      ("zeros", self.zeros, (panels, groups, PANEL), torch.float16)):
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"QuantWeight {name} must be contiguous {dtype} {shape} on the CPU for a {self.bits}-bit "
                                 f"[{n}, {k}] weight in groups of {self.group_size}, got {t.dtype} {tuple(t.shape)}")
        if self.bits not in BITS or (self.bits == 4 and self.group_size % OCTET and groups > 1):
            raise ValueError(f"QuantWeight: {self.bits} bits in groups of {self.group_size} is not a layout of ours")
        if self.perm is not None and (self.perm.dtype != torch.int64 or tuple(self.perm.shape) != (k,)):
            raise ValueError(f"QuantWeight perm must be int64 [{k}]")

    @property
    def shape(self) -> tuple[int, int]:
        """The unpacked shape [n, k]."""
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.zeros.nbytes + (self.perm.nbytes if self.perm is not None
                                                                              else 0)

    def dequantize(self) -> torch.Tensor:
        """The weight [n, k] in fp32, in x's column order (a reference; a fallback's dense copy)."""
        return self.rows(torch.arange(self.out_features))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the dequantized matrix in fp32 (an embedding lookup in a tied, quantized LM head): row v is
        column v % PANEL of panel v // PANEL."""
        ids = ids.long()
        k = self.in_features
        panel, lane = ids // PANEL, ids % PANEL
        codes = self.codes[panel, :, lane]
        if self.bits == 4:
            codes = torch.stack([(codes >> shift) & 15 for shift in NIBBLE_SHIFTS], dim=-1).flatten(-2)
        group_of = torch.arange(k) // self.group_size
        scales, zeros = (t[panel, :, lane][..., group_of].float() for t in (self.scales, self.zeros))
        weight = (codes[..., :k].float() - zeros) * scales
        if self.perm is not None:
            weight = torch.empty_like(weight).index_copy_(-1, self.perm, weight)
        return weight


def _words(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [n, k] (k a multiple of OCTET) -> int32 words [n, k / OCTET], input i of each octet at bit
    NIBBLE_SHIFTS[i]: bytes 0 and 1 (the low half) hold inputs 0, 2, 4, 6, bytes 2 and 3 inputs 1, 3, 5, 7."""
    octets = codes.reshape(codes.shape[0], -1, OCTET)
    even, odd = octets[..., 0::2], octets[..., 1::2]
    lanes = torch.stack([even[..., 0] | even[..., 1] << 4, even[..., 2] | even[..., 3] << 4,
                         odd[..., 0] | odd[..., 1] << 4, odd[..., 2] | odd[..., 3] << 4], dim=-1)
    return lanes.contiguous().view(torch.int32).squeeze(-1)  # little-endian bytes: byte 0 the word's lowest


def _pad_rows(t: torch.Tensor, pad: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, 0, 0, pad))


def _panels(t: torch.Tensor, panels: int) -> torch.Tensor:
    """[panels * PANEL, c] -> [panels, c, PANEL]: each panel's PANEL rows side by side."""
    return t.reshape(panels, PANEL, t.shape[1]).transpose(1, 2).contiguous()


def _half_exactly(t: torch.Tensor, what: str) -> torch.Tensor:
    """`t` in fp16, where every value survives the trip (ValueError where one does not: the caller dequantizes)."""
    half = t.to(torch.float16)
    if not bool(torch.isfinite(half).all()) or not torch.equal(half.to(t.dtype), t):
        raise ValueError(f"{what} that fp16 does not hold exactly (the codes' kernels read them in fp16)")
    return half
