"""A linear layer's weight packed in panels of PANEL output columns, the layout linear.c's product reads."""

from __future__ import annotations

import torch

PANEL = 16  # output columns per panel of a packed weight (linear.c's PANEL)


def packable(weight: torch.Tensor) -> bool:
    """Whether `weight` [..., n, k] can be packed: fp32 on CPU with n a multiple of PANEL."""
    return (weight.dim() >= 2 and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.shape[-2] % PANEL == 0)


class PackedWeight:
    """A weight [..., n, k] held as panels [..., n / PANEL, k, PANEL] for `linear_packed`: panel q holds output
    columns PANEL*q.. side by side for every input column, so the product broadcasts one x value against a whole
    panel (see linear.c). Stacked weights (MoE experts) pack each matrix on its own; index one out with [e]."""

    __slots__ = ("panels",)

    def __init__(self, panels: torch.Tensor) -> None:
        self.panels = panels

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedWeight:
        if not packable(weight):
            raise ValueError(f"PackedWeight.pack wants fp32 CPU weights with rows a multiple of {PANEL}, got "
                             f"{tuple(weight.shape)} {weight.dtype}")
        *lead, n, k = weight.shape
        return cls(weight.reshape(*lead, n // PANEL, PANEL, k).transpose(-1, -2).contiguous())

    @property
    def shape(self) -> tuple[int, ...]:
        """The unpacked shape [..., n, k]."""
        *lead, panels, k, width = self.panels.shape
        return (*lead, panels * width, k)

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes

    def __getitem__(self, index: int) -> PackedWeight:
        return PackedWeight(self.panels[index])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the unpacked matrix (an embedding lookup in a tied, packed LM head): row v is column
        v % PANEL of panel v // PANEL."""
        return self.panels[ids // PANEL, :, ids % PANEL]
