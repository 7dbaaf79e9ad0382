"""Our bf16 product on AMX tiles (cpu_kernels/linear_amx.c, amx_weight.py): the tile layout, the product against
fp32 sums of the same bf16 values on odd shapes at every instruction-set level built here (the objects without AMX,
and CPUs without it, decline), and the packed product handing a step's many rows to it."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from qwenserve.cpu_kernels import amx_weight, builder, loader
from qwenserve.cpu_kernels.amx_weight import AmxWeight
from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.cpu_kernels.packed_weight import PackedWeight
from qwenserve.models.ops import cpu_kernel_ops

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="no C compiler")
BF16 = torch.bfloat16
AMX = "amx_bf16" in builder.cpu_flags()
AMX_OBJECTS = ("x86-64-v4", "x86-64-v4-bf16")  # the objects built with AMX tiles
# (n, k): n not a multiple of 32 (a half strip of zero columns), one k-block, several, the 0.6B's down projection;
# inputs so wide that a work item covers 64 rows of x, and only 32 (linear_amx.c's X_BLOCK_BYTES of them); whole
# strips only, whose bf16 rows are streamed around the caches.
SHAPES = [(16, 32), (48, 64), (80, 96), (1040, 1024), (48, 8192), (16, 33792), (96, 64), (1024, 2048)]
ROWS = (1, 15, 16, 17, 31, 33, 70, 300)


def fp32_sums_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What fp32 summation of k exact bf16 x bf16 products may be off by, in any order: k * 2^-24 * sum |x w|."""
    return x.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().T) + 1e-30


def test_tile_order_round_trips_and_pads_to_whole_strips() -> None:
    gen = torch.Generator().manual_seed(1)
    for n, k in (*SHAPES, (16, 64)):
        weight = torch.randn(n, k, generator=gen)
        packed = amx_weight.pack(weight)
        assert packed.shape == (n, k) and packed.tiles.dtype == BF16
        assert packed.tiles.numel() == -(-n // 32) * 32 * k  # padded to strips of 32 columns
        assert torch.equal(amx_weight.unpack(packed), weight.to(BF16))
    # One tile row holds input pairs of 16 columns: element (column c, inputs 2p, 2p + 1) of the first B tile.
    weight = (torch.arange(32 * 32) % 251).float().reshape(32, 32)  # exact in bf16
    tiles = amx_weight.pack(weight).tiles.reshape(2, 16, 16, 2)
    assert tiles[0, 3, 5].tolist() == [weight[5, 6].item(), weight[5, 7].item()]
    assert tiles[1, 0, 2].tolist() == [weight[18, 0].item(), weight[18, 1].item()]
    assert not amx_weight.tileable(torch.zeros(32, 40)) and not amx_weight.tileable(torch.zeros(2, 32, 32))
    with pytest.raises(ValueError, match="multiple of 32"):
        amx_weight.pack(torch.zeros(32, 40))


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_product_is_the_fp32_sum_of_the_bf16_products(threads: int,
                                                          variant_kernels: dict[str, CpuKernels]) -> None:
    """bf16 x times the tiles: fp32 sums of exact products (within fp32 summation's bound), the bf16 result that
    sum rounded once; rows may be a strided view. Objects without AMX, or a CPU without it, decline (None)."""
    gen = torch.Generator().manual_seed(7)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, kernels in variant_kernels.items():
            runs = AMX and name in AMX_OBJECTS
            for n, k in SHAPES:
                weight = torch.randn(n, k, generator=gen).to(BF16)
                tiles = amx_weight.pack(weight)
                for rows in ROWS:
                    wide = torch.randn(rows, k + 32, generator=gen).to(BF16)
                    x = wide[:, 16 : 16 + k]  # rows 2 (k + 32) bytes apart
                    fp32 = kernels.linear_bf16_amx(x, tiles, torch.full((rows, n), float("nan")))
                    if not runs:
                        assert fp32 is None, name
                        continue
                    assert fp32 is not None
                    exact = x.double() @ weight.double().T
                    worst = ((fp32.double() - exact).abs() / fp32_sums_bound(x, weight)).max().item()
                    assert worst <= 1.0, f"{name} rows={rows} n={n} k={k}: {worst:.2f}x the bound"
                    rounded = kernels.linear_bf16_amx(x, tiles)
                    assert rounded is not None and rounded.dtype == BF16 and rounded.shape == (rows, n)
                    assert torch.equal(rounded, fp32.to(BF16)), f"{name} rows={rows} n={n} k={k}"
            if runs:
                empty = kernels.linear_bf16_amx(torch.empty(0, 64, dtype=BF16), amx_weight.pack(torch.zeros(32, 64)))
                assert empty is not None and empty.shape == (0, 32)
                with pytest.raises(ValueError, match="x must be"):
                    kernels.linear_bf16_amx(torch.zeros(3, 32, dtype=BF16), amx_weight.pack(torch.zeros(32, 64)))
    finally:
        torch.set_num_threads(previous)
    if not AMX:
        pytest.skip("this CPU has no AMX-BF16: only the declining was checked")


def test_the_packed_product_hands_many_rows_to_the_amx_tiles() -> None:
    """With the AMX product chosen: weights whose inputs tile are kept in tile order, others for oneDNN; from the
    dense rows up a step's rows go to the tiles (bf16 out for bf16 rows, fp32 logits written into their buffer),
    below them to the bf16 panels. Where the kernel declines (no AMX here) the panels take every row count."""
    kernels = loader.load()
    if kernels is None:
        pytest.skip("no CPU kernels here")
    gen = torch.Generator().manual_seed(11)
    ops = cpu_kernel_ops(kernels, BF16, BF16, dense_rows=4, dense_product="amx")
    assert ops.name == "cpu_kernels+bf16_weights+bf16_activations+amx>=4+bf16_layer"
    model = torch.nn.Module()
    weight = torch.randn(80, 96, generator=gen).to(BF16)
    model.gate_up_proj = torch.nn.Parameter(weight.clone(), requires_grad=False)
    model.down_proj = torch.nn.Parameter(torch.randn(16, 37, generator=gen).to(BF16), requires_grad=False)
    assert ops.prepare(model) == 2
    tiled, plain = model.gate_up_proj, model.down_proj
    assert isinstance(tiled, PackedWeight) and isinstance(tiled.dense, AmxWeight)
    assert isinstance(plain, PackedWeight) and not isinstance(plain.dense, AmxWeight)  # 37 inputs: no tiles
    assert tiled.nbytes == tiled.panels.nbytes + tiled.dense.nbytes
    many = torch.randn(2, 5, 96, generator=gen).to(BF16)  # ten rows
    exact = many.double() @ weight.double().T
    y = ops.linear(many, tiled)
    assert y.dtype == BF16 and y.shape == (2, 5, 80)
    torch.testing.assert_close(y.double(), exact.to(BF16).double(), rtol=0.01, atol=0.02)
    logits = torch.empty(10, 80)
    out = ops.logits(many.reshape(10, 96), tiled, logits)
    torch.testing.assert_close(out.double(), exact.reshape(10, 80), rtol=1e-5, atol=1e-4)
    if AMX:
        assert out.data_ptr() == logits.data_ptr()  # written in place: no fresh logits every step
    few = torch.randn(3, 96, generator=gen).to(BF16)
    torch.testing.assert_close(ops.linear(few, tiled).float(), (few.float() @ weight.float().T).to(BF16).float(),
                               rtol=0, atol=0.02)
    odd = torch.randn(6, 37, generator=gen).to(BF16)
    torch.testing.assert_close(ops.linear(odd, plain), F.linear(odd, model.down_proj.dense.to_dense()
                                                                if model.down_proj.dense.is_mkldnn
                                                                else model.down_proj.dense))
