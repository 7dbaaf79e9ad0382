"""A bf16 model's fused elementwise kernels (cpu_kernels/bf16_layer.c) against their PyTorch forms
(models/torch_forms.py) in bf16, at every instruction-set level this CPU runs: odd widths, strided rows (views into
a fused product's output), partial rotary, Qwen2 without q/k norms, many rows (the parallel path) and few."""

from __future__ import annotations

import pytest
import torch

from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.cpu_kernels.packed_weight import PackedWeight
from qwenserve.models import torch_forms
from qwenserve.models.config import RopeConfig
from qwenserve.models.layers import RotaryEmbedding

BF16 = torch.bfloat16


def close_in_bf16(got: torch.Tensor, want: torch.Tensor, what: str, max_mismatch: float = 0.01) -> None:
    """Equal, but for a few values one bf16 step apart (the fp32 sum of a row's squares in another order may round
    the other way), never more."""
    got, want = got.float(), want.float()
    step = want.abs().clamp_min(2.0**-126) * 2.0**-7  # one bf16 ulp at the value, an upper bound
    off = (got - want).abs()
    assert bool((off <= step).all()), f"{what}: largest miss {float((off / step).max()):.1f} bf16 steps"
    assert float((off > 0).float().mean()) <= max_mismatch, f"{what}: {float((off > 0).float().mean()):.3f} differ"


@pytest.mark.parametrize("rows", [1, 3, 200])
@pytest.mark.parametrize("n", [64, 1024, 1000])
def test_rms_norm_equals_pytorchs_form(variant_kernels: dict[str, CpuKernels], rows: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows * n)
    wide = torch.randn(rows, n + 24, generator=gen).to(BF16)
    x = wide[:, 5 : 5 + n]  # rows strided like a view into a wider output
    weight = torch.randn(n, generator=gen).to(BF16)
    for zero_centered in (False, True):
        want = torch_forms.rms_norm(x, weight, 1e-6, zero_centered)
        for name, kernels in variant_kernels.items():
            got = kernels.rms_norm_bf16(x, weight, 1e-6, zero_centered)
            close_in_bf16(got, want, name)


@pytest.mark.parametrize(("rows", "heads", "kv_heads", "dim", "rotary"), [(1, 16, 8, 128, 1.0), (5, 4, 1, 32, 1.0),
                                                                         (300, 6, 2, 64, 0.5), (2, 3, 3, 18, 1.0)])
@pytest.mark.parametrize("norms", [True, False])
def test_qk_norm_rope_equals_pytorchs_form_in_place(variant_kernels: dict[str, CpuKernels], rows: int, heads: int,
                                                   kv_heads: int, dim: int, rotary: float, norms: bool) -> None:
    gen = torch.Generator().manual_seed(rows + heads * dim)
    rot = int(dim * rotary)
    table = RotaryEmbedding(rot, RopeConfig(theta=10000.0), 4096, BF16)
    cos, sin = table.lookup(torch.randint(0, 4096, (rows,), generator=gen))
    q_weight, k_weight = (torch.randn(dim, generator=gen).to(BF16) for _ in range(2))
    weights = (q_weight, k_weight) if norms else (None, None)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(BF16)
    want_q, want_k = torch_forms.qk_norm_rope(qkv[:, : heads * dim].reshape(rows, heads, dim),
                                              qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(rows, kv_heads, dim),
                                              *weights, 1e-6, False, cos, sin)
    for name, kernels in variant_kernels.items():
        fused = qkv.clone()
        q = fused[:, : heads * dim].view(rows, heads, dim)
        k = fused[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
        kernels.qk_norm_rope_bf16(q, k, *weights, cos, sin, 1e-6)
        close_in_bf16(q, want_q, name)
        close_in_bf16(k, want_k, name)
        assert torch.equal(fused[:, (heads + kv_heads) * dim :], qkv[:, (heads + kv_heads) * dim :])  # v untouched


@pytest.mark.parametrize(("rows", "n"), [(1, 3072), (7, 100), (64, 1536)])
def test_silu_mul_equals_pytorchs_form(variant_kernels: dict[str, CpuKernels], rows: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows * n)
    gate_up = (torch.randn(rows, 2 * n, generator=gen) * 4).to(BF16)
    want = torch_forms.silu_mul(gate_up, n)
    for name, kernels in variant_kernels.items():
        close_in_bf16(kernels.silu_mul_bf16(gate_up, n), want, name)


def test_silu_mul_at_the_ends_of_exp_equals_pytorchs_form(variant_kernels: dict[str, CpuKernels]) -> None:
    # The vectorised exp: past expf's range silu is -0 (exp overflows) or x itself; inf and NaN as PyTorch has them.
    ends = [-200.0, -100.0, -88.8, -88.0, -87.5, -50.0, -1.0, 0.0, 1e-3, 3.0, 50.0, 88.0, 89.0, 100.0,
            float("nan"), float("inf"), -float("inf")]
    gate = torch.tensor(ends * 2)  # 34 values: two vectors' worth and a scalar tail
    gate_up = torch.cat([gate, torch.full_like(gate, 1.5)])[None].to(BF16)
    want = torch_forms.silu_mul(gate_up, gate.numel())
    for name, kernels in variant_kernels.items():
        got = kernels.silu_mul_bf16(gate_up, gate.numel())
        assert torch.equal(got.float().nan_to_num(7.0), want.float().nan_to_num(7.0)), (name, got, want)


def test_the_kernels_refuse_what_they_cannot_read(variant_kernels: dict[str, CpuKernels]) -> None:
    kernels = next(iter(variant_kernels.values()))
    with pytest.raises(ValueError, match="bf16"):
        kernels.rms_norm_bf16(torch.randn(2, 8), torch.randn(8).to(BF16), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        kernels.rms_norm_bf16(torch.randn(2, 8).to(BF16), torch.randn(9).to(BF16), 1e-6)
    with pytest.raises(ValueError, match="2 x"):
        kernels.silu_mul_bf16(torch.randn(2, 8).to(BF16), 3)
    q = torch.randn(2, 4, 8).to(BF16)
    cos = torch.randn(2, 8).to(BF16)
    with pytest.raises(ValueError, match="both"):
        kernels.qk_norm_rope_bf16(q, q.clone(), torch.randn(8).to(BF16), None, cos, cos, 1e-6)
    with pytest.raises(ValueError, match="heads contiguous"):
        scattered = torch.randn(2, 8, 4).to(BF16).transpose(1, 2)  # [2, 4, 8] whose heads are not side by side
        kernels.qk_norm_rope_bf16(scattered, q.clone(), None, None, cos, cos, 1e-6)
    with pytest.raises(ValueError, match="cos and sin"):
        kernels.qk_norm_rope_bf16(q, q.clone(), None, None, cos[:1], cos[:1], 1e-6)


@pytest.mark.parametrize(("m", "k", "n"), [(1, 1024, 3072), (3, 40, 48), (9, 200, 80), (55, 200, 80)])
def test_the_bf16_io_product_is_the_fp32_product_of_widened_rows_rounded_once(variant_kernels: dict[str, CpuKernels],
                                                                             m: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(m * k + n)
    weight = PackedWeight.pack(torch.randn(n, k, generator=gen), BF16)
    wide = torch.randn(m, k + 8, generator=gen).to(BF16)
    x = wide[:, 3 : 3 + k]  # strided rows
    for name, kernels in variant_kernels.items():
        want = kernels.linear_packed(x.float().contiguous(), weight).to(BF16)
        assert torch.equal(kernels.linear_packed_bf16_io(x, weight), want), name


def test_bf16_queries_attend_as_the_fp32_kernel_on_them_widened(variant_kernels: dict[str, CpuKernels]) -> None:
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, block, blocks = 8, 2, 64, 4, 12
    k_cache, v_cache = (torch.randn(blocks, block, kv_heads, dim, generator=gen).to(BF16) for _ in range(2))
    table = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11]])
    lens = torch.tensor([13, 9])
    qkv = torch.randn(2, (heads + 2 * kv_heads) * dim, generator=gen).to(BF16)
    q = qkv[:, : heads * dim].view(2, heads, dim)  # rows strided as in the fused q/k/v product
    for name, kernels in variant_kernels.items():
        want = torch.empty(2, heads, dim)
        kernels.paged_decode_attention(q.float().contiguous(), k_cache, v_cache, table, lens, want, dim**-0.5)
        got = torch.empty(2, heads, dim, dtype=BF16)
        kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, got, dim**-0.5)
        if kernels.bf16_decode_attention_uses_dot_product(dim):  # the same sums in another order: test_paged_attend_dp
            close_in_bf16(got, want.to(BF16), name, max_mismatch=0.05)
        else:
            assert torch.equal(got, want.to(BF16)), name
