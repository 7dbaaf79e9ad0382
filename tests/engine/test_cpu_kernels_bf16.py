"""bf16 weights in the packed product: panels held in bf16 (half the bytes a decode step streams), widened to fp32
as the kernel reads them, so the product is the fp32 product of the bf16-rounded weights at every instruction-set
level this CPU runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from qwenserve.cpu_kernels import builder, loader
from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.cpu_kernels.packed_weight import PackedWeight, packable
from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.kernels import select_kernels
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.models.ops import TORCH_OPS

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="no C compiler: the kernels cannot be built here")

# 7 to 15 rows take tiles of up to 12 rows over 2 panels (7, 12; 13 in two passes of 7 and 6); from 16 rows up a thread
# widens its group of panels to fp32 once (linear.c's widened_product): 17, 40, 53 and 61 take that path, with 6-row
# tiles leaving tails of 5, 4, 5 and 1.
ROWS = (1, 2, 5, 7, 12, 13, 17, 40, 53, 61)
# k not a power of two, on both sides of the 512 columns up to which 16 rows or fewer take the one-panel tiles;
# n = 16 * odd, so the 4-panel tiles leave tails of 1 and 3 panels.
SHAPES = ((37, 48), (200, 80), (1000, 16), (1500, 208))


def reference(x: torch.Tensor, weight_bf16: torch.Tensor) -> torch.Tensor:
    return x.float() @ weight_bf16.float().T


def summation_bound(x: torch.Tensor, weight_bf16: torch.Tensor) -> torch.Tensor:
    """How far two fp32 sums of the same k products differ by their order alone: rounding errors of u = 2^-24
    relative that add up like a random walk, 4 sqrt(k) u |x|·|w|ᵀ (the kernel stays under a tenth of it here). A
    product that rounded x to bf16 misses by ~2^-9 relative, 25x or more outside it at these k."""
    k = x.shape[1]
    return 4 * k**0.5 * 2.0**-24 * (x.abs() @ weight_bf16.float().abs().T) + 1e-30


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("variant", [v.name for v in builder.machine_variants()])
def test_every_variant_multiplies_bf16_panels_as_fp32_of_the_rounded_weights(
        variant: str, threads: int, variant_kernels: dict[str, CpuKernels]) -> None:
    if variant not in variant_kernels:
        pytest.skip(f"this CPU cannot run {variant}")
    kernels = variant_kernels[variant]
    gen = torch.Generator().manual_seed(29)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k, n in SHAPES:
            weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
            packed = PackedWeight.pack(weight)
            for rows in ROWS:
                x = torch.randn(rows, k, generator=gen)
                y = kernels.linear_packed(x, packed)
                error = (y - reference(x, weight)).abs()
                worst = (error / summation_bound(x, weight)).max().item()
                assert worst <= 1.0, f"{variant} rows={rows} k={k} n={n}: {worst:.2f}x the summation bound"
    finally:
        torch.set_num_threads(previous)


def test_a_cpu_with_avx512_bf16_loads_the_object_built_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """AVX512_BF16's dot product serves a bf16 model's decode attention (paged_attend_dp.h) and AVX512_VNNI's the
    4-bit product (linear_quant.c), so a CPU with both flags (every CPU with the first so far) loads the object built
    with them; without either, or without a full AVX-512, the levels below. (The packed
    product still widens bf16 panels at every level: vdpbf16ps, which would also round x to bf16, measured slower
    at 8-32 rows and within noise at 1-4 on this project's Xeon.)"""
    v4 = next(v for v in builder.VARIANTS["x86_64"] if v.name == "x86-64-v4")
    dot = {"avx512_bf16", "avx512_vnni"}
    for flags, best in ((v4.needs | dot | {"amx_bf16"}, "x86-64-v4-bf16"), (v4.needs | dot, "x86-64-v4-bf16"),
                        (v4.needs | {"avx512_bf16"}, "x86-64-v4"), (v4.needs | {"amx_bf16"}, "x86-64-v4"),
                        (v4.needs - {"avx512bw"} | dot, "x86-64-v3")):
        monkeypatch.setattr(builder, "cpu_flags", lambda flags=flags: frozenset(flags))
        monkeypatch.setattr(builder.platform, "machine", lambda: "x86_64")
        assert builder.supported_variants()[0].name == best


def test_bf16_panels_round_to_nearest_even_and_keep_every_row() -> None:
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(48, 24, generator=gen)
    # Values halfway between two bf16s: round to nearest even, as torch's conversion does.
    weight[0, :4] = torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 2.0**-7 + 2.0**-15])
    rounded = weight.to(torch.bfloat16)
    packed = PackedWeight.pack(weight, torch.bfloat16)
    assert packed.dtype == torch.bfloat16 and packed.panels.shape == (3, 24, 16) and packed.shape == (48, 24)
    assert packed.nbytes == weight.nbytes // 2
    assert torch.equal(packed.panels, PackedWeight.pack(rounded).panels)  # packed from bf16 weights: the same
    assert torch.equal(packed.panels.float(), PackedWeight.pack(rounded.float()).panels)
    # rows(): the embeddings of a tied, packed head, fp32 for the hidden states they start.
    ids = torch.tensor([0, 47, 16, 5, 5])
    rows = packed.rows(ids)
    assert rows.dtype == torch.float32 and torch.equal(rows, rounded.float()[ids])
    assert torch.equal(PackedWeight.pack(weight).rows(ids), weight[ids])  # fp32 panels keep fp32 rows
    # Stacked experts pack each matrix on its own, in bf16 as in fp32.
    experts = torch.randn(3, 32, 8, generator=gen)
    stacked = PackedWeight.pack(experts, torch.bfloat16)
    assert torch.equal(stacked[1].panels, PackedWeight.pack(experts[1].to(torch.bfloat16)).panels)


def test_what_cannot_be_packed_or_multiplied_is_refused() -> None:
    assert packable(torch.randn(32, 8).to(torch.bfloat16))
    assert not packable(torch.randn(32, 8).half())
    with pytest.raises(ValueError, match="fp32 or bf16"):
        PackedWeight.pack(torch.randn(32, 8), torch.float16)
    with pytest.raises(ValueError, match="multiple of 16"):
        PackedWeight.pack(torch.randn(24, 8).to(torch.bfloat16))


@needs_compiler
def test_the_product_refuses_wrong_dtypes_and_shapes() -> None:
    kernels = loader.load()
    assert kernels is not None
    packed = PackedWeight.pack(torch.randn(32, 8), torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous fp32"):
        kernels.linear_packed(torch.randn(2, 8).to(torch.bfloat16), packed)  # x stays fp32
    with pytest.raises(ValueError, match="contiguous fp32"):
        kernels.linear_packed(torch.randn(2, 8), packed, out=torch.empty(2, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="columns"):
        kernels.linear_packed(torch.randn(2, 9), packed)
    with pytest.raises(ValueError, match="fp32 or bf16 CPU panels"):
        kernels.linear_packed(torch.randn(2, 8), PackedWeight(packed.panels.half()))
    with pytest.raises(ValueError, match="fp32 or bf16 CPU panels"):
        kernels.linear_packed(torch.randn(2, 8), PackedWeight(packed.panels.transpose(0, 1)))
    with pytest.raises(ValueError, match="one packed matrix"):
        kernels.linear_packed(torch.randn(2, 8), PackedWeight.pack(torch.randn(2, 16, 8), torch.bfloat16))


def greedy_and_teacher_forced(folder: Path, weight_dtype: str, prompts: list[list[int]],
                              reference: list[list[int]] | None, max_tokens: int,
                              dtype: str = "float32") -> list[list[int]]:
    """An fp32 CPU engine whose packed weights are `weight_dtype` (`dtype` "auto": chosen by --dtype auto, and must
    come out as `weight_dtype`): its greedy tokens for `prompts`, or, given `reference` tokens, its greedy next
    token after every prefix of them (teacher forcing)."""
    explicit = {} if dtype == "auto" else dict(cpu_weight_dtype=weight_dtype)
    engine = LLMEngine.from_pretrained(folder, EngineConfig(device="cpu", dtype=dtype, block_size=4,
                                                            num_kv_blocks=1024, num_threads=2, **explicit))
    try:
        packed = [w for m in engine.runner.model.modules() for w in vars(m).values() if isinstance(w, PackedWeight)]
        assert packed and {w.dtype for w in packed} == {getattr(torch, weight_dtype)}
        if reference is None:
            return engine.generate_sync(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                ignore_eos=True))
        prefixes = [prompt + tokens[:j] for prompt, tokens in zip(prompts, reference, strict=True)
                    for j in range(len(tokens))]
        nexts = engine.generate_sync(prefixes, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        return [[token for [token] in nexts[i * max_tokens:(i + 1) * max_tokens]] for i in range(len(prompts))]
    finally:
        engine.shutdown()


@needs_compiler
@pytest.mark.parametrize("name", ["qwen3_gqa4", "qwen3_untied"])
def test_bf16_weights_engine_agrees_with_fp32_at_top1(name: str, checkpoint) -> None:
    """--cpu-weight-dtype bfloat16: the packed weights are bf16 (activations and KV stay fp32), and after every
    prefix of the fp32 engine's greedy tokens the next token is the fp32 engine's at least 99% of the time (a
    tied head, whose embeddings are read from the bf16 panels, and an untied one)."""
    folder = checkpoint(name)
    prompts = [[(13 * i + 5 * j) % 997 + 2 for j in range(3 + 9 * i)] for i in range(4)]
    max_tokens = 32
    fp32 = greedy_and_teacher_forced(folder, "float32", prompts, None, max_tokens)
    forced = greedy_and_teacher_forced(folder, "bfloat16", prompts, fp32, max_tokens)
    agree = sum(a == b for want, got in zip(fp32, forced, strict=True) for a, b in zip(want, got, strict=True))
    assert agree >= 0.99 * len(prompts) * max_tokens, f"top-1 agreement {agree}/{len(prompts) * max_tokens}"


def test_the_weight_dtype_is_a_flag_honoured_only_for_fp32_on_cpu() -> None:
    from qwenserve.flags import StrictParser, add_options

    parser = StrictParser(prog="test")
    add_options(parser, EngineConfig)
    assert parser.parse_config(EngineConfig, []).cpu_weight_dtype == "auto"
    assert parser.parse_config(EngineConfig, ["--cpu-weight-dtype", "bfloat16"]).cpu_weight_dtype == "bfloat16"
    kernels = loader.load()
    if kernels is None:
        pytest.skip("no CPU kernels here")
    cpu = torch.device("cpu")
    config = EngineConfig(dtype="float32", cpu_weight_dtype="bfloat16")
    assert select_kernels(config, cpu).ops.name == "cpu_kernels+bf16_weights"
    assert select_kernels(EngineConfig(dtype="float32"), cpu).ops.name == "cpu_kernels"
    # The flag is the fp32 model's: a bf16 model packs bf16 panels, an fp16 one keeps PyTorch's products.
    bf16 = select_kernels(EngineConfig(dtype="bfloat16", cpu_weight_dtype="float32"), cpu)
    assert bf16.precision.weight_dtype == torch.bfloat16 and "bf16_activations" in bf16.ops.name
    fp16 = select_kernels(EngineConfig(dtype="float16", cpu_weight_dtype="bfloat16"), cpu)
    assert fp16.ops.linear is TORCH_OPS.linear and fp16.precision.weight_dtype == torch.float16
