"""A linear layer's weight packed in panels of PANEL output columns, the layout linear.c's product reads, in fp32
or in bf16 (half the bytes a decode step streams; the product widens them to fp32)."""

from __future__ import annotations

import torch

from qwenserve.cpu_kernels import amx_weight, onednn_weight
from qwenserve.cpu_kernels.amx_weight import AmxWeight

PANEL = 16  # output columns per panel of a packed weight (linear.c's PANEL)
PANEL_DTYPES = (torch.float32, torch.bfloat16)  # what linear.c's products read
DENSE_PRODUCTS = ("onednn", "amx")  # the many-row products a weight can be kept for (engine/precision.py)


def packable(weight: torch.Tensor) -> bool:
    """Whether `weight` [..., n, k] can be packed: fp32 or bf16 on CPU with n a multiple of PANEL."""
    return (weight.dim() >= 2 and weight.dtype in PANEL_DTYPES and weight.device.type == "cpu"
            and weight.shape[-2] % PANEL == 0)


class PackedWeight:
    """A weight [..., n, k] held as panels [..., n / PANEL, k, PANEL] for `linear_packed`: panel q holds output
    columns PANEL*q.. side by side for every input column, so the product broadcasts one x value against a whole
    panel (see linear.c). Stacked weights (MoE experts) pack each matrix on its own; index one out with [e]."""

    __slots__ = ("panels", "dense")

    def __init__(self, panels: torch.Tensor, dense: torch.Tensor | AmxWeight | None = None) -> None:
        self.panels = panels
        # The weight in bf16 as well, laid out for the product that runs a step's many rows faster than the panels
        # (engine/precision.py): in AMX tile order for ours (amx_weight.py), or unpacked [..., n, k] for PyTorch's
        # (a matrix in oneDNN's layout, onednn_weight.py; stacked matrices plain); None elsewhere.
        self.dense = dense

    @classmethod
    def pack(cls, weight: torch.Tensor, dtype: torch.dtype | None = None, dense: str | None = None) -> PackedWeight:
        """`weight` packed with panels in `dtype` (fp32 or bf16; default: the weight's own), and kept in bf16 for
        the many-row product `dense` too ('amx': in tile order where the shape allows, for oneDNN's otherwise;
        'onednn'; None: not). fp32 to bf16 rounds to nearest even, as `weight.to(torch.bfloat16)`."""
        dtype = dtype or weight.dtype
        if dense not in (None, *DENSE_PRODUCTS):
            raise ValueError(f"PackedWeight.pack: dense must be one of {DENSE_PRODUCTS} or None, got {dense!r}")
        if not packable(weight) or dtype not in PANEL_DTYPES:
            raise ValueError(f"PackedWeight.pack wants fp32 or bf16 CPU weights with rows a multiple of {PANEL}, "
                             f"packed as fp32 or bf16, got {tuple(weight.shape)} {weight.dtype} as {dtype}")
        *lead, n, k = weight.shape
        rounded = weight.to(dtype)  # before the copy that lays out the panels: no whole fp32 copy of a large matrix
        panels = rounded.reshape(*lead, n // PANEL, PANEL, k).transpose(-1, -2).contiguous()
        if dense is None:
            return cls(panels)
        if dense == "amx" and amx_weight.tileable(rounded):
            return cls(panels, amx_weight.pack(rounded))
        return cls(panels, onednn_weight.prepack(rounded.to(torch.bfloat16).contiguous()))

    @property
    def shape(self) -> tuple[int, ...]:
        """The unpacked shape [..., n, k]."""
        *lead, panels, k, width = self.panels.shape
        return (*lead, panels * width, k)

    @property
    def dtype(self) -> torch.dtype:
        """The panels' element type: torch.float32 or torch.bfloat16."""
        return self.panels.dtype

    @property
    def nbytes(self) -> int:
        if isinstance(self.dense, AmxWeight):
            return self.panels.nbytes + self.dense.nbytes
        return self.panels.nbytes + (onednn_weight.nbytes(self.dense) if self.dense is not None else 0)

    def __getitem__(self, index: int) -> PackedWeight:
        # Only a stacked weight is indexed, and stacked weights are never tiled (amx_weight.tileable).
        assert not isinstance(self.dense, AmxWeight)
        return PackedWeight(self.panels[index], self.dense[index] if self.dense is not None else None)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the unpacked matrix (an embedding lookup in a tied, packed LM head): row v is column
        v % PANEL of panel v // PANEL. fp32 whatever the panels hold: the hidden states they start are fp32."""
        return self.panels[ids // PANEL, :, ids % PANEL].float()
