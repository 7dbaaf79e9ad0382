"""A bf16 model's decode attention with AVX512_BF16's dot product (cpu_kernels/paged_attend_dp.h) against fp32
attention over the same bf16 values, on shapes that exercise its tiles: head dims of 1 to 8 chunks of 32, query
groups of 1, 2, 3 and 7 heads (pairs and a single), contexts shorter than a tile, blocks of odd sizes and block
tables in any order. Runs in every object this CPU loads that has the path (x86-64-v4-bf16 on a CPU with
AVX512_BF16); the others must say they lack it."""

from __future__ import annotations

import pytest
import torch

from qwenserve.cpu_kernels.library import CpuKernels

BF16 = torch.bfloat16


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
              lens: torch.Tensor) -> torch.Tensor:
    """softmax(q K^T / sqrt(dim)) V per sequence in fp64 over the cache's values, gathered through the table."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    out = torch.empty(batch, heads, dim, dtype=torch.float64)
    for b in range(batch):
        n = int(lens[b])
        k = k_cache[table[b]].reshape(-1, kv_heads, dim)[:n].double().repeat_interleave(heads // kv_heads, 1)
        v = v_cache[table[b]].reshape(-1, kv_heads, dim)[:n].double().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,thd->ht", q[b].double(), k) * dim**-0.5
        out[b] = torch.einsum("ht,thd->hd", torch.softmax(scores, -1), v)
    return out


def dp_kernels(variant_kernels: dict[str, CpuKernels]) -> dict[str, CpuKernels]:
    return {name: k for name, k in variant_kernels.items() if k.bf16_decode_attention_uses_dot_product(128)}


def test_only_the_avx512_bf16_object_has_the_path(variant_kernels: dict[str, CpuKernels]) -> None:
    for name, kernels in variant_kernels.items():
        assert kernels.bf16_decode_attention_uses_dot_product(128) == (name == "x86-64-v4-bf16"), name
        assert not kernels.bf16_decode_attention_uses_dot_product(80), name  # not a multiple of 32: the fp32 kernel
        assert not kernels.bf16_decode_attention_uses_dot_product(288), name  # past 8 chunks


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block"), [
    (16, 8, 128, 16),  # Qwen3-0.6B: pairs of heads, 8 tokens a tile
    (7, 1, 64, 5),  # a group of 7: three pairs and a single
    (12, 4, 96, 3),  # 3 chunks, a group of 3
    (4, 4, 256, 16),  # 8 chunks: single heads, 16 tokens a tile
    (6, 2, 32, 7),  # 1 chunk
    (10, 2, 160, 16),  # 5 chunks: single heads
])
@pytest.mark.parametrize("threads", [1, 2])
def test_dot_product_attention_equals_fp64_attention_over_the_bf16_cache(
        variant_kernels: dict[str, CpuKernels], heads: int, kv_heads: int, dim: int, block: int, threads: int) -> None:
    kernels_by_name = dp_kernels(variant_kernels)
    if not kernels_by_name:
        pytest.skip("no object with AVX512_BF16 runs on this CPU")
    gen = torch.Generator().manual_seed(dim + heads + block)
    lens = torch.tensor([1, 7, 8, 9, 17, 150])
    per_seq = -(-int(lens.max()) // block)
    blocks = len(lens) * per_seq + 3
    k_cache, v_cache = (torch.randn(blocks, block, kv_heads, dim, generator=gen).to(BF16) for _ in range(2))
    k_cache[-1].fill_(float("nan"))  # never in a table: read, it would spoil a sum
    table = torch.randperm(blocks - 1, generator=gen)[: len(lens) * per_seq].view(len(lens), per_seq).contiguous()
    for b, n in enumerate(lens.tolist()):  # and the rows past each context, in its last block
        k_cache[table[b, (n - 1) // block], (n - 1) % block + 1:] = float("nan")
        v_cache[table[b, (n - 1) // block], (n - 1) % block + 1:] = float("nan")
    q = (torch.randn(len(lens), heads, dim, generator=gen) * 2).to(BF16)
    want = reference(q, k_cache, v_cache, table, lens)
    assert not want.isnan().any()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, kernels in kernels_by_name.items():
            got = torch.full((len(lens), heads, dim), float("nan"), dtype=BF16)
            kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, got, dim**-0.5)
            # fp32 sums in another order, then one rounding to bf16: within a bf16 step of the exact value
            step = want.abs() * 2.0**-8 + 1e-4
            miss = ((got.double() - want).abs() / step).max().item()
            assert miss <= 1.0, f"{name}: {miss:.2f} x the allowed error"
    finally:
        torch.set_num_threads(previous)


def test_rows_strided_as_the_fused_projection_leaves_them(variant_kernels: dict[str, CpuKernels]) -> None:
    """q read from the fused q/k/v product's rows, out written into rows of a wider buffer: only each row's heads
    are touched."""
    kernels_by_name = dp_kernels(variant_kernels)
    if not kernels_by_name:
        pytest.skip("no object with AVX512_BF16 runs on this CPU")
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, block = 8, 2, 64, 16
    k_cache, v_cache = (torch.randn(6, block, kv_heads, dim, generator=gen).to(BF16) for _ in range(2))
    table, lens = torch.tensor([[3, 1], [0, 5]]), torch.tensor([20, 31])
    qkv = torch.randn(2, (heads + 2 * kv_heads) * dim, generator=gen).to(BF16)
    q = qkv[:, : heads * dim].view(2, heads, dim)
    wide = torch.zeros(2, heads * dim + 32, dtype=BF16)
    out = wide[:, : heads * dim].view(2, heads, dim)
    for kernels in kernels_by_name.values():
        kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, out, dim**-0.5)
        want = reference(q, k_cache, v_cache, table, lens)
        assert ((out.double() - want).abs() <= want.abs() * 2.0**-8 + 1e-4).all()
        assert bool((wide[:, heads * dim:] == 0).all())
