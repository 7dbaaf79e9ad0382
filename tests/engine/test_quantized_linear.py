"""W4A16 / W8A16: a linear weight kept as 4- or 8-bit codes with a scale and a zero point per output column and group
of inputs (QuantWeight), multiplied by linear_quant.c without dequantizing it in memory. At every instruction-set
level this CPU runs, the product equals x times the dequantized weight (PyTorch's dequantize-then-multiply) up to
fp32 summation order, on odd shapes, group sizes 32/64/128 and one group per column, and act-order groups."""

from __future__ import annotations

import dataclasses
import itertools
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from qwenserve.cpu_kernels import builder, loader
from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.cpu_kernels.quant_weight import QuantWeight
from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.kernels import select_kernels
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.engine.weights import load_checkpoint
from qwenserve.models import ModelConfig, model_class
from qwenserve.models.quantized_linear import AMX_MIN_ROWS
from tests.support import quantized_checkpoints as qc
from tests.support.checkpoints import tiny_checkpoint
from tests.support.engine_checkpoints import load_reference, random_prompts, reference_greedy

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="no C compiler: the kernels cannot be built here")

# Rows: decode's few (the 4-row tiles: 1, 3; 1 and 2 the byte dot products of the AVX512_VNNI object) and more than
# a tile (17: the 8-row tiles and a tail of 1). Rows of bf16 values take the 16-bit integer dot products at 4 bits in
# the AVX2 and AVX-512 objects.
ROWS = (1, 2, 3, 17)
# (k, n): k odd (a 4-bit word part empty at the end) and not a multiple of the group size, n not a multiple of a panel
# (16) or of a strip (4 panels): the last panel's padded columns are dropped.
SHAPES = ((37, 129), (200, 48), (257, 33))
GROUP_SIZES = (32, 64, 128, None)  # None: one group (compressed-tensors' channel strategy)


def random_quantized(n: int, k: int, bits: int, group_size: int | None,
                     gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes over the whole range, scales of either sign and zero points anywhere in the range (and beyond, as
    GPTQ's v1 format's +1 makes them)."""
    groups = -(-k // (group_size or k))
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen)
    scales = (torch.rand(n, groups, generator=gen) - 0.3) * 0.1
    scales.view(-1)[::7] *= 2**-12  # some below fp16's normal range: the kernels widen subnormals too
    scales = scales.half().float()  # a checkpoint's 16-bit scales
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


def fixed_point_bound(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, k: int,
                      group_size: int | None) -> torch.Tensor:
    """What writing bf16 rows as 16-bit integers in blocks (linear_quant.c's dot products: 32 inputs a block from
    each group's start, a block's largest |x| scaled into [2^14, 2^15)) may add: half a unit of each block, 2^(e-16)
    for a largest value in [2^(e-1), 2^e), times |code| |s| (the zero points multiply x's exact sums)."""
    group = group_size or k
    half_unit = torch.zeros_like(x)
    for start in range(0, k, group):
        for lo in range(start, min(start + group, k), 32):
            hi = min(lo + 32, start + group, k)
            largest = x[:, lo:hi].abs().amax(dim=1)
            _, exponent = torch.frexp(largest)
            half_unit[:, lo:hi] = torch.where(largest > 0, torch.ldexp(torch.ones_like(largest), exponent - 16),
                                              torch.zeros_like(largest))[:, None]
    groups = torch.arange(k) // group
    return half_unit.double() @ (codes.double().abs() * scales[:, groups].double().abs()).T


def with_outliers(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """x with one value in every eighth input made 1000 times larger (as an LLM's activations have a few), so that
    the 16-bit blocks holding one round their small values."""
    x = x.clone()
    x[:, ::8] *= torch.where(torch.rand(x.shape[0], x[:, ::8].shape[1], generator=gen) < 0.3, 1000.0, 1.0)
    return x


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
                for rows, bf16, outliers in itertools.product(ROWS, (False, True), (False, True)):
                    x = torch.randn(rows, k, generator=gen)
                    x = with_outliers(x, gen) if outliers else x
                    # bf16 values at 4 bits: the AVX2 and AVX-512 objects' dot products hold them as 16-bit
                    # integers in blocks (fixed_point_bound); the baseline's fp32 tiles multiply them exactly.
                    x = x.to(torch.bfloat16).float() if bf16 else x
                    y = kernels.linear_quant(x, weight)
                    error = (y.double() - x.double() @ reference.double().T).abs()
                    bound = summation_bound(x, codes, scales, zeros, groups)
                    if bf16 and bits == 4 and variant.startswith(("x86-64-v4", "x86-64-v3")):
                        bound = bound + fixed_point_bound(x, codes, scales, k, group_size)
                    worst = (error / bound).max().item()
                    assert worst <= 1.0, (f"{variant} {bits}-bit rows={rows} k={k} n={n} group={group_size} "
                                          f"bf16 x={bf16} outliers={outliers}: {worst:.2f}x the bound")
    finally:
        torch.set_num_threads(previous)


@needs_compiler
def test_the_byte_dot_products_equal_the_16_bit_pair_products_bit_for_bit(variant_kernels: dict[str, CpuKernels]) -> None:
    """One or two bf16 rows at 4 bits: AVX512_VNNI's object splits x's 16-bit integers into bytes (vpdpbusd), the
    AVX-512 object multiplies them as pairs; both sum the same integers, so their results are the same bits."""
    if not {"x86-64-v4-bf16", "x86-64-v4"} <= variant_kernels.keys():
        pytest.skip("this CPU cannot run both AVX-512 objects")
    gen = torch.Generator().manual_seed(29)
    for k, n in (*SHAPES, (1024, 192), (3072, 64)):
        for group_size in (32, 128, None):
            weight = QuantWeight.pack(*random_quantized(n, k, 4, group_size, gen), 4, group_size)
            for rows in (1, 2):
                x = with_outliers(torch.randn(rows, k, generator=gen), gen).to(torch.bfloat16).float()
                got, want = (variant_kernels[v].linear_quant(x, weight) for v in ("x86-64-v4-bf16", "x86-64-v4"))
                assert torch.equal(got, want), f"rows={rows} k={k} n={n} group={group_size}"


@needs_compiler
def test_tiny_bf16_rows_stay_finite_and_near_the_reference(variant_kernels: dict[str, CpuKernels]) -> None:
    """A 16-bit block whose largest |x| is below 2^-112 is scaled as one of 2^-112 (its scale 2^(15 - e) would
    overflow fp32): held to 2^-126, never inf or NaN."""
    gen = torch.Generator().manual_seed(31)
    codes, scales, zeros = random_quantized(48, 200, 4, 64, gen)
    weight = QuantWeight.pack(codes, scales, zeros, 4, 64)
    reference = dequantized(codes, scales, zeros, torch.arange(200) // 64)
    x = (torch.randn(2, 200, generator=gen) * torch.tensor([2.0**-120, 2.0**-140])[:, None]).to(torch.bfloat16).float()
    for name, kernels in variant_kernels.items():
        y = kernels.linear_quant(x, weight)
        error = (y.double() - x.double() @ reference.double().T).abs()
        bound = 2.0**-127 * (codes.double().abs() * scales[:, torch.arange(200) // 64].double().abs()).sum(dim=1) + 1e-45
        assert bool(torch.isfinite(y).all()) and bool((error <= bound).all()), name


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_multiplies_bf16_rounded_rows_by_the_dequantized_weight(
        threads: int, variant_kernels: dict[str, CpuKernels]) -> None:
    """Many rows on AMX (x86-64-v4 objects on a CPU with AMX-BF16): x rounded to bf16 as PyTorch's bf16 product
    rounds it, times the dequantized 4- or 8-bit weight, up to fp32 summation order; 4-bit codes enter the tiles as
    bf16 of 128 + code, so the bound counts that offset too. Every other object, and groups that are not a multiple of 32
    inputs, decline (None) and the fp32 kernel runs instead."""
    gen = torch.Generator().manual_seed(31)
    amx = "amx_bf16" in builder.cpu_flags() and "x86-64-v4" in variant_kernels
    avx512 = ("x86-64-v4", "x86-64-v4-bf16")  # the objects with AMX tiles
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, kernels in variant_kernels.items():
            for bits, (k, n) in itertools.product((4, 8), (*SHAPES, (1024, 80))):
                for group_size in (32, 64, 128):
                    codes, scales, zeros = random_quantized(n, k, bits, group_size, gen)
                    weight = QuantWeight.pack(codes, scales, zeros, bits, group_size)
                    groups = torch.arange(k) // group_size
                    reference = dequantized(codes, scales, zeros, groups)
                    for rows in (*ROWS, 33):
                        x = torch.randn(rows, k, generator=gen)
                        y = kernels.linear_quant_amx(x, weight)
                        if not (amx and name in avx512):
                            assert y is None, name
                            continue
                        assert y is not None
                        rounded = x.to(torch.bfloat16).double()
                        error = (y.double() - rounded @ reference.double().T).abs()
                        widened = codes + 128 if bits == 4 else codes
                        bound = summation_bound(rounded.float(), widened, scales, zeros, groups)
                        worst = (error / bound).max().item()
                        assert worst <= 1.0, f"{name} {bits} bits rows={rows} k={k} n={n} group={group_size}: " \
                                             f"{worst:.2f}x"
            if amx and name in avx512:
                odd = QuantWeight.pack(*random_quantized(32, 96, 4, 48, gen), 4, 48)
                assert kernels.linear_quant_amx(torch.randn(20, 96), odd) is None  # groups of 48: not tiles of 32
                empty = kernels.linear_quant_amx(torch.empty(0, 64), QuantWeight.pack(
                    *random_quantized(32, 64, 4, 32, gen), 4, 32))
                assert empty is not None and empty.shape == (0, 32)
    finally:
        torch.set_num_threads(previous)
    if not amx:
        pytest.skip("this CPU has no AMX-BF16: only the declining was checked")


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
    and the codes take half a byte (4-bit) or a byte (8-bit) per weight, the last panel padded to 16 columns. The
    4-bit words hold input i of each 8 at bit 16 (i % 2) + 4 (i // 2): a hand-checked word."""
    gen = torch.Generator().manual_seed(5)
    for bits in (4, 8):
        codes, scales, zeros = random_quantized(33, 37, bits, 32, gen)
        weight = QuantWeight.pack(codes, scales, zeros, bits, 32)
        reference = dequantized(codes, scales, zeros, torch.arange(37) // 32)
        assert weight.shape == (33, 37)
        assert torch.equal(weight.dequantize(), reference)
        ids = torch.tensor([32, 0, 17, 17])
        assert torch.equal(weight.rows(ids), reference[ids])
        assert weight.codes.nbytes == 48 * (20 if bits == 4 else 37)  # 4 bits: k rounded up to a word of 8
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    word = QuantWeight.pack(codes, torch.ones(1, 1), torch.zeros(1, 1), 4, None).codes[0, 0, 0].item()
    assert word & 0xFFFFFFFF == 0x86427531  # low half 1, 3, 5, 7 (inputs 0, 2, 4, 6), high half 2, 4, 6, 8


def test_what_does_not_fit_the_layout_is_refused() -> None:
    gen = torch.Generator().manual_seed(6)
    codes, scales, zeros = random_quantized(16, 64, 4, 32, gen)
    with pytest.raises(ValueError, match="4 or 8-bit"):
        QuantWeight.pack(codes, scales, zeros, 3, 32)
    with pytest.raises(ValueError, match=r"outside \[0, 16\)"):
        QuantWeight.pack(codes + 1, scales, zeros, 4, 32)
    with pytest.raises(ValueError, match="must be"):
        QuantWeight.pack(codes, scales[:, :1], zeros, 4, 32)
    with pytest.raises(ValueError, match="splits a word"):
        QuantWeight.pack(codes, torch.ones(16, 3), torch.zeros(16, 3), 4, 31)
    uneven = torch.cat([torch.zeros(20), torch.ones(12), torch.full((16,), 2), torch.full((16,), 3)]).long()
    with pytest.raises(ValueError, match="not runs of 16"):  # groups of 20 and 12 inputs
        QuantWeight.pack(codes, torch.ones(16, 4), torch.zeros(16, 4), 4, 16, groups=uneven)
    with pytest.raises(ValueError, match="fp16 does not hold exactly"):  # the kernels read fp16
        QuantWeight.pack(codes, scales + 1e-4, zeros, 4, 32)
    with pytest.raises(ValueError, match="fp16 does not hold exactly"):
        QuantWeight.pack(codes, scales, zeros + 0.5 + 2048, 4, 32)
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


# --- a quantized checkpoint served on the CPU keeps its codes ----------------------------------------------------

# (method, options) of the checkpoints written in the formats' documented layouts (tests/support): 4 and 8 bits,
# act-order groups, asymmetric per-channel zero points; intermediate_size 160 leaves GPTQ's group of 64 partial.
KEPT = {
    "awq_g32": ("awq", dict(group_size=32)),
    "gptq4_g64_desc_act": ("gptq", dict(bits=4, group_size=64, desc_act=True)),
    "gptq8_g32_asym_v2": ("gptq", dict(bits=8, group_size=32, sym=False, checkpoint_format="gptq_v2")),
    "pack_quantized_int8_channel_asym": ("compressed-tensors", dict(bits=8, group_size=None, symmetric=False)),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path]]:
    """quantized(name) -> (the checkpoint in KEPT[name]'s format, the plain fp32 checkpoint of its reference
    dequantization)."""
    base = tiny_checkpoint(tmp_path_factory.mktemp("plain"), seed=5, intermediate_size=160)
    made: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in made:
            method, options = KEPT[name]
            root = tmp_path_factory.mktemp(name)
            reference = qc.quantize_checkpoint(base, root / "quantized", method, **options)
            made[name] = root / "quantized", qc.write_reference(base, root / "reference", reference)
        return made[name]

    return get


def quant_weights(model: torch.nn.Module) -> list[QuantWeight]:
    from qwenserve.engine.quantization.kept import codes_held

    return codes_held(model)


@needs_compiler
@pytest.mark.parametrize("name", list(KEPT))
def test_the_loader_keeps_every_decoder_linear_as_codes_with_the_same_fingerprint(name: str, quantized) -> None:
    """With kernels that multiply codes, each fused weight (q/k/v, gate/up) and o/down of every layer is one
    QuantWeight that dequantizes to the reference checkpoint's weight exactly, and the model's fingerprint is the
    one the same checkpoint dequantized at load has."""
    folder, reference = quantized(name)
    cfg = ModelConfig.from_folder(folder)
    kernels = select_kernels(EngineConfig(dtype="float32"), torch.device("cpu"), cfg)
    bits = KEPT[name][1].get("bits", 4)
    assert kernels.quantized is not None and kernels.ops.name.endswith(f"+w{bits}a16")
    kept = model_class(cfg)(cfg, torch.float32, 64, kernels.ops)
    plain = model_class(cfg)(cfg, torch.float32, 64)
    assert load_checkpoint(kept, folder, keep_codes=True) == load_checkpoint(plain, folder)
    expected = model_class(cfg)(cfg, torch.float32, 64)
    load_checkpoint(expected, reference)
    for layer, theirs in zip(kept.layers, expected.layers, strict=True):
        for ours, want in ((layer.self_attn.qkv_proj, theirs.self_attn.qkv_proj),
                           (layer.self_attn.o_proj, theirs.self_attn.o_proj),
                           (layer.mlp.gate_up_proj, theirs.mlp.gate_up_proj), (layer.mlp.down_proj, theirs.mlp.down_proj)):
            assert isinstance(ours, QuantWeight)
            assert torch.equal(ours.dequantize(), want.data)
    assert len(quant_weights(kept)) == 4 * cfg.num_layers
    assert not quant_weights(plain)


@needs_compiler
@pytest.mark.parametrize("name", list(KEPT))
def test_greedy_tokens_over_kept_codes_equal_transformers_on_the_dequantized_weights(name: str, quantized) -> None:
    folder, reference = quantized(name)
    prompts = random_prompts(3, 5, 30, seed=8)
    hf = load_reference(reference)
    expected = [reference_greedy(hf, p, GREEDY.max_tokens)[0] for p in prompts]
    engine = LLMEngine.from_pretrained(folder, EngineConfig(dtype="float32", num_kv_blocks=32, block_size=8,
                                                            num_threads=2))
    try:
        assert engine.kernels.quantized is not None and quant_weights(engine.runner.model)
        assert engine.generate_sync(prompts, GREEDY) == expected
    finally:
        engine.shutdown()


@needs_compiler
def test_dequantize_weights_and_fp8_load_dequantized(quantized) -> None:
    cpu = torch.device("cpu")
    cfg = ModelConfig.from_folder(quantized("awq_g32")[0])
    kept = select_kernels(EngineConfig(dtype="float32"), cpu, cfg)
    assert kept.quantized is not None and "W4A16: AWQ 4-bit, group size 32" in kept.precision.reason
    # The metric's and `qwen-serve status`'s weights part (the LM head's dtype is in the reason).
    assert kept.precision.labels()["weights"] == "w4a16" and "weights=w4a16" in kept.precision.name
    off = select_kernels(EngineConfig(dtype="float32", dequantize_weights=True), cpu, cfg)
    assert off.quantized is None and "w4a16" not in off.ops.name and off.precision.labels()["weights"] == "float32"
    assert select_kernels(EngineConfig(dtype="float32", cpu_kernel=False), cpu, cfg).quantized is None
    # AMX takes bf16 activations from AMX_MIN_ROWS rows; fp32 ones only where the precision rounds x for bf16
    # products.
    bf16 = select_kernels(EngineConfig(dtype="bfloat16"), cpu, cfg)
    assert bf16.quantized is not None
    assert (f"+amx>={AMX_MIN_ROWS['w4a16']}" in bf16.ops.name) == ("amx_bf16" in builder.cpu_flags()) and "amx" not in kept.ops.name
    fp8 = dataclasses.replace(cfg, raw={**cfg.raw, "quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}})
    assert select_kernels(EngineConfig(dtype="float32"), cpu, fp8).quantized is None
    from qwenserve.flags import StrictParser, add_options

    parser = StrictParser(prog="test")
    add_options(parser, EngineConfig)
    assert parser.parse_config(EngineConfig, ["--dequantize-weights"]).dequantize_weights


def test_a_fused_weight_is_kept_only_when_all_its_parts_are_codes_of_one_layout(quantized) -> None:
    """q/k/v and gate/up are one matrix each: kept as one QuantWeight when every part is codes with the same bits,
    group size and groups; a part stored plain, or act-order groups that differ between parts, leave the whole
    matrix to be dequantized (its parts are returned: at once where the parameter cannot hold them, at the end where
    it never completes)."""
    from qwenserve.engine.quantization.kept import CodePlacer
    from qwenserve.engine.quantization.scheme import IntegerWeight

    cfg = ModelConfig.from_folder(quantized("awq_g32")[0])
    model = model_class(cfg)(cfg, torch.float32, 64)
    targets = model.checkpoint_targets()
    gen = torch.Generator().manual_seed(9)

    def codes(name: str, groups: torch.Tensor | None = None) -> IntegerWeight:
        n, k = targets[name].shape
        return IntegerWeight(*random_quantized(n, k, 4, 32, gen), 4, 32, groups)

    layer = "model.layers.0"
    attn, mlp = f"{layer}.self_attn", f"{layer}.mlp"
    k = targets[f"{attn}.q_proj.weight"].shape[1]
    shuffled = (torch.arange(k) // 32)[torch.randperm(k, generator=gen)]
    kept = {f"{attn}.{p}_proj.weight": codes(f"{attn}.{p}_proj.weight") for p in ("q", "k", "v")}
    kept[f"{mlp}.gate_proj.weight"] = codes(f"{mlp}.gate_proj.weight")  # up_proj stays plain
    kept[f"{attn}.o_proj.weight"] = codes(f"{attn}.o_proj.weight")
    down_k = targets[f"{mlp}.down_proj.weight"].shape[1]  # one part with act-order groups: kept, gathering x
    kept[f"{mlp}.down_proj.weight"] = codes(f"{mlp}.down_proj.weight",
                                            (torch.arange(down_k) // 32)[torch.randperm(down_k, generator=gen)])
    other = "model.layers.1.self_attn"
    kept.update({f"{other}.{p}_proj.weight": codes(f"{other}.{p}_proj.weight", shuffled if p == "v" else None)
                 for p in ("q", "k", "v")})
    placer = CodePlacer(model, targets)
    at_once = [name for name, weight in kept.items() for name, _ in placer.take(name, weight)]
    left = {name for name, _ in placer.finish()}
    assert at_once == [f"{other}.{p}_proj.weight" for p in ("q", "k", "v")]  # v's groups differ from q's and k's
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantWeight) and isinstance(model.layers[0].self_attn.o_proj, QuantWeight)
    expected = torch.cat([kept[f"{attn}.{p}_proj.weight"].dequantize() for p in ("q", "k", "v")])
    assert torch.equal(qkv.dequantize(), expected)
    down = model.layers[0].mlp.down_proj
    assert isinstance(down, QuantWeight) and down.perm is not None
    assert torch.equal(down.dequantize(), kept[f"{mlp}.down_proj.weight"].dequantize())
    assert not isinstance(model.layers[0].mlp.gate_up_proj, QuantWeight)
    assert not isinstance(model.layers[1].self_attn.qkv_proj, QuantWeight)
    assert left == {f"{mlp}.gate_proj.weight"}  # its up_proj never came as codes
    assert placer.replaced == 3  # qkv, o and down of layer 0


@needs_compiler
def test_moe_experts_are_kept_per_expert_and_greedy_tokens_equal_transformers(tmp_path: Path) -> None:
    """A Qwen3-MoE checkpoint in AWQ (experts, dense MLP and attention quantized): each stack of experts is one
    QuantWeight per expert, and greedy tokens equal transformers' on the dequantized weights in fp32."""
    from tests.support.engine_checkpoints import SPECS, write_checkpoint

    base = write_checkpoint(tmp_path / "plain", SPECS["qwen3_moe"], seed=3)
    reference = qc.write_reference(base, tmp_path / "reference",
                                   qc.quantize_checkpoint(base, tmp_path / "awq", "awq", group_size=32))
    prompts = random_prompts(3, 5, 30, seed=4)
    hf = load_reference(reference)
    expected = [reference_greedy(hf, p, GREEDY.max_tokens)[0] for p in prompts]
    engine = LLMEngine.from_pretrained(tmp_path / "awq", EngineConfig(dtype="float32", num_kv_blocks=32, block_size=8,
                                                                       num_threads=2))
    try:
        model, cfg = engine.runner.model, engine.model_config
        sparse = [layer.mlp for layer in model.layers if isinstance(getattr(layer.mlp, "gate_up_proj", None), list)]
        assert len(sparse) == 2 and all(len(mlp.gate_up_proj) == cfg.num_experts and len(mlp.down_proj) == cfg.num_experts
                                        for mlp in sparse)
        # 3 layers' qkv and o, the dense layer's gate_up and down, and 2 x 8 experts' gate_up and down.
        assert len(quant_weights(model)) == 3 * 2 + 2 + 2 * 2 * cfg.num_experts
        assert engine.generate_sync(prompts, GREEDY) == expected
    finally:
        engine.shutdown()
