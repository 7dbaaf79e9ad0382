"""W4A16 / W8A16: a linear weight kept as 4- or 8-bit codes with a scale and a zero point per output column and group
of inputs (QuantWeight), multiplied by linear_quant.c without dequantizing it in memory. At every instruction-set
level this CPU runs, the product equals x times the dequantized weight (PyTorch's dequantize-then-multiply) up to
fp32 summation order, on odd shapes, group sizes 32/64/128 and one group per column, and act-order groups."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
import torch

from qwenserve.cpu_kernels import builder, loader
from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.cpu_kernels.quant_weight import QuantWeight

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="no C compiler: the kernels cannot be built here")

# Rows: decode's few (the 4-row tiles: 1, 3) and more than a tile (17: the 8-row tiles and a tail of 1).
ROWS = (1, 3, 17)
# (k, n): k odd (a 4-bit pair split at the end) and not a multiple of the group size, n not a multiple of a panel
# (16) or of a strip (4 panels): the last panel's padded columns are dropped.
SHAPES = ((37, 129), (200, 48), (257, 33))
GROUP_SIZES = (32, 64, 128, None)  # None: one group (compressed-tensors' channel strategy)


@pytest.fixture(scope="module")
def variant_kernels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, CpuKernels]]:
    """Every variant this CPU runs, built into a folder of their own and each opened explicitly, by name."""
    folder = tmp_path_factory.mktemp("variants")
    built = set(builder.build_variants(folder))
    opened = {}
    for variant in builder.supported_variants():
        path = builder.variant_path(variant, folder)
        assert path in built, f"{variant.name} did not build"
        lib = loader._open(path, "test")
        assert lib is not None, f"{variant.name} did not load"
        opened[variant.name] = CpuKernels(lib, variant.name)
    yield opened


def random_quantized(n: int, k: int, bits: int, group_size: int | None,
                     gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes over the whole range, scales of either sign and zero points anywhere in the range (and beyond, as
    GPTQ's v1 format's +1 makes them)."""
    groups = -(-k // (group_size or k))
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen)
    scales = (torch.rand(n, groups, generator=gen) - 0.3) * 0.1
    zeros = torch.randint(0, (1 << bits) + 1, (n, groups), generator=gen).float()
    return codes, scales, zeros


def dequantized(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """The reference: (codes - zeros) * scales with input i in group groups[i], in fp32."""
    return (codes.float() - zeros[:, groups]) * scales[:, groups]


def summation_bound(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    groups: torch.Tensor) -> torch.Tensor:
    """How far two fp32 sums of the same k products may differ by their order alone, 4 sqrt(k) u (|x|·|W|ᵀ), with
    the kernel's sums over codes and zero points apart (it subtracts z · sum(x) per group) both counted. A kernel
    that mixed up a group, a zero point or a column misses by orders of magnitude more."""
    k = x.shape[1]
    terms = (codes.float().abs() + zeros[:, groups].abs()) * scales[:, groups].abs()
    return 4 * k**0.5 * 2.0**-24 * (x.abs() @ terms.T) + 1e-30


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("variant", [v.name for v in builder.machine_variants()])
def test_every_variant_multiplies_the_codes_as_the_dequantized_weight(
        variant: str, bits: int, threads: int, variant_kernels: dict[str, CpuKernels]) -> None:
    if variant not in variant_kernels:
        pytest.skip(f"this CPU cannot run {variant}")
    kernels = variant_kernels[variant]
    gen = torch.Generator().manual_seed(30 + bits)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k, n in SHAPES:
            for group_size in GROUP_SIZES:
                codes, scales, zeros = random_quantized(n, k, bits, group_size, gen)
                groups = torch.arange(k) // (group_size or k)
                weight = QuantWeight.pack(codes, scales, zeros, bits, group_size)
                reference = dequantized(codes, scales, zeros, groups)
                for rows in ROWS:
                    x = torch.randn(rows, k, generator=gen)
                    y = kernels.linear_quant(x, weight)
                    error = (y.double() - x.double() @ reference.double().T).abs()
                    worst = (error / summation_bound(x, codes, scales, zeros, groups)).max().item()
                    assert worst <= 1.0, (f"{variant} {bits}-bit rows={rows} k={k} n={n} group={group_size}: "
                                          f"{worst:.2f}x the summation bound")
    finally:
        torch.set_num_threads(previous)


@needs_compiler
@pytest.mark.parametrize("bits", [4, 8])
def test_act_order_groups_are_multiplied_in_the_checkpoints_column_order(bits: int) -> None:
    """GPTQ's desc_act: input i's group is g_idx[i], runs of group_size inputs in a shuffled order. The codes are
    packed sorted by group and x's columns gathered in that order, so the product is still x · Wᵀ."""
    kernels = loader.load()
    assert kernels is not None
    gen = torch.Generator().manual_seed(3)
    k, n, group_size = 96, 40, 32
    codes, scales, zeros = random_quantized(n, k, bits, group_size, gen)
    groups = (torch.arange(k) // group_size)[torch.randperm(k, generator=gen)]
    weight = QuantWeight.pack(codes, scales, zeros, bits, group_size, groups=groups)
    assert weight.perm is not None
    reference = dequantized(codes, scales, zeros, groups)
    assert torch.equal(weight.dequantize(), reference)
    x = torch.randn(5, k, generator=gen)
    error = (kernels.linear_quant(x, weight).double() - x.double() @ reference.double().T).abs()
    assert (error / summation_bound(x, codes, scales, zeros, groups)).max().item() <= 1.0
    # Groups in order need no gather.
    assert QuantWeight.pack(codes, scales, zeros, bits, group_size, groups=torch.arange(k) // group_size).perm is None


def test_packing_keeps_every_code_scale_and_zero_point() -> None:
    """dequantize() and rows() (a tied, quantized LM head's embeddings) give back (codes - zeros) * scales exactly,
    and the codes take half a byte (4-bit) or a byte (8-bit) per weight, the last panel padded to 16 columns."""
    gen = torch.Generator().manual_seed(5)
    for bits in (4, 8):
        codes, scales, zeros = random_quantized(33, 37, bits, 32, gen)
        weight = QuantWeight.pack(codes, scales, zeros, bits, 32)
        reference = dequantized(codes, scales, zeros, torch.arange(37) // 32)
        assert weight.shape == (33, 37)
        assert torch.equal(weight.dequantize(), reference)
        ids = torch.tensor([32, 0, 17, 17])
        assert torch.equal(weight.rows(ids), reference[ids])
        assert weight.codes.nbytes == 48 * (19 if bits == 4 else 37)


def test_what_does_not_fit_the_layout_is_refused() -> None:
    gen = torch.Generator().manual_seed(6)
    codes, scales, zeros = random_quantized(16, 64, 4, 32, gen)
    with pytest.raises(ValueError, match="4 or 8-bit"):
        QuantWeight.pack(codes, scales, zeros, 3, 32)
    with pytest.raises(ValueError, match=r"outside \[0, 16\)"):
        QuantWeight.pack(codes + 1, scales, zeros, 4, 32)
    with pytest.raises(ValueError, match="must be"):
        QuantWeight.pack(codes, scales[:, :1], zeros, 4, 32)
    with pytest.raises(ValueError, match="splits a pair"):
        QuantWeight.pack(codes, torch.ones(16, 3), torch.zeros(16, 3), 4, 31)
    uneven = torch.cat([torch.zeros(20), torch.ones(12), torch.full((16,), 2), torch.full((16,), 3)]).long()
    with pytest.raises(ValueError, match="not runs of 16"):  # groups of 20 and 12 inputs
        QuantWeight.pack(codes, torch.ones(16, 4), torch.zeros(16, 4), 4, 16, groups=uneven)
    weight = QuantWeight.pack(codes, scales, zeros, 4, 32)
    weight.scales = weight.scales[:, :1].contiguous()
    with pytest.raises(ValueError, match="scales must be"):
        weight.check()


@needs_compiler
def test_the_product_refuses_wrong_dtypes_and_shapes() -> None:
    kernels = loader.load()
    assert kernels is not None
    gen = torch.Generator().manual_seed(8)
    weight = QuantWeight.pack(*random_quantized(32, 8, 8, None, gen), 8, None)
    with pytest.raises(ValueError, match="contiguous fp32"):
        kernels.linear_quant(torch.randn(2, 8).to(torch.bfloat16), weight)
    with pytest.raises(ValueError, match=r"x must be \[m, 8\]"):
        kernels.linear_quant(torch.randn(2, 9), weight)
    with pytest.raises(ValueError, match="out must have shape"):
        kernels.linear_quant(torch.randn(2, 8), weight, out=torch.empty(2, 31))
    weight.codes = weight.codes.transpose(0, 1)
    with pytest.raises(ValueError, match="codes must be"):
        kernels.linear_quant(torch.randn(2, 8), weight)
