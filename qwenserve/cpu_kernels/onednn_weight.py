"""A bf16 weight in oneDNN's own blocked layout, reordered once at load, and its product.

PyTorch's `F.linear` on a plain bf16 weight reorders the weight into that layout at every call: for Qwen3-0.6B's
decoder linears on this project's Xeon (2 threads) a whole pass took 58 ms at 32 rows against 46 ms prepacked, and
2.1 s against 0.93 s at 2,048 rows; the results are the same bits. The layout is chosen for a row count: one chosen
for 512 rows ran every row count from 1 to 2,048 as fast as or faster than `F.linear`, where one chosen for 32 rows
ran 512 rows three times slower."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The row count oneDNN chooses the layout for (see above).
LAYOUT_ROWS = 512


def reorders() -> bool:
    """Whether oneDNN here holds bf16 weights in its own layout: it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT (an
    AVX2-only CPU has neither, and F.linear then runs on the plain weight)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [n, k] bf16 in oneDNN's layout for `linear`, or as it is where PyTorch cannot reorder it (no oneDNN
    in this build or no bf16 in it on this CPU, a stacked weight)."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or not reorders():
        return weight
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, LAYOUT_ROWS)
    except (RuntimeError, AttributeError):
        return weight


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x · weightᵀ in bf16 for a weight from `prepack` (x bf16, any leading dimensions)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)


def nbytes(weight: torch.Tensor) -> int:
    """The bytes a weight from `prepack` holds (an oneDNN tensor has no storage to ask)."""
    return weight.numel() * weight.element_size() if weight.is_mkldnn else weight.nbytes
