"""The W4A16 / W8A16 product in a model's ops: a linear weight the loader kept as 4- or 8-bit codes (a `QuantWeight`,
engine/quantization/kept.py) is multiplied by the C kernel without being dequantized; every other weight goes to the
ops' own product. Activations reach the kernel in fp32 whatever the model's dtype (it widens codes to fp32 and
accumulates there), and leave in the model's dtype."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.cpu_kernels.quant_weight import QuantWeight
from qwenserve.models.ops import Ops


def with_quantized_linears(ops: Ops, kernels: CpuKernels, label: str) -> Ops:
    """`ops` whose `linear` multiplies QuantWeights in `kernels` (named `ops.name`+`label`, e.g. '+w4a16')."""
    return dataclasses.replace(ops, name=f"{ops.name}+{label}", linear=_quantized_or(ops.linear, kernels))


def _quantized_or(base: Callable[..., torch.Tensor], kernels: CpuKernels) -> Callable[..., torch.Tensor]:
    def linear(x: torch.Tensor, weight: object, bias: torch.Tensor | None = None, *args: object,
               **kwargs: object) -> torch.Tensor:
        if not isinstance(weight, QuantWeight):
            return base(x, weight, bias, *args, **kwargs)
        y = kernels.linear_quant(x.reshape(-1, x.shape[-1]).float().contiguous(), weight)
        y = y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)
        return y if bias is None else y.add_(bias)

    return linear
