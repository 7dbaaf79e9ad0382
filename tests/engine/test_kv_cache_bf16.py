"""A bf16 paged KV cache for an fp32 model on CPU (--kv-cache-dtype bfloat16): the decode kernel reads bf16 K/V
widened to fp32, and an engine that keeps its KV in bf16 decodes, caches prefixes, preempts and hands KV off as
one with fp32 KV does, and refuses a handoff from a cache of the other dtype."""

from __future__ import annotations

import shutil

import pytest
import torch

from qwenserve.cpu_kernels import loader
from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.engine.kv_handoff import KVImport
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.kv_layout import KVLayout, KVLayoutMismatch
from qwenserve.kv_transfer import ExporterConfig, KVExporter, KVTransport, compute_checksum
from tests.support.engine_checkpoints import random_prompts

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="no C compiler: the kernels cannot be built here")


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


# ---- an engine with a bf16 KV cache ---------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
BF16_KV = dict(kv_cache_dtype="bfloat16")


def tokens_of(outputs: list) -> list[list[int]]:
    return [[t for o in request for t in o.new_token_ids] for request in outputs]


def test_bf16_kv_cache_holds_twice_the_tokens_and_says_bfloat16(make_engine) -> None:
    engine = make_engine("qwen3_gqa4", num_kv_blocks=None, kv_cache_memory_gb=0.001, **BF16_KV)
    fp32 = make_engine("qwen3_gqa4", num_kv_blocks=None, kv_cache_memory_gb=0.001)
    assert engine.runner.kv_cache.dtype == torch.bfloat16 and engine.kv_layout().dtype == "bfloat16"
    assert engine.pool.num_blocks == 2 * fp32.pool.num_blocks
    assert fp32.kv_layout().dtype == "float32"


def test_bf16_kv_agrees_with_fp32_kv_teacher_forced(make_engine) -> None:
    """Top-1 of the bf16-KV engine at every position of the fp32 engine's greedy continuation: the prompt and the
    continuation are scored as one prompt in chunks of 16 tokens (each chunk reads the bf16 blocks before it), and
    the continuation is also decoded freely (the decode kernel on bf16 blocks)."""
    fp32 = make_engine("qwen3_gqa4", max_num_batched_tokens=16)
    bf16 = make_engine("qwen3_gqa4", max_num_batched_tokens=16, **BF16_KV)
    prompts = random_prompts(3, 9, 30, seed=11)
    expected = fp32.generate_sync(prompts, GREEDY)
    forced = [p + e for p, e in zip(prompts, expected, strict=True)]
    scored = bf16.generate_sync_outputs(forced, SamplingParams(max_tokens=1, prompt_logprobs=0))
    agree = total = 0
    for prompt, request in zip(prompts, scored, strict=True):
        ranks = [entry.rank for entry in request[0].prompt_logprobs][len(prompt) - 1:]
        agree += sum(rank == 1 for rank in ranks)
        total += len(ranks)
    assert total == 3 * 32 and agree / total >= 0.99
    decoded = bf16.generate_sync(prompts, GREEDY)
    same = sum(a == b for d, e in zip(decoded, expected, strict=True) for a, b in zip(d, e, strict=True))
    assert same / (3 * 32) >= 0.99


def test_bf16_kv_prefix_cache_hits_and_preemption_keep_the_tokens(make_engine) -> None:
    plain = make_engine("qwen3_untied", enable_prefix_caching=False, **BF16_KV)
    prefix = random_prompts(1, 40, 40, seed=4)[0]
    prompts = [prefix + tail for tail in random_prompts(3, 5, 9, seed=5)]
    expected = plain.generate_sync(prompts, GREEDY)
    cached = make_engine("qwen3_untied", **BF16_KV)
    assert cached.generate_sync(prompts[:1], GREEDY) == expected[:1]
    later = cached.generate_sync_outputs(prompts[1:], GREEDY)
    assert tokens_of(later) == expected[1:]
    assert [r[-1].usage.cached_prompt_tokens for r in later] == [40, 40]
    # 16 blocks of 8 tokens: three requests of up to 10 blocks cannot run together.
    tight = make_engine("qwen3_untied", num_kv_blocks=16, admission_watermark=0.0, enable_prefix_caching=False,
                        **BF16_KV)
    assert tight.generate_sync(prompts, GREEDY) == expected
    assert tight.stats().preemptions > 0


def _handoff(prefill, decode, prompt: list[int], sampling: SamplingParams) -> list[int]:
    buffers: list[torch.Tensor] = []

    def sink(layout: KVLayout, num_tokens: int) -> torch.Tensor:
        buffers.append(torch.empty(layout.token_shape(num_tokens), dtype=layout.torch_dtype()))
        return buffers[-1]

    outs = prefill.generate_sync_outputs([prompt], sampling, kv_export=sink)[0]
    assert outs[-1].finish_reason == "export"
    first = [t for o in outs for t in o.new_token_ids]
    assert buffers[0].dtype == torch.bfloat16
    handed = KVImport(buffers[0], prefill.kv_layout())
    return first + decode.generate_sync([prompt], sampling, resume_token_ids=first, kv_import=handed)[0]


def test_bf16_kv_handoff_continues_as_colocated_bf16_kv(make_engine) -> None:
    prefill = make_engine("qwen3_untied", block_size=8, **BF16_KV)
    decode = make_engine("qwen3_untied", block_size=16, **BF16_KV)
    prompts = random_prompts(2, 19, 37, seed=21)
    colocated = decode.generate_sync(prompts, GREEDY)
    for prompt, expected in zip(prompts, colocated, strict=True):
        assert _handoff(prefill, decode, prompt, GREEDY) == expected


def test_bf16_kv_handed_to_an_fp32_kv_engine_is_refused(make_engine) -> None:
    exporter = make_engine("qwen3_untied", **BF16_KV)
    importer = make_engine("qwen3_untied")
    with pytest.raises(KVLayoutMismatch, match="dtype"):
        importer.kv_layout().check_accepts(exporter.kv_layout())
    with pytest.raises(KVLayoutMismatch, match="dtype"):
        _handoff(exporter, importer, random_prompts(1, 12, 12, seed=2)[0], GREEDY)
    # Refused before anything was imported: the importer still serves the prompt itself.
    assert importer.generate_sync([[1, 2, 3]], SamplingParams(max_tokens=2))[0]


def test_bf16_kv_export_slot_is_checksummed_over_its_bf16_bytes(make_engine) -> None:
    engine = make_engine("qwen3_untied", **BF16_KV)
    prompt = random_prompts(1, 29, 29, seed=8)[0]
    sampling = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    config = ExporterConfig(transport=KVTransport.KV_TRANSPORT_GRPC, control_endpoint="127.0.0.1:1", use_shm=False,
                            pool_bytes=1 << 20)
    with KVExporter(config) as exporter:
        slots = []

        def slot_sink(layout: KVLayout, num_tokens: int) -> object:
            slots.append(exporter.reserve("bf16", layout, num_tokens))
            return slots[-1]

        engine.generate_sync_outputs([prompt], sampling, kv_export=slot_sink)
        kv = slots[0].tensor
        assert kv.dtype == torch.bfloat16 and kv.shape == engine.kv_layout().token_shape(len(prompt))
        handle = slots[0].publish(lease_s=5)
        assert handle.layout.dtype == "bfloat16"
        assert handle.checksum == compute_checksum(kv.contiguous().view(-1).view(torch.uint8))
        exporter.release("bf16")
