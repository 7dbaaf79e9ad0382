"""A bf16 paged KV cache for an fp32 model on CPU (--kv-cache-dtype bfloat16): the decode kernel reads bf16 K/V
widened to fp32, and an engine that keeps its KV in bf16 decodes, caches prefixes, preempts and hands KV off as
one with fp32 KV does, and refuses a handoff from a cache of the other dtype."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
import torch

from qwenserve.cpu_kernels import builder, loader
from qwenserve.cpu_kernels.library import CpuKernels

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="no C compiler: the kernels cannot be built here")


@pytest.fixture(scope="module")
def variant_kernels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, CpuKernels]]:
    """Every variant this CPU runs (the widening has an AVX2 form and a portable one), each opened by name."""
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


def reference_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                     lens: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 attention of each query over its sequence's blocks, the cache widened to fp32 first."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for b in range(q.shape[0]):
        ctx = int(lens[b])
        keys = k_cache.float()[table[b]].flatten(0, 1)[:ctx].repeat_interleave(group, dim=1)  # [ctx, heads, dim]
        values = v_cache.float()[table[b]].flatten(0, 1)[:ctx].repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,thd->ht", q[b], keys) * scale, dim=-1)
        out[b] = torch.einsum("ht,thd->hd", weights, values)
    return out


# (block size, heads, kv heads, head dim, context lengths): GQA ratios 1, 2, 4 and 7; head dims with 16-, 8- and
# scalar tails; contexts that end inside, at and past block edges.
CASES = [
    (16, 4, 4, 64, [1, 16, 17, 40]),
    (8, 8, 2, 72, [7, 8, 9, 33, 64]),
    (5, 16, 4, 19, [3, 5, 11, 26]),
    (32, 14, 2, 128, [100, 31, 65]),
]


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"bs{c[0]}-h{c[1]}-kv{c[2]}-d{c[3]}")
def test_bf16_decode_kernel_equals_fp32_attention_on_widened_kv(variant_kernels: dict[str, CpuKernels],
                                                                 case: tuple, threads: int) -> None:
    block_size, heads, kv_heads, dim, context = case
    gen = torch.Generator().manual_seed(block_size * 31 + dim)
    max_blocks = max(-(-c // block_size) for c in context)
    num_blocks = max_blocks * len(context) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).bfloat16()
    # Each sequence's blocks scattered over the cache, out of order; its table padded past what it uses.
    order = torch.randperm(num_blocks, generator=gen)
    table = order[: len(context) * max_blocks].view(len(context), max_blocks).contiguous()
    lens = torch.tensor(context, dtype=torch.int64)
    q = torch.randn(len(context), heads, dim, generator=gen)
    expected = reference_decode(q, k_cache, v_cache, table, lens, dim**-0.5)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, kernels in variant_kernels.items():
            out = torch.full_like(q, float("nan"))
            kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, out, dim**-0.5)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        torch.set_num_threads(previous)


@needs_compiler
def test_bf16_decode_kernel_refuses_a_block_outside_the_cache_and_mixed_dtypes() -> None:
    kernels = loader.load()
    assert kernels is not None
    k_cache = torch.zeros(4, 16, 2, 32, dtype=torch.bfloat16)
    q, out = torch.zeros(1, 4, 32), torch.zeros(1, 4, 32)
    lens = torch.tensor([20])
    with pytest.raises(IndexError):
        kernels.paged_decode_attention(q, k_cache, k_cache.clone(), torch.tensor([[1, 4]]), lens, out, 1.0)
    with pytest.raises(ValueError):
        kernels.paged_decode_attention(q, k_cache, k_cache.float(), torch.tensor([[1, 2]]), lens, out, 1.0)
