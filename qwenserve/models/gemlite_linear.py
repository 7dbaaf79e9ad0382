"""W4A16 / W8A16 on CUDA through GemLite's Triton kernels (the `gemlite` package, in the gpu extra), used only where it
is installed and agrees with PyTorch on the device; elsewhere a CUDA engine dequantizes the checkpoint's codes into
its dtype at load, as before.

A linear weight the loader keeps as codes on CUDA is a `GemliteWeight`: GemLite's layer packed once from the unsigned
codes, zero points and scales (W = (codes - zeros) * scales, group by group: GemLite's `fma_mode=False`, the same
form as the dequantized weight). GPTQ's act-order checkpoints (groups that are not runs of consecutive inputs) are
packed with their inputs sorted by group, and the product gathers x's columns in that order first, as the CPU
kernel's QuantWeight does. Before GemLite is chosen, `gemlite_agrees` runs a small product through it and through
PyTorch on the dequantized weight: a release that fails or computes something else is logged and left out.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
from collections.abc import Callable

import torch

from qwenserve.models.ops import Ops

log = logging.getLogger(__name__)

BITS = (4, 8)
# GemLite's kernels read inputs in blocks of 32 and groups of at least 16 (GemLiteLinear's own checks).
MIN_BLOCK = 32
MIN_GROUP = 16
# How far the start-up case may be from PyTorch's product on the dequantized weight, relative to its scale: both
# accumulate in fp32, but GemLite dequantizes in the activations' 16-bit dtype.
CHECK_TOLERANCE = 2e-2


@functools.cache
def gemlite_available() -> bool:
    """True where CUDA runs and GemLite imports."""
    if not torch.cuda.is_available() or importlib.util.find_spec("gemlite") is None:
        return False
    try:
        import gemlite  # noqa: F401
    except Exception as exc:  # a broken install must not stop a server that can run without it
        log.warning("gemlite is installed but does not import (%s): quantized weights are dequantized at load", exc)
        return False
    return True


class GemliteWeight:
    """A weight [out_features, in_features] as GemLite's packed layer `layer`, its inputs in the order `perm` (None:
    their own). `nbytes`: what its codes, scales and zero points take on the device."""

    __slots__ = ("layer", "perm", "bits", "out_features", "in_features", "nbytes")

    def __init__(self, layer: torch.nn.Module, perm: torch.Tensor | None, bits: int, out_features: int,
                 in_features: int) -> None:
        self.layer, self.perm, self.bits = layer, perm, bits
        self.out_features, self.in_features = out_features, in_features
        self.nbytes = sum(t.numel() * t.element_size() for t in (layer.W_q, layer.scales, layer.zeros))

    @classmethod
    def pack(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int | None,
             groups: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> GemliteWeight:
        """The weight whose unsigned `codes` [n, k], `scales` and `zeros` [n, num_groups] make W = (codes - zeros) *
        scales (groups as QuantWeight.pack takes them), packed on `device` for activations of `dtype`. ValueError
        says what GemLite does not take; the caller then dequantizes instead."""
        from gemlite import DType, GemLiteLinear

        codes, scales, zeros, perm, group_size = sorted_by_group(codes, scales, zeros, bits, group_size, groups)
        n, k = codes.shape
        if k % MIN_BLOCK or group_size % MIN_BLOCK and group_size < k or group_size < MIN_GROUP:
            raise ValueError(f"GemLite takes inputs in multiples of {MIN_BLOCK} and groups of at least {MIN_GROUP}: "
                             f"{k} inputs in groups of {group_size}")
        kind = {torch.bfloat16: DType.BF16, torch.float16: DType.FP16}.get(dtype)
        if kind is None:
            raise ValueError(f"GemLite multiplies 16-bit activations, not {dtype}")
        layer = GemLiteLinear(bits, group_size=group_size, in_features=k, out_features=n, input_dtype=kind,
                              output_dtype=kind)
        layer.pack(codes.to(device=device, dtype=torch.uint8), scales.to(device=device, dtype=dtype),
                   zeros.to(device=device, dtype=dtype), bias=None, fma_mode=False)
        return cls(layer, None if perm is None else perm.to(device), bits, n, k)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [m, in_features] @ W.T, [m, out_features] in rows' dtype."""
        if self.perm is not None:
            rows = rows.index_select(1, self.perm)
        return self.layer(rows.contiguous())


def sorted_by_group(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                    group_size: int | None, groups: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """The codes with their inputs ordered so that each group is a run of `group_size` consecutive inputs: (codes,
    scales, zeros, perm, group_size), `perm` the order of x's columns the codes now follow (None: unchanged). W =
    (codes - zeros) * scales still holds for W's columns in `perm`'s order. ValueError where the groups are not all
    `group_size` inputs (the last may be shorter), or the codes do not fit `bits`."""
    if bits not in BITS:
        raise ValueError(f"GemLite's W4A16 / W8A16 take {' or '.join(map(str, BITS))}-bit codes, not {bits}-bit")
    n, k = codes.shape
    group_size = group_size or k
    num_groups = -(-k // group_size)
    if scales.shape != (n, num_groups) or zeros.shape != (n, num_groups):
        raise ValueError(f"scales and zeros must be [{n}, {num_groups}], got {tuple(scales.shape)} and "
                         f"{tuple(zeros.shape)}")
    if k % group_size:
        raise ValueError(f"GemLite's groups are whole: {k} inputs in groups of {group_size}")
    in_order = torch.arange(k) // group_size
    if groups is None or torch.equal(groups.long(), in_order):
        return codes, scales, zeros, None, group_size
    perm = torch.argsort(groups.long(), stable=True)
    if not torch.equal(groups.long()[perm], in_order):
        raise ValueError(f"act-order groups are not all {group_size} inputs")
    return codes[:, perm].contiguous(), scales, zeros, perm, group_size


def code_packer(device: torch.device, dtype: torch.dtype) -> Callable[..., GemliteWeight]:
    """GemliteWeight.pack for `device` and `dtype`, in QuantWeight.pack's signature (what the loader calls)."""
    return functools.partial(GemliteWeight.pack, device=device, dtype=dtype)


def with_gemlite_linears(ops: Ops, label: str) -> Ops:
    """`ops` whose `linear` multiplies GemliteWeights through GemLite (named `ops.name`+'+gemlite-'+`label`)."""
    base = ops.linear

    def linear(x: torch.Tensor, weight: object, bias: torch.Tensor | None = None, *args: object,
               **kwargs: object) -> torch.Tensor:
        if not isinstance(weight, GemliteWeight):
            return base(x, weight, bias, *args, **kwargs)
        y = weight(x.reshape(-1, x.shape[-1]))
        y = y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)
        return y if bias is None else y.add_(bias)

    return dataclasses.replace(ops, name=f"{ops.name}+gemlite-{label}", linear=linear)


@functools.cache
def gemlite_agrees(device: torch.device, dtype: torch.dtype, bits: int) -> bool:
    """Whether GemLite's product of `bits`-bit codes (with and without act order) matches PyTorch's on the
    dequantized weight on `device`, at one row and at 33, for inputs that are not a power of two (as Qwen's 3072)."""
    generator = torch.Generator().manual_seed(0)
    n, k, group_size = 96, 384, 64
    codes = torch.randint(0, 1 << bits, (n, k), generator=generator, dtype=torch.uint8)
    scales = torch.rand(n, k // group_size, generator=generator) * 0.02 + 0.001
    zeros = torch.randint(0, 1 << bits, (n, k // group_size), generator=generator).float()
    shuffled = (torch.arange(k) // group_size)[torch.randperm(k, generator=generator)]
    try:
        for groups in (None, shuffled):
            weight = GemliteWeight.pack(codes, scales, zeros, bits, group_size, groups, device, dtype)
            order = groups if groups is not None else torch.arange(k) // group_size
            dense = ((codes.float() - zeros[:, order]) * scales[:, order]).to(device=device, dtype=dtype)
            for m in (1, 33):
                x = torch.randn(m, k, generator=generator).to(device=device, dtype=dtype)
                ours = weight(x).float()
                want = (x.float() @ dense.float().T)
                error = float((ours - want).abs().max()) / max(float(want.abs().max()), 1e-6)
                if not error <= CHECK_TOLERANCE:
                    log.warning("GemLite's W%dA16 product is %.3g from PyTorch's (rows %d, act order %s): quantized "
                                "weights are dequantized at load", bits, error, m, groups is not None)
                    return False
    except Exception as exc:  # a release whose calls changed, or a GPU it has no kernels for
        log.warning("GemLite's W%dA16 product failed its start-up check (%s): quantized weights are dequantized at "
                    "load", bits, exc)
        return False
    return True
