"""Causal attention of a prompt's first chunk on AMX tiles (cpu_kernels/prefill_attention.c) against attention in
fp64 of the same bf16 q, k, v and against PyTorch's bf16 attention, on odd shapes at every instruction-set level built
here (the objects without AMX, and CPUs without it, decline); and the torch backend handing such chunks to it."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from qwenserve.cpu_kernels import builder, loader
from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.engine.attention import select_backend
from qwenserve.engine.config import EngineConfig
from qwenserve.engine.kernels import select_kernels
from qwenserve.models.forward_context import AttentionBatch

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="no C compiler")
BF16, CPU = torch.bfloat16, torch.device("cpu")
AMX = "amx_bf16" in builder.cpu_flags()
AMX_OBJECTS = ("x86-64-v4", "x86-64-v4-bf16")
# (tokens, heads, kv_heads, head_dim): one token, a partial strip, whole strips and one over, a query block and one
# over, grouped and plain heads, Qwen3-0.6B's heads.
SHAPES = [(1, 2, 1, 32), (5, 4, 2, 64), (31, 2, 2, 32), (33, 3, 1, 64), (64, 2, 1, 128), (65, 4, 4, 32),
          (130, 16, 8, 128)]


def qkv_views(tokens: int, heads: int, kv_heads: int, dim: int, gen: torch.Generator
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as views into one fused product's rows, as the model hands them over."""
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(BF16)
    q = fused[:, : heads * dim].view(tokens, heads, dim)
    k = fused[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = fused[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    return q, k, v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """PyTorch's causal attention, [tokens, heads, dim] in and out, in q's dtype."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                         enable_gqa=True)
    return out.transpose(0, 1)


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_prefill_attention_is_causal_attention(threads: int, variant_kernels: dict[str, CpuKernels]) -> None:
    """Within twice PyTorch's own bf16 error of fp64 attention of the same bf16 values (the probabilities and the
    output are rounded to bf16 in both); a head_dim that is not whole tiles, and every object without AMX, decline."""
    gen = torch.Generator().manual_seed(3)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, kernels in variant_kernels.items():
            runs = AMX and name in AMX_OBJECTS
            for tokens, heads, kv_heads, dim in SHAPES:
                q, k, v = qkv_views(tokens, heads, kv_heads, dim, gen)
                out = kernels.prefill_attention_amx(q, k, v, dim**-0.5)
                if not runs:
                    assert out is None, name
                    continue
                assert out is not None and out.dtype == BF16 and out.shape == (tokens, heads, dim)
                exact = attend(q.double(), k.double(), v.double())
                ours = (out.double() - exact).abs().max().item()
                theirs = (attend(q, k, v).double() - exact).abs().max().item()
                assert ours <= 2 * theirs + 1e-3, f"{name} {tokens}x{heads}/{kv_heads}x{dim}: {ours} vs {theirs}"
                into = torch.full((tokens, heads, dim), float("nan"), dtype=BF16)
                assert kernels.prefill_attention_amx(q, k, v, dim**-0.5, into) is into
                assert torch.equal(into, out)
            q, k, v = qkv_views(9, 2, 1, 48, gen)
            assert kernels.prefill_attention_amx(q, k, v, 48**-0.5) is None  # 48: not whole tiles
    finally:
        torch.set_num_threads(previous)
    if not AMX:
        pytest.skip("this CPU has no AMX-BF16: only the declining was checked")


def attend_last(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """PyTorch's attention of q [qlen, heads, dim], the last qlen positions of k and v's t, query i seeing keys
    0..t - qlen + i."""
    qlen, t = q.shape[0], k.shape[0]
    causal = torch.arange(t)[None, :] <= torch.arange(t - qlen, t)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=causal,
                                         enable_gqa=True)
    return out.transpose(0, 1)


# (queries, keys, heads, kv_heads, head_dim): one query after a prefix, a chunk after a partial strip, a query block
# and one over after whole strips, Qwen3-0.6B's heads after 700 cached keys.
LATER_CHUNKS = [(1, 9, 2, 1, 32), (7, 40, 4, 2, 64), (65, 97, 2, 2, 32), (64, 128, 2, 1, 128), (130, 830, 16, 8, 128)]


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_prefill_attention_of_a_later_chunk_reads_keys_where_the_cache_holds_them(
        threads: int, variant_kernels: dict[str, CpuKernels]) -> None:
    """A chunk whose prompt began in earlier steps: its queries are the last of the keys, which are rows of a layer's
    flattened cache in any order (`slots`); the same bound against fp64 as a first chunk's, and the same result as
    the keys gathered into order. A slot outside the cache is refused."""
    gen = torch.Generator().manual_seed(4)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, kernels in variant_kernels.items():
            runs = AMX and name in AMX_OBJECTS
            for qlen, t, heads, kv_heads, dim in LATER_CHUNKS:
                q = torch.randn(qlen, heads, dim, generator=gen).to(BF16)
                k = torch.randn(t, kv_heads, dim, generator=gen).to(BF16)
                v = torch.randn(t, kv_heads, dim, generator=gen).to(BF16)
                rows = t + 37
                slots = torch.randperm(rows, generator=gen)[:t].contiguous()
                k_cache = torch.randn(rows, kv_heads, dim, generator=gen).to(BF16)
                v_cache = torch.randn(rows, kv_heads, dim, generator=gen).to(BF16)
                k_cache[slots], v_cache[slots] = k, v
                out = kernels.prefill_attention_amx(q, k_cache, v_cache, dim**-0.5, slots=slots)
                if not runs:
                    assert out is None, name
                    continue
                assert out is not None and out.shape == (qlen, heads, dim)
                exact = attend_last(q.double(), k.double(), v.double())
                ours = (out.double() - exact).abs().max().item()
                theirs = (attend_last(q, k, v).double() - exact).abs().max().item()
                assert ours <= 2 * theirs + 1e-3, f"{name} {qlen}/{t}x{heads}/{kv_heads}x{dim}: {ours} vs {theirs}"
                assert torch.equal(kernels.prefill_attention_amx(q, k, v, dim**-0.5), out)  # keys in order, no slots
            if runs:
                q, k = torch.zeros(2, 2, 32, dtype=BF16), torch.zeros(8, 1, 32, dtype=BF16)
                with pytest.raises(ValueError, match="outside"):
                    kernels.prefill_attention_amx(q, k, k, 1.0, slots=torch.tensor([0, 1, 8]))
    finally:
        torch.set_num_threads(previous)
    if not AMX:
        pytest.skip("this CPU has no AMX-BF16: only the declining was checked")


def test_the_backend_attends_prefill_chunks_on_amx_and_the_rest_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine/kernels.py turns it on for a bf16 model where the CPU has AMX (flags stood in); a chunk that starts
    its prompt goes to the kernel with its own keys, a later chunk with the cache and its keys' slots; fp32 models
    and chunks the kernel declines go to PyTorch's attention."""
    kernels = loader.load()
    if kernels is None:
        pytest.skip("no CPU kernels here")
    from qwenserve.engine import kernels as engine_kernels
    monkeypatch.setattr(engine_kernels, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
    assert select_kernels(EngineConfig(dtype="bfloat16"), CPU).attention.name == "torch+amx_prefill"
    assert select_kernels(EngineConfig(dtype="float32"), CPU).attention.name == "torch"
    monkeypatch.setattr(engine_kernels, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert select_kernels(EngineConfig(dtype="bfloat16"), CPU).attention.name == "torch+fp32_prefill"
    gen = torch.Generator().manual_seed(5)
    q, k, v = qkv_views(20, 4, 2, 32, gen)
    first = AttentionBatch(num_decodes=0, query_lens=[20], context_lens=[20], block_tables=[[0, 1]],
                           slot_mapping=torch.arange(20))
    exact = attend(q.double(), k.double(), v.double())

    def run(backend) -> torch.Tensor:
        k_cache, v_cache = torch.zeros(2, 16, 2, 32, dtype=BF16), torch.zeros(2, 16, 2, 32, dtype=BF16)
        return backend.forward(q, k, v, k_cache, v_cache, backend.prepare(first, CPU)).view(20, 4, 32)

    ours = run(select_backend("torch", CPU, BF16, 16, kernels, amx_prefill=True))
    assert (ours.double() - exact).abs().max() <= 2 * (attend(q, k, v).double() - exact).abs().max() + 1e-3
    calls = []
    monkeypatch.setattr(type(kernels), "prefill_attention_amx",
                        lambda self, *args: calls.append(args[0].shape) or None)  # declines: PyTorch's then
    torch.testing.assert_close(run(select_backend("torch", CPU, BF16, 16, kernels, amx_prefill=True)).float(),
                               attend(q, k, v).float(), rtol=0.01, atol=0.01)
    assert calls == [(20, 4, 32)]
    # A later chunk (its keys partly cached, in blocks 3 and 1 of the cache) goes to the kernel with the cache and
    # the keys' slots; where it declines, PyTorch's attention over the gathered keys gives the same.
    later = AttentionBatch(num_decodes=0, query_lens=[4], context_lens=[20], block_tables=[[3, 1]],
                           slot_mapping=torch.tensor([16, 17, 18, 19]))
    k_cache, v_cache = torch.zeros(4, 16, 2, 32, dtype=BF16), torch.zeros(4, 16, 2, 32, dtype=BF16)
    k_cache[3], v_cache[3] = k[:16], v[:16]
    results = []
    for declines in (False, True):
        if not declines:
            monkeypatch.undo()
        else:
            monkeypatch.setattr(type(kernels), "prefill_attention_amx",
                                lambda self, *args: calls.append((args[0].shape, args[5].tolist())) or None)
        backend = select_backend("torch", CPU, BF16, 16, kernels, amx_prefill=True)
        results.append(backend.forward(q[16:], k[16:], v[16:], k_cache.clone(), v_cache.clone(),
                                       backend.prepare(later, CPU)).view(4, 4, 32))
    assert calls == [(20, 4, 32), ((4, 4, 32), list(range(48, 64)) + [16, 17, 18, 19])]
    exact = attend(q.double(), k.double(), v.double())[16:]
    for result in results:
        assert (result.double() - exact).abs().max() <= 2 * (attend(q, k, v).double()[16:] - exact).abs().max() + 1e-3


def test_without_amx_a_bf16_models_prompts_are_attended_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine/kernels.py widens a bf16 model's prefill attention where the CPU has no AMX (flags stood in): a first
    chunk and a later one (keys partly cached) give fp32 attention of the same bf16 q, k, v rounded once, as near the
    exact as PyTorch's bf16 attention; fp32 models and AMX CPUs are left as they were."""
    from qwenserve.engine import kernels as engine_kernels
    for flags in ({"avx2"}, {"avx512f", "avx512_bf16"}):
        monkeypatch.setattr(engine_kernels, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert select_kernels(EngineConfig(dtype="bfloat16"), CPU).attention.name == "torch+fp32_prefill"
        assert select_kernels(EngineConfig(dtype="float32"), CPU).attention.name == "torch"
    gen = torch.Generator().manual_seed(7)
    q, k, v = qkv_views(37, 4, 2, 64, gen)
    backend = select_backend("torch", CPU, BF16, 16, None, widen_prefill=True)
    wide = attend(q.float(), k.float(), v.float()).to(BF16)
    exact = attend(q.double(), k.double(), v.double())
    first = AttentionBatch(num_decodes=0, query_lens=[37], context_lens=[37], block_tables=[[0, 1, 2]],
                           slot_mapping=torch.arange(37))
    k_cache, v_cache = torch.zeros(3, 16, 2, 64, dtype=BF16), torch.zeros(3, 16, 2, 64, dtype=BF16)
    ours = backend.forward(q, k, v, k_cache, v_cache, backend.prepare(first, CPU)).view(37, 4, 64)
    torch.testing.assert_close(ours.float(), wide.float(), rtol=2**-7, atol=2**-8)  # within a bf16 rounding
    assert (ours.double() - exact).abs().max() <= (attend(q, k, v).double() - exact).abs().max()
    # A later chunk: its first 32 keys cached (blocks 2 and 0), the last 5 its own.
    later = AttentionBatch(num_decodes=0, query_lens=[5], context_lens=[37], block_tables=[[2, 0, 1]],
                           slot_mapping=torch.arange(16, 21))
    k_cache, v_cache = torch.zeros(3, 16, 2, 64, dtype=BF16), torch.zeros(3, 16, 2, 64, dtype=BF16)
    k_cache[2], v_cache[2], k_cache[0], v_cache[0] = k[:16], v[:16], k[16:32], v[16:32]
    ours = backend.forward(q[32:], k[32:], v[32:], k_cache, v_cache, backend.prepare(later, CPU)).view(5, 4, 64)
    torch.testing.assert_close(ours.float(), wide[32:].float(), rtol=2**-7, atol=2**-8)
    assert (ours.double() - exact[32:]).abs().max() <= (attend(q, k, v).double()[32:] - exact[32:]).abs().max()
