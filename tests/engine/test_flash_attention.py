"""FlashAttentionBackend gives the torch backend's results over the same paged cache (CUDA with flash-attn only;
skipped, with the reason, elsewhere), and refuses what flash-attn's paged kernels cannot take everywhere."""

from __future__ import annotations

import pytest
import torch

from qwenserve.engine.attention import select_backend
from qwenserve.engine.attention.flash_backend import (
    FLASH_BLOCK_MULTIPLE,
    FlashAttentionBackend,
    flash_attn_available,
)
from qwenserve.engine.attention.torch_backend import TorchAttentionBackend
from qwenserve.models.forward_context import AttentionBatch

needs_flash = pytest.mark.skipif(not flash_attn_available(),
                                 reason="FlashAttentionBackend runs only where CUDA and the flash_attn package are")


def test_a_block_size_flash_attn_cannot_page_is_refused() -> None:
    with pytest.raises(ValueError, match=f"multiple of {FLASH_BLOCK_MULTIPLE}"):
        FlashAttentionBackend(16)


@pytest.mark.skipif(flash_attn_available(), reason="flash-attn is usable here")
def test_asking_for_flash_attn_where_it_cannot_run_fails_loudly() -> None:
    with pytest.raises(RuntimeError, match="flash_attn"):
        select_backend("flash_attn", torch.device("cpu"), torch.float32, FLASH_BLOCK_MULTIPLE)


def _attend(backend, q, k, v, k_cache, v_cache, batch: AttentionBatch) -> torch.Tensor:
    meta = backend.prepare(batch, q.device)
    return backend.forward(q, k, v, k_cache, v_cache, meta)


@needs_flash
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("decode_only", [True, False])
def test_flash_attention_equals_the_torch_backend(dtype: torch.dtype, decode_only: bool) -> None:
    """Scattered blocks, contexts across a block boundary, GQA; a pure decode step (flash_attn_with_kvcache) and
    a step of decodes with a prefill chunk continuing a cached prefix (flash_attn_varlen_func)."""
    device, bs, heads, kv_heads, dim = torch.device("cuda"), FLASH_BLOCK_MULTIPLE, 8, 2, 64
    gen = torch.Generator(device="cpu").manual_seed(0)
    num_blocks = 12
    k_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen).to(device, dtype)
    tables = [[5, 2], [7], [0, 9, 3]]
    context = [bs + 3, 40, 2 * bs + 100]
    query = [1, 1, 1] if decode_only else [1, 1, 60]
    slots = []
    for table, ctx, qlen in zip(tables, context, query, strict=True):
        slots += [table[p // bs] * bs + p % bs for p in range(ctx - qlen, ctx)]
    tokens = sum(query)
    q = torch.randn(tokens, heads, dim, generator=gen).to(device, dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=gen).to(device, dtype)
    v = torch.randn(tokens, kv_heads, dim, generator=gen).to(device, dtype)
    batch = AttentionBatch(query_lens=query, context_lens=context, block_tables=tables,
                           slot_mapping=torch.tensor(slots, device=device), num_decodes=2 if not decode_only else 3)
    caches = (k_cache.clone(), v_cache.clone())
    flash = _attend(FlashAttentionBackend(bs), q, k, v, *caches, batch)
    expected = _attend(TorchAttentionBackend(bs), q, k, v, k_cache, v_cache, batch)
    assert torch.equal(caches[0], k_cache) and torch.equal(caches[1], v_cache)  # both stored the new k/v alike
    torch.testing.assert_close(flash, expected, rtol=2e-2, atol=2e-2)
