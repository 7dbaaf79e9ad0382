"""The LM head as 8-bit codes (`--quantize-lm-head int8`): quantized once at load, in groups of GROUP inputs with a
scale and a zero point per vocabulary row and group, multiplied by the W8A16 kernel (linear_quant.c), and, where the
head is the tied embedding table, looked up from the same codes.

A single stream's decode step reads the whole head: Qwen3-0.6B's is 151,936 x 1,024, 311 MB in bf16 against 220 MB
for all its decoder layers in 4 bits, so behind a W4A16 decode the head is most of a step. 8-bit codes read half of
that. It is a change of the model, not of its checkpoint (none of Qwen's quantized checkpoints quantizes the head):
logits move by the rounding of 1/255 of each group's range, which is why it is asked for, never chosen."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.cpu_kernels.packed_weight import PANEL
from qwenserve.cpu_kernels.quant_weight import QuantWeight
from qwenserve.models.ops import Ops

BITS = 8
GROUP = 128
HEAD = "lm_head"
# Rows quantized together: their fp32 temporaries stay in cache (Qwen3-0.6B's head in 2.1 s at 8,192, 0.8 s at 2,048).
ROWS_AT_ONCE = 2048

log = logging.getLogger(__name__)


def quantize_rows(weight: torch.Tensor, bits: int = BITS, group: int = GROUP) -> QuantWeight:
    """`weight` [n, k] as unsigned codes with a scale and zero point per row and group (the last group may be
    shorter): each group's minimum and maximum span the codes, the zero point rounded to a code, the scale an fp16."""
    n, k = weight.shape
    groups = -(-k // group)
    codes = torch.empty(n, k, dtype=torch.uint8)
    scales = torch.empty(n, groups)
    zeros = torch.empty(n, groups)
    for chunk in quantized_chunks(weight, bits, group):
        rows = slice(chunk.first, chunk.first + chunk.codes.shape[0])
        codes[rows] = chunk.codes.view(chunk.codes.shape[0], -1)[:, :k].to(torch.uint8)
        scales[rows], zeros[rows] = chunk.scales, chunk.zeros
    return QuantWeight.pack(codes, scales, zeros, bits, group)


@dataclass(frozen=True)
class QuantizedChunk:
    """Rows [first, first + r) of a weight quantized by `quantized_chunks`: the rows in fp32 `values` and their codes
    (as fp32 integers) [r, groups, group] (the last group padded with zeros, which its codes hold exactly), `scales`
    and `zeros` [r, groups]."""

    first: int
    values: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor


def quantized_chunks(weight: torch.Tensor, bits: int = BITS, group: int = GROUP) -> Iterator[QuantizedChunk]:
    """`weight` [n, k] quantized as `quantize_rows` does, ROWS_AT_ONCE rows at a time."""
    n, k = weight.shape
    groups = -(-k // group)
    top = (1 << bits) - 1
    for r0 in range(0, n, ROWS_AT_ONCE):
        rows = weight[r0:r0 + ROWS_AT_ONCE].float()
        padded = torch.nn.functional.pad(rows, (0, groups * group - k))
        by_group = padded.view(rows.shape[0], groups, group)
        # Padding is 0, inside every group's span anyway once 0 is kept representable (below).
        low = by_group.amin(-1).clamp(max=0.0)
        high = by_group.amax(-1).clamp(min=0.0)
        # The scale rounded up to an fp16 (what the kernels read): the span still fits in `top` steps.
        scale = torch.where(high > low, _fp16_at_least((high - low) / top), torch.ones_like(high))
        zero = (-low / scale).round().clamp(0, top)
        q = (by_group / scale[..., None] + zero[..., None]).round_().clamp_(0, top)
        yield QuantizedChunk(r0, by_group, q, scale, zero)


def with_quantized_head(ops: Ops, kernels: CpuKernels, dtype: torch.dtype, amx_rows: int | None = None) -> Ops:
    """`ops` whose weight preparation also quantizes the model's LM head (where its rows are a multiple of the
    kernels' panel), whose logits multiply it by the W8A16 kernel (from `amx_rows` rows up on AMX tiles, x rounded
    to bf16: a 32-request step's head on the fp32 kernel took 25 ms more than on oneDNN's bf16 AMX product), and
    whose embedding looks rows up from it (in the model's `dtype`) when tied."""
    name = f"{ops.name}+head_w{BITS}" + (f"+amx>={amx_rows}" if amx_rows is not None else "")
    return dataclasses.replace(ops, name=name, prepare=_quantizing_head(ops.prepare),
                               logits=_head_logits(ops.logits, kernels, amx_rows),
                               embedding=_head_embedding(ops.embedding, dtype))


def _quantizing_head(prepare: Callable[[nn.Module], int]) -> Callable[[nn.Module], int]:
    def quantize_then_prepare(model: nn.Module) -> int:
        done = 0
        for module in model.modules():
            param = module._parameters.get(HEAD)
            if param is None or param.dim() != 2 or param.shape[0] % PANEL:
                continue
            start, plain = time.perf_counter(), module._parameters.pop(HEAD).data
            head = quantize_rows(plain)
            log.info("LM head as %d-bit codes (--quantize-lm-head): %.1f MB, %.1f MB in %s, in %.1f s", BITS,
                     head.nbytes / 1e6, plain.nbytes / 1e6, str(plain.dtype).removeprefix("torch."),
                     time.perf_counter() - start)
            setattr(module, HEAD, head)  # a plain attribute, as packed weights are
            done += 1
        return done + prepare(model)

    return quantize_then_prepare


def _head_logits(logits: Callable[..., torch.Tensor], kernels: CpuKernels,
                 amx_rows: int | None) -> Callable[..., torch.Tensor]:
    def head_logits(x: torch.Tensor, weight: object, out: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(weight, QuantWeight):
            return logits(x, weight, out)
        rows = x.reshape(-1, x.shape[-1]).float().contiguous()
        into = out if x.dim() == 2 else None
        y = None
        if amx_rows is not None and rows.shape[0] >= amx_rows:
            y = kernels.linear_quant_amx(rows, weight, into)
        if y is None:
            y = kernels.linear_quant(rows, weight, into)
        return y.view(*x.shape[:-1], y.shape[-1])

    return head_logits


def _head_embedding(embedding: Callable[..., torch.Tensor], dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    def head_embedding(table: object, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(table, QuantWeight):
            return embedding(table, ids)
        return table.rows(ids.reshape(-1)).to(dtype).view(*ids.shape, -1)

    return head_embedding


def _fp16_at_least(t: torch.Tensor) -> torch.Tensor:
    """Each value of `t` (> 0) as the smallest fp16 not below it, in fp32."""
    half = t.to(torch.float16)
    below = half.float() < t
    half[below] = torch.nextafter(half[below], torch.tensor(float("inf"), dtype=torch.float16))
    return half.float()
