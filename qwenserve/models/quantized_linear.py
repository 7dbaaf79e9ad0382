"""The W4A16 / W8A16 product in a model's ops: a linear weight the loader kept as 4- or 8-bit codes (a `QuantWeight`,
engine/quantization/kept.py) is multiplied by the C kernel without being dequantized; every other weight goes to the
ops' own product. Activations reach the kernel in fp32 whatever the model's dtype (it widens codes to fp32 and
accumulates there), and leave in the model's dtype. From `bf16_rows` rows up (where x is bf16 already, or the
engine's precision rounds it for bf16 products: Precision.dense_rows) and at least AMX_MIN_ROWS, 4- and 8-bit weights run
on AMX tiles where the CPU has them, x rounded to bf16 (several times the fp32 kernel's rate at 16 rows and more;
linear_quant.c)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from qwenserve.cpu_kernels.builder import cpu_flags
from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.cpu_kernels.quant_weight import QuantWeight
from qwenserve.models.ops import Ops

# Fewer rows than this stay on linear_quant even where bf16 products are allowed: AMX's fixed cost of widening the
# codes to tiles is more than the few-row kernel's whole product there. 8-bit codes: the fp32 kernel took 0.3 against
# AMX's 0.8 ms at one row, on par at 8 (Qwen3-0.6B's 1024 x 6144, one core of this project's Xeon). 4-bit codes, whose
# few rows run 16-bit integer dot products: the model's 28 layers of 4-bit linears on two cores, 31-34 against 41-51
# ms at 8 rows, 43-47 against 43-53 at 12, 57-60 against 52-61 at 16, 96 against 51 at 32.
AMX_MIN_ROWS = {"w4a16": 16, "w8a16": 8}


def with_quantized_linears(ops: Ops, kernels: CpuKernels, label: str, bf16_rows: int | None = None) -> Ops:
    """`ops` whose `linear` multiplies QuantWeights in `kernels` (named `ops.name`+`label`, e.g. '+w4a16'), products
    of at least `bf16_rows` rows (None: none) with x rounded to bf16 on AMX where it runs."""
    amx_rows = max(bf16_rows, AMX_MIN_ROWS.get(label, 0)) if bf16_rows is not None else None
    name = f"{ops.name}+{label}" + (f"+amx>={amx_rows}" if amx_from(label, bf16_rows) else "")
    return dataclasses.replace(ops, name=name, linear=_quantized_or(ops.linear, kernels, amx_rows))


def amx_from(label: str, bf16_rows: int | None) -> int | None:
    """From how many rows a product of `label`'s codes runs on AMX tiles on this CPU (None: never)."""
    if bf16_rows is None or label not in ("w4a16", "w8a16") or "amx_bf16" not in cpu_flags():
        return None
    return max(bf16_rows, AMX_MIN_ROWS[label])


def _quantized_or(base: Callable[..., torch.Tensor], kernels: CpuKernels,
                  amx_rows: int | None) -> Callable[..., torch.Tensor]:
    def linear(x: torch.Tensor, weight: object, bias: torch.Tensor | None = None, *args: object,
               **kwargs: object) -> torch.Tensor:
        if not isinstance(weight, QuantWeight):
            return base(x, weight, bias, *args, **kwargs)
        rows = x.reshape(-1, x.shape[-1]).float().contiguous()
        y = None
        if amx_rows is not None and rows.shape[0] >= amx_rows:
            y = kernels.linear_quant_amx(rows, weight)
        if y is None:
            y = kernels.linear_quant(rows, weight)
        y = y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)
        return y if bias is None else y.add_(bias)

    return linear
